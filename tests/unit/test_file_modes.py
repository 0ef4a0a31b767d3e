"""The modes of what gpud creates, whatever the umask it was started with: each test sets
the umask itself (a root shell's 022, or 077) and puts it back after."""

from __future__ import annotations

import argparse
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud import config, files
from gpud.daemon import close_state_files
from gpud.events import EventLog
from gpud.files import make_dirs, write_atomically
from gpud.main import main
from gpud.main import make_dirs as make_gpud_dirs
from gpud.store import StateStore
from tests.unit.nvml_doubles import NoNvml, answering


@pytest.fixture(params=[0o022, 0o077, 0o000], ids=["umask022", "umask077", "umask000"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    mask: int = request.param
    before = os.umask(mask)
    try:
        yield mask
    finally:
        os.umask(before)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_gpuds_directories_get_their_modes_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    """The state directory is closed to others (its database holds report tokens); the run
    directory, and the socket's, let the socket's group and jobs' MPS clients through (under
    umask 077 they were 0700), and directories made above them 0755."""
    cfg = config.Config().with_overrides(
        {
            "daemon.state_dir": str(tmp_path / "var" / "state"),
            "daemon.run_dir": str(tmp_path / "run"),
            "api.socket": str(tmp_path / "sock" / "gpud.sock"),
        }
    )
    said: list[str] = []
    make_gpud_dirs(cfg, said)
    assert oct(mode(tmp_path / "var" / "state")) == oct(0o750)
    assert oct(mode(tmp_path / "var")) == oct(0o755)
    assert oct(mode(tmp_path / "run")) == oct(0o711)
    assert oct(mode(tmp_path / "sock")) == oct(0o711)
    uid = os.geteuid()
    # each said once in the log, with its mode and owner: the socket's directory is made
    # without a word from systemd's RuntimeDirectory=
    assert said == [
        f"created {tmp_path}/var/state for daemon.state_dir (mode 0750, uid {uid}), and above"
        f" it {tmp_path}/var (mode 0755)",
        f"created {tmp_path}/run for daemon.run_dir (mode 0711, uid {uid})",
        f"created {tmp_path}/sock for api.socket (mode 0711, uid {uid})",
    ]
    again: list[str] = []
    make_gpud_dirs(cfg, again)
    assert again == []  # nothing made: nothing said


def test_the_line_for_a_made_directory_is_built_when_it_is_made(tmp_path: Path) -> None:
    """From the look taken to check it: a cleaner that removes it right after (a tmpfiles
    run) changes nothing of what is said, and raises nothing."""
    made = tmp_path / "run"
    said = files.make_dir(made, "daemon.run_dir", files.RUN_DIR_MODE)
    made.rmdir()
    assert said == f"created {made} for daemon.run_dir (mode 0711, uid {os.geteuid()})"


def test_a_start_that_fails_on_a_directory_says_those_it_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The state directory made, the run directory cannot be (a file in the way): gpud
    exits 1 saying both, so that what it left behind is known."""
    (tmp_path / "afile").write_text("")
    flags = ["--state-dir", str(tmp_path / "state"), "--run-dir", str(tmp_path / "afile" / "run")]
    config_file = tmp_path / "gpud.toml"
    config_file.write_text("")
    assert main(["--config", str(config_file), "--simulate", *flags]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        f"gpud: created {tmp_path}/state for daemon.state_dir (mode 0750, uid {os.geteuid()})"
    )
    assert err[1].startswith(
        f"gpud: command line:daemon.run_dir: cannot create {tmp_path}/afile/run: "
    ), err
    assert len(err) == 2


def test_the_directory_made_for_the_socket_is_said_in_the_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gpud --socket /x/missing/dir/gpud.sock`` makes the directory (0711, gpud's) and
    says so in one INFO line, once logging is set up."""
    from gpud.main import run

    socket = tmp_path / "missing" / "dir" / "gpud.sock"
    cfg = config.Config().with_overrides(
        {"daemon.run_dir": str(tmp_path / "run"), "api.socket": str(socket)}
    )
    made: list[str] = []
    make_gpud_dirs(cfg, made)
    said = [line for line in made if "api.socket" in line]
    assert said == [
        f"created {socket.parent} for api.socket (mode 0711, uid {os.geteuid()}), and above"
        f" it {tmp_path}/missing (mode 0755)"
    ]
    assert os.stat(socket.parent).st_uid == os.geteuid()
    # a node without the driver: run() sets up logging, says what was made, gives up
    assert run(cfg, argparse.Namespace(config=None), nvml=NoNvml(9), created=said) == 1
    assert f"INFO gpud.main: {said[0]}\n" in capsys.readouterr().err


def test_an_existing_directory_keeps_its_mode(tmp_path: Path, umask: int) -> None:
    (tmp_path / "d").mkdir()
    os.chmod(tmp_path / "d", 0o700)
    assert make_dirs(tmp_path / "d" / "e", 0o711) == [tmp_path / "d" / "e"]
    assert oct(mode(tmp_path / "d")) == oct(0o700)
    assert make_dirs(tmp_path / "d" / "e", 0o750) == []
    assert oct(mode(tmp_path / "d" / "e")) == oct(0o711)


def test_the_state_database_and_its_wal_are_closed_to_others(tmp_path: Path, umask: int) -> None:
    """state.db holds every reservation's report token: 0600, and SQLite gives its -wal and
    -shm the database's mode (under umask 022 all three were 0644)."""
    store = StateStore(tmp_path)
    store.ensure_schema(["CREATE TABLE IF NOT EXISTS t (a TEXT)"])
    with store.transaction() as conn:
        conn.execute("INSERT INTO t VALUES ('secret')")
    for name in ("state.db", "state.db-wal", "state.db-shm"):
        assert oct(mode(tmp_path / name)) == oct(0o600), name


def test_the_event_log_and_state_files_get_their_modes(tmp_path: Path, umask: int) -> None:
    events = EventLog(tmp_path / "events.jsonl", max_bytes=200)
    for n in range(5):  # past a rotation: the new file gets the mode too
        events.emit("test.event", f"event {n} " + "x" * 100)
    assert (tmp_path / "events.jsonl.1").exists()
    assert oct(mode(tmp_path / "events.jsonl")) == oct(0o640)
    write_atomically(tmp_path / "colo.json", "{}", mode=0o640)
    assert oct(mode(tmp_path / "colo.json")) == oct(0o640)
    write_atomically(tmp_path / "xid-faults.json", "{}")
    assert oct(mode(tmp_path / "xid-faults.json")) == oct(0o644)


def test_what_an_earlier_start_left_open_is_closed_and_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o755)
    for name, was in (("state.db", 0o644), ("state.db-wal", 0o644), ("events.jsonl", 0o666)):
        (state / name).write_text("")
        os.chmod(state / name, was)
    (state / "colo.json").write_text("")
    os.chmod(state / "colo.json", 0o600)  # tighter than gpud's: kept
    with caplog.at_level(logging.WARNING, logger="gpud.daemon"):
        closed = close_state_files(state)
        assert close_state_files(state) == []  # nothing more to say
    assert closed == [
        f"{state} (was 0755)",
        f"{state}/state.db (was 0644)",
        f"{state}/state.db-wal (was 0644)",
        f"{state}/events.jsonl (was 0666)",
    ]
    assert [r.getMessage() for r in caplog.records] == [
        "closed to other users what an earlier start left open: " + ", ".join(closed)
    ]
    assert oct(mode(state)) == oct(0o750)
    assert oct(mode(state / "state.db")) == oct(0o640)
    assert oct(mode(state / "events.jsonl")) == oct(0o640)
    assert oct(mode(state / "colo.json")) == oct(0o600)


def test_check_config_warns_of_a_cluster_key_other_users_may_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tools.certs import make_ca, make_node

    make_ca(tmp_path)
    make_node(tmp_path, "n1", tmp_path, dns=("n1",))
    key = tmp_path / "n1-key.pem"
    path = tmp_path / "gpud.toml"
    path.write_text(
        '[cluster]\nelection = "etcd"\nnode = "n1"\nlisten = "127.0.0.1:0"\n'
        f'ca_file = "{tmp_path}/ca.pem"\ncert_file = "{tmp_path}/n1.pem"\n'
        f'key_file = "{key}"\n'
    )
    os.chmod(key, 0o640)  # a group's (ssl-cert) is the operator's choice
    check = ["--check-config", "--config", str(path)]
    assert main(check, nvml=answering()) == 0
    assert capsys.readouterr().err == ""
    os.chmod(key, 0o644)
    assert main(check, nvml=answering()) == 0  # a warning, not a refusal
    out = capsys.readouterr()
    assert out.out == "config OK\n"
    assert out.err == (
        f"gpud: warning: cluster.key_file: {key} is open to every user (mode 0644): any local"
        f" user can read this node's secret: chmod o-rwx {key}\n"
    )


def test_what_cannot_be_closed_is_said_not_fatal(tmp_path: Path) -> None:
    """A file gpud may not chmod (another owner's, a read-only mount; here procfs, which
    refuses root too) is named in the warning, and the others are closed all the same: the
    start goes on (the state store says itself what it cannot open)."""
    from gpud.files import tighten_all

    loose = tmp_path / "events.jsonl"
    loose.write_text("")
    os.chmod(loose, 0o644)
    refused = Path("/proc/self/stat")  # 0444: beyond 0640, and no chmod there
    said = tighten_all([(refused, 0o640), (loose, 0o640)])
    assert said[0].startswith(f"{refused} (not closed: ") and said[1] == f"{loose} (was 0644)"
    assert oct(mode(loose)) == oct(0o640)
