"""Hypothesis profiles for the unit tests, the root logger put back after each test, and a
directory under /tmp that users other than root may reach (`open_dir`).

``GPUD_HYPOTHESIS_PROFILE=mutation`` (set by tools/mutation.py) runs each property test
without shrinking and with a fixed seed: a mutant is killed by the first failing example,
and the same mutant always meets the same examples.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import Phase, settings

settings.register_profile(
    "mutation",
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    derandomize=True,
    database=None,
)
settings.load_profile(os.environ.get("GPUD_HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True)
def _root_logger_restored() -> Iterator[None]:
    """A test that runs ``gpud.main.main`` points the root logger at its captured stderr,
    which pytest closes afterwards: later tests' log lines would go to a closed file."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory under /tmp, mode 0755, removed afterwards: what users other than root reach
    (pytest's own ``tmp_path`` is under a 0700 one)."""
    path = Path(tempfile.mkdtemp(prefix="gpud-user-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)
