"""gpud.lock in gpud's directories, and made again when it is removed while gpud runs."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

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


@pytest.mark.parametrize(
    ("planted", "said"),
    [
        (lambda run: run.mkdir(mode=0o777) or run.chmod(0o777), "writable by every user"),
        (lambda run: run.mkdir(mode=0o755) or os.chown(run, 4242, 4242), "belongs to uid 4242"),
    ],
)
def test_a_run_directory_another_user_made_first_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, planted: Any, said: str
) -> None:
    """After ``rm -rf``, a directory another user made in its place (where they could plant
    ``gpud.lock -> /etc/passwd``) is refused as at the start, said once, and nothing is
    created in it."""
    run = tmp_path / "run"
    first = _take(tmp_path / "state", run)
    try:
        shutil.rmtree(run)
        planted(run)
        with caplog.at_level(logging.ERROR, logger="gpud.dirlock"):
            assert first.keep() == []
            assert first.keep() == []
        (record,) = caplog.records
        assert said in record.getMessage()
        assert list(run.iterdir()) == []
    finally:
        first.close()


def test_a_run_directory_that_cannot_be_read_is_said_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The run directory replaced by a file (ENOTDIR, as EIO or EACCES would be): said once,
    tried again at the next call, never an exception that fails the caller's step."""
    run = tmp_path / "run"
    first = _take(tmp_path / "state", run)
    try:
        shutil.rmtree(run)
        run.write_text("")
        with caplog.at_level(logging.ERROR, logger="gpud.dirlock"):
            assert first.keep() == []
            assert first.keep() == []
        (record,) = caplog.records
        assert "not a directory" in record.getMessage().lower()
        run.unlink()
        assert first.keep() == [run]
    finally:
        first.close()
