"""gpud.lock in gpud's directories, and made again when it is removed while gpud runs."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from gpud.dirlock import LOCK_NAME, DirLocks
from gpud.errors import ConfigError


def _take(state: Path, run: Path) -> DirLocks:
    for d in (state, run):
        d.mkdir(exist_ok=True)
    return DirLocks.take({state: ("daemon.state_dir", 0o755), run: ("daemon.run_dir", 0o711)})


def test_a_removed_run_directory_gets_its_lock_back(tmp_path: Path) -> None:
    """``rm -rf /run/gpud``: until keep(), a second gpud (its own state directory, the same
    run directory) would take a new gpud.lock there and run beside the first; after it, it
    is refused as "already running"."""
    run = tmp_path / "run"
    first = _take(tmp_path / "state", run)
    try:
        assert first.keep() == []  # in place: nothing to do
        shutil.rmtree(run)
        assert first.keep() == [run]
        assert (run / LOCK_NAME).read_text() == f"{os.getpid()}\n"
        assert oct(run.stat().st_mode & 0o777) == "0o711"
        with pytest.raises(ConfigError, match="already running") as err:
            _take(tmp_path / "other", run)
        assert err.value.key == "daemon.run_dir"
        (run / LOCK_NAME).unlink()  # the file alone
        assert first.keep() == [run]
        assert first.keep() == []
    finally:
        first.close()


def test_a_lock_another_gpud_took_first_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    first = _take(tmp_path / "state", run)
    shutil.rmtree(run)
    second = _take(tmp_path / "other", run)  # the second gpud was quicker
    try:
        with caplog.at_level(logging.ERROR, logger="gpud.dirlock"):
            assert first.keep() == []
            assert first.keep() == []
        (said,) = caplog.records
        assert f"{run / LOCK_NAME} was removed while gpud ran and cannot be locked" in (
            said.getMessage()
        )
        assert "already running" in said.getMessage()
    finally:
        second.close()
        first.close()
