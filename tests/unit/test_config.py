import contextlib
import dataclasses
import datetime
import errno
import math
import os
import re
import resource
import signal
import socket
import stat
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, get_type_hints

import pytest

from gpud import config
from gpud.backend.sim import fakenvml
from gpud.dirlock import LOCK_NAME
from gpud.errors import ConfigError
from gpud.files import check_private
from gpud.main import (
    build_parser,
    load_config,
    load_layers,
    lock_dirs,
    main,
    mps_binary_warning,
    open_files_wanted,
)
from tests.unit.nvml_doubles import NoNvml, answering

if TYPE_CHECKING:
    from gpud.daemon import Daemon


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gpud.toml"
    path.write_text(text)
    return path


def test_missing_default_file_gives_defaults(tmp_path: Path) -> None:
    cfg = config.load(tmp_path / "absent.toml")
    assert cfg == config.Config()
    assert cfg.socket_path == Path("/run/gpud/gpud.sock")


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"absent\.toml: file not found"):
        config.load(tmp_path / "absent.toml", required=True)


def test_values_are_read_and_typed(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[telemetry]\ninterval_s = 2\n[daemon]\nstate_dir = "/tmp/x"\n[mig]\non_start = "report"\n',
    )
    cfg = config.load(path)
    assert cfg.telemetry.interval_s == 2.0
    assert cfg.daemon.state_dir == Path("/tmp/x")
    assert cfg.mig.on_start == "report"


_RATES = '[traffic]\nenabled = true\ninterfaces = ["e0"]\nlink_rates = [{}]\n'
_IE = "\u0435"  # CYRILLIC SMALL LETTER IE: one character, two bytes in UTF-8
_ETCD = (
    '[cluster]\nelection = "etcd"\nlisten = "127.0.0.1:0"\nca_file = "ca.pem"\n'
    'cert_file = "n1.pem"\nkey_file = "n1-key.pem"\n'
)


@pytest.mark.parametrize(
    ("text", "key", "why"),
    [
        ("[telemetry]\ninterval = 1\n", "telemetry.interval", "unknown key"),
        ("[nope]\nx = 1\n", "nope", "unknown section"),
        ('[telemetry]\ninterval_s = "fast"\n', "telemetry.interval_s", "must be a number"),
        ("[telemetry]\ninterval_s = 0\n", "telemetry.interval_s", "out of range"),
        ("[telemetry]\ninterval_s = inf\n", "telemetry.interval_s", "finite"),
        ("[daemon]\ntick_s = nan\n", "daemon.tick_s", "finite"),
        ("[mig]\ndrain_timeout_s = inf\n", "mig.drain_timeout_s", "finite"),
        ('[mig]\non_start = "maybe"\n', "mig.on_start", "is not one of"),
        ('[metrics]\naddress = "nope"\n', "metrics.address", "is not HOST:PORT"),
        ('[metrics]\naddress = "::1"\n', "metrics.address", "goes in brackets"),
        ('[metrics]\naddress = "999.1.1.1:9400"\n', "metrics.address", "not an IPv4 address"),
        ('[metrics]\naddress = "[1.2.3.4]:9400"\n', "metrics.address", "not an IPv6 address"),
        ('[metrics]\naddress = "a b:9400"\n', "metrics.address", "not a host name"),
        ("[metrics]\nenabled = 1\n", "metrics.enabled", "true or false"),
        ("telemetry = 3\n", "telemetry", "must be a table"),
        ('[backend]\nkind = "sim"\nsimulate = "Z80:1"\n', "backend.simulate", "Z80"),
        (_RATES.format('"e0=0.5bit"'), "traffic.link_rates", "outside 8 kbit/s to 10 Tbit/s"),
        (_RATES.format('"e0=1e30gbit"'), "traffic.link_rates", "outside 8 kbit/s"),
        (_RATES.format('"e0=1gbit", "e0=2gbit"'), "traffic.link_rates", "has a rate already"),
        (_RATES.format('"e1=1gbit"'), "traffic.link_rates", "an interface in traffic.interf"),
        # as in an interface name, no space: "e0 " would never match the interface e0
        (_RATES.format('"e0= 100 mbit"'), "traffic.link_rates", "'e0= 100 mbit': IF=RATE wit"),
        (_RATES.format('"e0 =1gbit"'), "traffic.link_rates", "without spaces, like eth0=100g"),
        (_RATES.format('"e0=1gbit\t"'), "traffic.link_rates", "without spaces"),
        # names no netdev can have (the kernel's dev_valid_name) are refused here, not
        # reported at run time as an interface without a link rate
        ('[traffic]\ninterfaces = ["a 0"]\n', "traffic.interfaces", "refuses ' ' in a name"),
        ('[traffic]\ninterfaces = ["a:0"]\n', "traffic.interfaces", "refuses ':' in a name"),
        ('[traffic]\ninterfaces = [".."]\n', "traffic.interfaces", "reserved by the kernel"),
        ('[traffic]\ninterfaces = ["abcdefghijklmnopqrst"]\n', "traffic.interfaces", "20 bytes"),
        # 8 Cyrillic letters are 8 characters but 16 bytes; "à" is c3 a0, and 0xa0 is a space
        # to the kernel
        (f'[traffic]\ninterfaces = ["{_IE * 8}"]\n', "traffic.interfaces", "16 bytes, the kernel"),
        ('[traffic]\ninterfaces = ["à0"]\n', "traffic.interfaces", "refuses 'à' in a name"),
        ('[traffic]\nrdma_interfaces = ["e 1"]\n', "traffic.rdma_interfaces", "refuses ' '"),
        ('[traffic]\ninterfaces = ["e0", "e1", "e0"]\n', "traffic.interfaces", "e0 listed twice"),
        ('[traffic]\nrdma_interfaces = ["e2", "e2"]\n', "traffic.rdma_interfaces", "e2 listed tw"),
        # the job's nftables rule names its cgroup in a quoted string
        (
            '[traffic]\ncgroup_parent = "gpud\\"x"\n',
            "traffic.cgroup_parent",
            "nftables cannot name a cgroup path with a double quote",
        ),
        ('[traffic]\ncgroup_parent = "a\\nb"\n', "traffic.cgroup_parent", "a line break"),
        ('[traffic]\ncgroup_parent = "gpud\\n"\n', "traffic.cgroup_parent", "a line break"),
        # DSCP 0 is untagged traffic: a job tagged 0 leaves its interface unenforced
        ("[traffic]\nreserved_dscp = []\n", "traffic.reserved_dscp", "DSCP 0 is untagged"),
        # a pool's items are ASCII DSCPs and ranges (spaces around them are harmless); what
        # int() would also take is most likely a typo (an empty item is skipped, said in a
        # warning: test_an_empty_item_of_a_dscp_pool_is_skipped_with_a_warning)
        ('[traffic]\ndscp_pool = "1_0"\n', "traffic.dscp_pool", "'1_0' is not a DSCP or a"),
        ('[traffic]\ndscp_pool = "+10"\n', "traffic.dscp_pool", "'\\+10' is not a DSCP or"),
        ('[traffic]\ndscp_pool = "\u0661\u0660"\n', "traffic.dscp_pool", "is not a DSCP or a"),
        # past int()'s digit limit: not a DSCP all the same, the number cut in the message
        (
            f'[traffic]\ndscp_pool = "{"9" * 5000}"\n',
            "traffic.dscp_pool",
            "^[^:]*:traffic.dscp_pool: '9{80}'... \\(5000 characters\\) is not a DSCP or a",
        ),
        ('[traffic]\ndscp_pool = "10-99999"\n', "traffic.dscp_pool", "is not a DSCP or a"),
        ('[traffic]\ndscp_pool = "10-+30"\n', "traffic.dscp_pool", "'10-\\+30' is not a D"),
        ('[traffic]\ndscp_pool = "10 12"\n', "traffic.dscp_pool", "'10 12' is not a DSCP"),
        (
            '[traffic]\nreserved_dscp = [8]\ndscp_pool = "0-5"\n',
            "traffic.reserved_dscp",
            "keep 0 in traffic.reserved_dscp",
        ),
        (
            "[traffic]\ntop_share = 0.9\nmin_share = 0.03\n",
            "traffic.top_share",
            "top_share 0.9 \\+ 4 levels x 0.03 \\+ default_share 0.02 exceed 1",
        ),
        ("[traffic]\nprogress_long_weight = 1.5\n", "traffic.progress_long_weight", "1.5"),
        # the gap limit: no gap is shorter than a spacing, and a huge one never stops a job
        ("[traffic]\nprogress_gap_spacings = 0\n", "traffic.progress_gap_spacings", "within"),
        ("[traffic]\nprogress_gap_spacings = -5\n", "traffic.progress_gap_spacings", "-5"),
        ("[traffic]\nprogress_gap_spacings = nan\n", "traffic.progress_gap_spacings", "nan"),
        ("[traffic]\nprogress_gap_spacings = 1e9\n", "traffic.progress_gap_spacings", "1000"),
        ("[traffic]\nprogress_gap_spacings = inf\n", "traffic.progress_gap_spacings", "inf"),
        ('[cluster]\nnode = "a b"\n', "cluster.node", "'a b' is not a DNS name"),
        ('[cluster]\nnode = "n1."\n', "cluster.node", "is not a DNS name"),
        ('[cluster]\nnode = "-n1"\n', "cluster.node", "is not a DNS name"),
        (
            _ETCD + "etcd_timeout_s = 30\nlease_ttl_s = 2\n",
            "cluster.etcd_timeout_s",
            r"30 s exceeds a quarter of cluster.lease_ttl_s \(2 s\)",
        ),
        (
            _ETCD + "node_timeout_s = 0.1\n[daemon]\ntick_s = 0.5\n",
            "cluster.node_timeout_s",
            r"less than 2 x daemon.tick_s \(0.5 s\) \+ cluster.report_timeout_s \(1 s\) = 2 s",
        ),
        (_ETCD + "[daemon]\ntick_s = 3\n", "cluster.node_timeout_s", "the leader would forget"),
        # etcd's user/password authentication needs both; either alone is never used
        (
            _ETCD + 'etcd_password_file = "pw"\n',
            "cluster.etcd_password_file",
            "needs cluster.etcd_username",
        ),
        (_ETCD + 'etcd_username = "gpud"\n', "cluster.etcd_username", "needs cluster.etcd_pass"),
        (
            _ETCD + 'etcd_endpoints = "https://gpud:secret@10.0.0.1:2379"\n',
            "cluster.etcd_endpoints",
            "no credentials in the URL: set cluster.etcd_username and cluster.etcd_password_file",
        ),
        (
            _ETCD + 'etcd_endpoints = "http://10.0.0.1:2379 http://10.0.0.2:2379"\n',
            "cluster.etcd_endpoints",
            "separate endpoints with commas",
        ),
        (
            _ETCD + 'etcd_endpoints = "http://10.0.0.1:2379/v3"\n',
            "cluster.etcd_endpoints",
            "no path: the client finds etcd's API path itself",
        ),
        (
            _ETCD + 'etcd_endpoints = "http://10.0.0.1:2379,,http://10.0.0.2:2379"\n',
            "cluster.etcd_endpoints",
            "an empty endpoint between commas",
        ),
        (
            _ETCD + 'etcd_endpoints = "http://10.0.0.1:2379,"\n',
            "cluster.etcd_endpoints",
            "an empty endpoint between commas",
        ),
        (
            _ETCD + 'etcd_endpoints = "http://127.0.0.1:0"\n',
            "cluster.etcd_endpoints",
            "needs its host and port",
        ),
        (
            _ETCD + 'etcd_endpoints = "http://:2379"\n',
            "cluster.etcd_endpoints",
            "needs its host and port",
        ),
    ],
)
def test_bad_config_names_file_and_key(tmp_path: Path, text: str, key: str, why: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=why) as info:
        config.load(path)
    assert info.value.key == key
    assert info.value.path == str(path)
    assert str(path) in str(info.value)


def test_the_gap_limit_is_a_traffic_key(tmp_path: Path) -> None:
    cfg = config.load(write(tmp_path, "[traffic]\nprogress_gap_spacings = 60\n"))
    assert cfg.traffic.progress_gap_spacings == 60
    assert config.load(write(tmp_path, "")).traffic.progress_gap_spacings == 20


def test_a_rate_is_tc_notation_without_space_inside() -> None:
    assert config.parse_rate(" 100gbit ") == 100 * 10**9  # as read from a command line
    with pytest.raises(ValueError, match="no space inside a rate"):
        config.parse_rate("100 mbit")


def test_interface_names_the_kernel_takes_are_accepted(tmp_path: Path) -> None:
    """15 bytes, a VLAN's dot, UTF-8 without a 0xa0 byte: ``ip link add`` takes them all."""
    names = ["abcdefghijklmno", "eth0.100", f"{_IE}\u04420", _IE * 7]
    listed = ", ".join(f'"{n}"' for n in names)
    cfg = config.load(write(tmp_path, f"[traffic]\ninterfaces = [{listed}]\n"))
    assert cfg.traffic.interfaces == tuple(names)


def test_cluster_defaults_load_with_etcd(tmp_path: Path) -> None:
    cfg = config.load(write(tmp_path, _ETCD + 'node = "gpu-07.example"\n'))
    assert cfg.cluster.election == "etcd" and cfg.cluster.node == "gpu-07.example"
    assert cfg.cluster.etcd_timeout_s == 1.0 and cfg.cluster.node_timeout_s == 5.0
    # the integration tests' cluster: at the bounds
    text = _ETCD + "etcd_timeout_s = 0.5\nlease_ttl_s = 2\nnode_timeout_s = 1.5\n"
    text += "report_timeout_s = 0.5\n[daemon]\ntick_s = 0.5\n"
    assert config.load(write(tmp_path, text)).cluster.node_timeout_s == 1.5


def test_not_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(write(tmp_path, "[telemetry\n"))


def test_flags_override_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[metrics]\naddress = "127.0.0.1:1"\n[daemon]\nrun_dir = "/a"\n')
    args = build_parser().parse_args(
        [
            "--config",
            str(path),
            "--simulate",
            "--metrics-address",
            "127.0.0.1:9999",
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    cfg = load_config(args)
    assert cfg.metrics.address == "127.0.0.1:9999"
    assert cfg.daemon.run_dir == tmp_path / "run"
    assert cfg.backend.kind == "sim"
    assert cfg.backend.simulate == config.DEFAULT_SIMULATE
    assert cfg.socket_path == tmp_path / "run" / "gpud.sock"


def test_a_file_changed_to_the_flags_value_is_not_said_to_be_overridden(tmp_path: Path) -> None:
    """``--log-level debug`` over a file's "info": the file changed to "debug" agrees with
    the flag, and a reload says nothing of it; changed to "warning", it does."""
    path = write(tmp_path, '[daemon]\nlog_level = "info"\n')
    args = build_parser().parse_args(["--config", str(path), "--log-level", "debug"])
    at_start = load_layers(args).file
    path.write_text('[daemon]\nlog_level = "debug"\n')
    assert config.overridden(at_start, load_layers(args), path=str(path)) == []
    path.write_text('[daemon]\nlog_level = "warning"\n')
    assert config.overridden(at_start, load_layers(args), path=str(path)) == [
        f"daemon.log_level changed in {path} but --log-level overrides it"
    ]


def test_relative_paths_are_taken_from_where_gpud_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # They reach processes that start elsewhere: MPS control daemons chdir to /, jobs run
    # in their user's directory (CUDA_MPS_PIPE_DIRECTORY, GPUD_SOCKET).
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, '[daemon]\nstate_dir = "state"\n[api]\nsocket = "s/gpud.sock"\n')
    args = build_parser().parse_args(["--config", "gpud.toml", "--run-dir", "run"])
    cfg = load_config(args)
    assert path == tmp_path / "gpud.toml"
    assert cfg.daemon.run_dir == tmp_path / "run"
    assert cfg.daemon.state_dir == tmp_path / "state"
    assert cfg.socket_path == tmp_path / "s" / "gpud.sock"


def test_a_directory_that_cannot_be_made_stops_start_up_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    code = main(
        [
            "--config",
            str(write(tmp_path, "")),
            "--simulate",
            "--state-dir",
            str(tmp_path / "state"),
            "--run-dir",
            str(tmp_path / "file" / "run"),
        ]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert (
        f"gpud: command line:daemon.run_dir: cannot create {tmp_path}/file/run: Not a directory"
        in err
    )


def test_a_file_where_a_directory_goes_is_named_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--simulate", "--state-dir", str(tmp_path / "state"), "--run-dir", str(tmp_path)]
    cfg = write(tmp_path, "")
    (tmp_path / "state").write_text("")
    assert main(["--config", str(cfg), *flags]) == 1
    err = capsys.readouterr().err
    assert (
        f"daemon.state_dir: cannot create {tmp_path}/state: it exists and is not a directory" in err
    )
    (tmp_path / "state").unlink()
    (tmp_path / "sim").write_text("")  # where the simulated node keeps its devices
    assert main(["--config", str(cfg), *flags]) == 1
    err = capsys.readouterr().err
    assert f"daemon.run_dir: cannot create {tmp_path}/sim: it exists and is not a directory" in err
    assert "Traceback" not in err


def test_check_config_refuses_a_file_where_a_directory_goes_naming_the_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The start exits 1 for it (restarted: see make_dirs); --check-config, run before a
    start, says it as the config error it is."""
    afile = tmp_path / "afile"
    afile.write_text("")
    for setting, said in (
        (f'[daemon]\nstate_dir = "{afile}"', f"daemon.state_dir: {afile} is a regular file"),
        (
            f'[daemon]\nrun_dir = "{afile}/run"',
            f"daemon.run_dir: cannot make {afile}/run: {afile} is a regular file",
        ),
        (
            f'[api]\nsocket = "{afile}/gpud.sock"',
            f"api.socket: {afile} is a regular file",
        ),
    ):
        cfg = write(tmp_path, f"{setting}\n[metrics]\nenabled = false\n")
        dirs = [] if "state_dir" in setting else ["--state-dir", str(tmp_path / "state")]
        dirs += [] if "run_dir" in setting else ["--run-dir", str(tmp_path / "run")]
        assert main(["--config", str(cfg), "--simulate", *dirs, "--check-config"]) == 2
        err = capsys.readouterr().err
        assert f"gpud: config error: {cfg}:{said}, not a directory: remove it or" in err
    cfg = write(tmp_path, f'[daemon]\nstate_dir = "{afile}"\n')
    assert main(["--config", str(cfg), "--simulate", "--run-dir", str(tmp_path / "run")]) == 1
    assert (
        f"gpud: {cfg}:daemon.state_dir: cannot create {afile}: it exists and is not a directory"
        in capsys.readouterr().err
    )


def test_check_config_warns_of_an_mps_control_binary_that_is_not_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Taken (the driver's tools may be installed after gpud starts: each device's daemon
    is started again until it runs), but said, naming the file and key."""
    flags = ["--simulate", "--state-dir", str(tmp_path / "s"), "--run-dir", str(tmp_path / "r")]
    setting = '[metrics]\nenabled = false\n[mps]\ncontrol_binary = "/nonexistent/x"\n'
    cfg = write(tmp_path, setting + "enabled = true\n")
    assert main(["--config", str(cfg), *flags, "--check-config"]) == 0
    said = f"gpud: warning: {cfg}:mps.control_binary: /nonexistent/x: no such file\n"
    assert said in capsys.readouterr().err
    (tmp_path / "x").write_text("")  # not executable
    cfg = write(
        tmp_path, setting.replace("/nonexistent/x", str(tmp_path / "x")) + "enabled = true\n"
    )
    assert main(["--config", str(cfg), *flags, "--check-config"]) == 0
    said = f"{cfg}:mps.control_binary: {tmp_path}/x: not an executable file"
    assert said in capsys.readouterr().err
    cfg = write(tmp_path, setting)  # MPS off: the binary is never run
    assert main(["--config", str(cfg), *flags, "--check-config"]) == 0
    assert "mps.control_binary" not in capsys.readouterr().err


def test_check_config_run_by_systemd_warns_of_a_watchdog_gap_past_watchdog_sec(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Taken (exit 0: a node may run well with it), but said when systemd gives the unit's
    WatchdogSec (WATCHDOG_USEC): the keys that make the gap and the WatchdogSec that fits;
    nothing without a watchdog."""
    flags = ["--simulate", "--state-dir", str(tmp_path / "s"), "--run-dir", str(tmp_path / "r")]
    cfg = write(tmp_path, "[daemon]\ntick_s = 60.0\n[telemetry]\ninterval_s = 2.0\n")
    assert main(["--config", str(cfg), *flags, "--check-config"]) == 0
    assert "WatchdogSec" not in capsys.readouterr().err
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert main(["--config", str(cfg), *flags, "--check-config"]) == 0
    (said,) = [line for line in capsys.readouterr().err.splitlines() if "WatchdogSec" in line]
    assert said.startswith("gpud: warning: "), said
    for part in ("telemetry.interval_s (2 s)", "29.0 s", "WatchdogSec=30s", "WatchdogSec=31s"):
        assert part in said, (part, said)


def test_a_key_left_at_its_default_is_named_alone_not_by_a_file_that_does_not_set_it(
    tmp_path: Path,
) -> None:
    """With no /etc/gpud/gpud.toml, or one that leaves ``daemon.state_dir`` out, an error
    about /var/lib/gpud names the key alone: the file neither sets it nor, maybe, exists."""
    afile = tmp_path / "afile"
    afile.write_text("")
    path = write(tmp_path, "[metrics]\nenabled = false\n")
    loaded, keys = config.read(path)
    assert keys == {"metrics.enabled"}
    assert config.read(tmp_path / "absent.toml") == (config.Config(), frozenset())
    # as where a built-in default cannot be made (a file in its way)
    daemon = dataclasses.replace(loaded.daemon, run_dir=afile / "run")
    cfg = dataclasses.replace(loaded, daemon=daemon)
    with pytest.raises(ConfigError) as info:
        config.check_dirs(cfg, path=str(path), flags=(), keys=keys)
    assert str(info.value).startswith(f"daemon.run_dir: cannot make {afile}/run: {afile} is")
    (tmp_path / "gpud.sock").write_text("")
    with pytest.raises(ConfigError) as info:
        config.check_socket_file(
            dataclasses.replace(cfg, daemon=dataclasses.replace(daemon, run_dir=tmp_path)),
            path=str(path),
            keys=keys,
        )
    assert str(info.value).startswith(f"daemon.run_dir: {tmp_path}/gpud.sock is ")
    assert config.source("metrics.enabled", path=str(path), flags=(), keys=keys) == str(path)
    flags = {"metrics.enabled"}
    assert config.source("metrics.enabled", path=str(path), flags=flags, keys=keys) == (
        config.FLAGS_SOURCE
    )


def test_the_default_control_binary_missing_is_warned_of_by_its_key_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The file enables MPS but leaves ``mps.control_binary`` at its default: the warning,
    by --check-config and at start, does not send the operator to the file for it."""
    dirs = ["--state-dir", str(tmp_path / "state"), "--run-dir", str(tmp_path / "run")]
    path = write(tmp_path, "[metrics]\nenabled = false\n[mps]\nenabled = true\n")
    binary = config.MpsConfig().control_binary
    args = ["--config", str(path), *dirs]
    no_driver = NoNvml(fakenvml.NVML_ERROR_DRIVER_NOT_LOADED)
    assert main(["--check-config", *args], nvml=no_driver) == 0
    err = capsys.readouterr().err
    assert f"gpud: warning: mps.control_binary: {binary}: no such file in PATH (" in err
    assert f"{path}:mps.control_binary" not in err
    assert main(args, nvml=no_driver) == 1  # the warning is logged before the GPUs fail
    err = capsys.readouterr().err
    assert f"WARNING gpud.main: mps.control_binary: {binary}: no such file in PATH (" in err
    assert f"{path}:mps.control_binary" not in err


def test_a_relative_control_binary_path_is_made_absolute_from_where_gpud_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As path keys are: the daemon and --check-config, run from different directories,
    would otherwise each run or judge a file of their own."""
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, '[mps]\ncontrol_binary = "bin/mps-control"\n')
    assert config.load(path).mps.control_binary == f"{tmp_path}/bin/mps-control"
    path = write(tmp_path, '[mps]\ncontrol_binary = "mps-control"\n')  # looked up in PATH
    assert config.load(path).mps.control_binary == "mps-control"


def test_the_control_binary_warning_says_the_uid_it_was_checked_as_when_not_root(
    tmp_path: Path,
) -> None:
    """A user other than root may be refused a binary root may run, or the reverse."""
    path = write(tmp_path, f'[mps]\nenabled = true\ncontrol_binary = "{tmp_path}/x"\n')
    cfg, keys = config.read(path)
    said = f"{path}:mps.control_binary: {tmp_path}/x: no such file"
    assert mps_binary_warning(cfg, path=str(path), keys=keys, uid=0) == said
    as_user = mps_binary_warning(cfg, path=str(path), keys=keys, uid=1000)
    assert as_user == f"{said} (checked as uid 1000)"


def test_the_control_binary_warning_says_a_script_whose_interpreter_is_missing_as_the_start_will(
    tmp_path: Path,
) -> None:
    """``ls`` shows it executable, and execve refuses it with ENOENT: warned of before the
    start in the words the start's ``mps.start_failed`` uses, not taken as one that runs."""
    orphan = tmp_path / "orphan-mps-control"
    orphan.write_text("#!/nonexistent/interpreter\n")
    orphan.chmod(0o755)
    path = write(tmp_path, f'[mps]\nenabled = true\ncontrol_binary = "{orphan}"\n')
    cfg, keys = config.read(path)
    assert mps_binary_warning(cfg, path=str(path), keys=keys, uid=0) == (
        f"{path}:mps.control_binary: {orphan}: exists but cannot be run (its interpreter or"
        " loader missing?)"
    )
    orphan.write_text("#!/bin/sh\n")
    assert mps_binary_warning(cfg, path=str(path), keys=keys, uid=0) == ""


def test_a_state_or_run_dir_that_is_or_sits_under_a_link_to_a_directory_is_taken(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As ``mkdir -p`` takes it; and a path that does not exist yet is made at start."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for state, run in (
        (tmp_path / "link", tmp_path / "link" / "run"),
        (tmp_path / "link" / "not" / "yet", tmp_path / "fresh" / "run"),
    ):
        path = write(
            tmp_path,
            f'[metrics]\nenabled = false\n[daemon]\nstate_dir = "{state}"\nrun_dir = "{run}"\n',
        )
        assert main(["--check-config", "--simulate", "--config", str(path)]) == 0
        assert capsys.readouterr().out == "config OK\n"


def test_a_link_to_a_file_where_a_directory_goes_is_said_as_the_link_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile").write_text("")
    link = tmp_path / "linkfile"
    link.symlink_to(tmp_path / "afile")
    path = write(tmp_path, f'[metrics]\nenabled = false\n[daemon]\nstate_dir = "{link}"\n')
    args = ["--check-config", "--simulate", "--config", str(path), "--run-dir", str(tmp_path)]
    assert main(args) == 2
    assert (
        f"{path}:daemon.state_dir: {link} is a symbolic link to a regular file, not a directory"
        in capsys.readouterr().err
    )


def test_a_socket_whose_directory_cannot_be_made_is_named_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    socket = tmp_path / "file" / "gpud.sock"
    flags = ["--simulate", "--state-dir", str(tmp_path / "state"), "--run-dir", str(tmp_path)]
    assert main(["--config", str(write(tmp_path, "")), *flags, "--socket", str(socket)]) == 1
    err = capsys.readouterr().err
    assert (
        f"gpud: command line:api.socket: cannot create {tmp_path}/file: it exists and is not"
        " a directory" in err
    )
    assert "Traceback" not in err


def test_a_lock_file_that_cannot_be_written_is_named_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    flags = ["--simulate", "--state-dir", str(tmp_path / "state"), "--run-dir", str(tmp_path)]
    assert main(["--config", str(write(tmp_path, "")), *flags]) == 1
    err = capsys.readouterr().err
    lock = tmp_path / "state" / LOCK_NAME
    assert f"gpud: daemon.state_dir: cannot write {lock}: No space left on device" in err


def test_a_metrics_port_another_process_holds_is_exit_1_for_a_restart_not_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shipped unit does not restart on exit 2 (a config error): a port held for a
    moment by another process would stop gpud for good."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        flags = [
            "--simulate",
            "--state-dir",
            str(tmp_path / "state"),
            "--run-dir",
            str(tmp_path),
            "--metrics-address",
            f"127.0.0.1:{port}",
        ]
        assert main(["--config", str(write(tmp_path, "")), *flags]) == 1
    err = capsys.readouterr().err
    assert f"cannot serve /metrics on 127.0.0.1:{port}: Address already in use" in err
    assert "metrics.address" in err


def test_a_second_gpud_on_the_same_directories_stops_before_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--simulate", "--state-dir", str(tmp_path / "state"), "--run-dir", str(tmp_path)]
    cfg = config.Config().with_overrides(
        {"daemon.state_dir": str(tmp_path / "state"), "daemon.run_dir": str(tmp_path)}
    )
    (tmp_path / "state").mkdir()
    held = lock_dirs(cfg)  # the first gpud
    try:
        assert main(["--config", str(write(tmp_path, "")), *flags]) == 1
        err = capsys.readouterr().err
        lock = tmp_path / "state" / LOCK_NAME
        assert (
            f"gpud: daemon.state_dir: another gpud (pid {os.getpid()}) holds {lock}:"
            " is gpud already running?" in err
        )
        assert not (tmp_path / "gpud.sock").exists()
        assert not (tmp_path / "state" / "state.db").exists()
        # Another state directory, the same run directory (its sockets, MPS pipes): stopped.
        other = ["--simulate", "--state-dir", str(tmp_path / "other"), "--run-dir", str(tmp_path)]
        assert main(["--config", str(write(tmp_path, "")), *other]) == 1
        assert (
            f"gpud: daemon.run_dir: another gpud (pid {os.getpid()}) holds {tmp_path}/{LOCK_NAME}"
            in capsys.readouterr().err
        )
    finally:
        held.close()
    lock_dirs(cfg).close()  # released: the next start takes it


def test_a_directory_every_user_may_write_to_is_refused_before_gpud_writes_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # daemon.run_dir = "/tmp"
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    (shared / LOCK_NAME).symlink_to(victim)  # what any user could leave there
    flags = ["--simulate", "--state-dir", str(tmp_path / "state"), "--run-dir", str(shared)]
    assert main(["--config", str(write(tmp_path, "")), *flags]) == 1
    assert (
        f"gpud: command line:daemon.run_dir: {shared} is writable by every user (mode 1777): gpud keeps its"
        " lock, socket and state files in a directory of its own" in capsys.readouterr().err
    )
    assert victim.read_text() == "root's file\n"


def test_check_config_refuses_a_state_dir_every_user_may_write_to_as_the_start_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--check-config, run before a start (ExecStartPre=), says what the start would
    refuse, in the start's words, rather than "config OK" for a gpud restarted forever."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    cfg = write(tmp_path, f'[daemon]\nstate_dir = "{shared}"\n[metrics]\nenabled = false\n')
    flags = ["--config", str(cfg), "--simulate", "--run-dir", str(tmp_path / "run")]
    said = (
        f"{cfg}:daemon.state_dir: {shared} is writable by every user (mode 777): gpud keeps"
        " its lock, socket and state files in a directory of its own"
    )
    assert main([*flags, "--check-config"]) == 2
    assert f"gpud: config error: {said}" in capsys.readouterr().err
    assert main(flags) == 1
    assert f"gpud: {said}" in capsys.readouterr().err


def test_a_directory_another_user_owns_is_refused(tmp_path: Path) -> None:
    st = os.stat_result((0o40755, 0, 0, 2, 1000, 1000, 0, 0, 0, 0))
    with pytest.raises(ConfigError, match="belongs to uid 1000, not to gpud's user"):
        check_private(tmp_path, st, "daemon.run_dir", euid=0)
    check_private(tmp_path, os.stat_result((0o40750, 0, 0, 2, 0, 0, 0, 0, 0, 0)), "k", euid=7)
    check_private(tmp_path, os.stat_result((0o40700, 0, 0, 2, 7, 0, 0, 0, 0, 0)), "k", euid=7)
    group_writable = os.stat_result((0o40770, 0, 0, 2, 0, 42, 0, 0, 0, 0))  # root:gpud 0770
    with pytest.raises(ConfigError, match=r"writable by group 42 \(mode 770\)"):
        check_private(tmp_path, group_writable, "api.socket", euid=0)


def test_the_lock_is_never_written_through_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    (tmp_path / LOCK_NAME).symlink_to(victim)
    cfg = config.Config().with_overrides(
        {"daemon.state_dir": str(tmp_path), "daemon.run_dir": str(tmp_path)}
    )
    with pytest.raises(ConfigError, match=f"cannot open {tmp_path}/{LOCK_NAME}"):
        lock_dirs(cfg)
    assert victim.read_text() == "root's file\n"


def test_under_umask_0_gpud_creates_nothing_others_may_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = config.Config().with_overrides(
        {"daemon.state_dir": str(tmp_path), "daemon.run_dir": str(tmp_path)}
    )
    held = lock_dirs(cfg)  # stops the start right after its directories are made
    before = os.umask(0)
    try:
        flags = ["--simulate", "--state-dir", str(tmp_path), "--run-dir", str(tmp_path / "run")]
        assert main(["--config", str(write(tmp_path, "")), *flags]) == 1
        assert "another gpud" in capsys.readouterr().err
        assert stat.S_IMODE((tmp_path / "run").stat().st_mode) == 0o711
        assert os.umask(0) == 0o022  # the socket, state.db, events.jsonl: 0755 or 0644 at most
    finally:
        os.umask(before)
        held.close()


def test_gpud_raises_its_open_files_limit_to_the_hard_one() -> None:
    # systemd's 1024: a thousand idle connections to api.tcp_address starved the socket
    assert open_files_wanted(1024, 524288) == 524288
    assert open_files_wanted(1024, resource.RLIM_INFINITY) == 1 << 20
    assert open_files_wanted(4096, 4096) == 4096
    assert open_files_wanted(resource.RLIM_INFINITY, resource.RLIM_INFINITY) == (
        resource.RLIM_INFINITY
    )


def test_simulate_help_names_the_products_it_takes() -> None:
    # as --simulate takes them: gpud's product keys (NVML's names are taken too)
    from gpud.backend.products import PRODUCTS

    text = " ".join(build_parser().format_help().split())
    for key in PRODUCTS:
        assert key in text
    assert "products as NVML names them" not in text


def test_bad_flag_value_names_the_key() -> None:
    args = build_parser().parse_args(["--metrics-address", "x"])
    with pytest.raises(ConfigError, match=r"metrics\.address"):
        config.Config().with_overrides({"metrics.address": args.metrics_address})


# --- every numeric key has a range, checked at start and on reload ---


def _numeric_keys() -> list[tuple[str, dataclasses.Field[object]]]:
    keys = []
    for section in dataclasses.fields(config.Config):
        cls = get_type_hints(config.Config)[section.name]
        hints = get_type_hints(cls)
        for key in dataclasses.fields(cls):
            if hints[key.name] in (int, float):
                keys.append((f"{section.name}.{key.name}", key))
    return keys


def test_every_numeric_key_declares_a_range() -> None:
    keys = _numeric_keys()
    assert len(keys) >= 5
    missing = [dotted for dotted, key in keys if config.RANGE not in key.metadata]
    assert missing == [], f"numeric keys without a range (declare one with ranged()): {missing}"
    for dotted, key in keys:
        low, high = key.metadata[config.RANGE]
        assert low <= key.default <= high, dotted  # the default is inside its own range


def _toml(dotted: str, value: object) -> str:
    section, key = dotted.split(".")
    return f"[{section}]\n{key} = {value!r}\n"


@pytest.mark.parametrize("dotted", [d for d, _ in _numeric_keys()])
def test_range_edges_are_in_and_one_step_beyond_is_out(tmp_path: Path, dotted: str) -> None:
    key = dict(_numeric_keys())[dotted]
    low, high = key.metadata[config.RANGE]
    is_int = isinstance(key.default, int)
    section, name = dotted.split(".")
    for edge in (low, high):
        value = getattr(getattr(config.load(write(tmp_path, _toml(dotted, edge))), section), name)
        assert value == edge
    step_below = low - 1 if is_int else math.nextafter(low, -math.inf)
    step_above = high + 1 if is_int else math.nextafter(high, math.inf)
    for bad in (step_below, step_above):
        path = write(tmp_path, _toml(dotted, bad))
        with pytest.raises(ConfigError) as info:
            config.load(path)
        assert info.value.key == dotted and info.value.path == str(path)
        assert f"{bad!r} is out of range: must be within [{low:g}, {high:g}]" in str(info.value)


@pytest.mark.parametrize(
    ("dotted", "value"),
    [
        ("telemetry.call_timeout_s", 1e10),  # the event loop's timers overflow
        ("telemetry.interval_s", 1e308),
        ("telemetry.history", 100_000_000_000),
        ("daemon.tick_s", 1e-9),
        ("mig.drain_timeout_s", 1e6),
    ],
)
def test_absurd_values_are_refused_naming_key_value_and_range(
    tmp_path: Path, dotted: str, value: object
) -> None:
    path = write(tmp_path, _toml(dotted, value))
    expected = f"{path}:{dotted}: {value!r} is out of range: must be within ["
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}"):
        config.load(path)


def test_flags_are_range_checked_too() -> None:
    with pytest.raises(ConfigError, match=r"^flags:telemetry\.interval_s: 0\.0 is out of range"):
        config.Config().with_overrides({"telemetry.interval_s": 0})


def test_reload_refuses_an_out_of_range_value_and_keeps_the_running_config(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, "[telemetry]\ninterval_s = 1e308\n")
    with _reloaded_from(tmp_path, path) as daemon:
        (event,) = daemon.events.recent(1, "config.reload_failed")
        assert "telemetry.interval_s: 1e+308 is out of range: must be within [0.01, 3600]" in (
            event.message
        )
        assert event.fields == {"path": str(path), "key": "telemetry.interval_s"}
        assert daemon.config.telemetry.interval_s == 1.0


@contextlib.contextmanager
def _reloaded_from(tmp_path: Path, path: Path) -> Iterator["Daemon"]:
    """A daemon on the tests' running config that was told to reload from ``path``."""
    from gpud.daemon import Daemon
    from gpud.main import mps_control_command, open_backend
    from gpud.notify import Notifier
    from tests.unit.test_daemon import make_config

    running = make_config(tmp_path)
    backend, sim = open_backend(running)
    daemon = Daemon(
        running,
        backend=backend,
        sim=sim,
        mps_control_command=mps_control_command(running),
        notifier=Notifier(None),
        reload_config=lambda: config.Layers(config.load(path), config.load(path)),
    )
    try:
        daemon.reload()
        yield daemon
    finally:
        daemon.sampler.close()
        daemon.store.close()
        daemon.backend.close()


def test_the_loopback_is_refused_in_traffic_interfaces_at_start_and_on_reload(
    tmp_path: Path,
) -> None:
    """HTB on ``lo`` would shape the node's own gRPC and etcd traffic, never GPU traffic."""
    path = write(tmp_path, '[traffic]\nenabled = true\ninterfaces = ["eth0", "lo"]\n')
    with pytest.raises(ConfigError, match="'lo' is the loopback") as info:
        config.load(path)
    assert info.value.key == "traffic.interfaces" and str(path) in str(info.value)
    with _reloaded_from(tmp_path, path) as daemon:
        (event,) = daemon.events.recent(1, "config.reload_failed")
        assert "traffic.interfaces: 'lo' is the loopback" in event.message
        assert event.fields == {"path": str(path), "key": "traffic.interfaces"}
        assert daemon.config.traffic.interfaces == ()


def test_the_loopback_in_an_old_file_with_traffic_off_is_warned_about_not_refused(
    tmp_path: Path,
) -> None:
    """A gpud upgraded under a file that lists ``lo`` but shapes nothing still starts (exit
    2 would keep systemd from restarting it at all), and says what enabling traffic meets."""
    path = write(tmp_path, '[traffic]\nenabled = false\ninterfaces = ["eth0", "lo"]\n')
    loaded = config.load(path)
    assert loaded.traffic.interfaces == ("eth0", "lo")
    (warning,) = config.config_warnings(loaded, path=str(path))
    assert warning.startswith(f"{path}:traffic.interfaces: 'lo' is the loopback")
    assert warning.endswith("refused once traffic.enabled = true")
    with _reloaded_from(tmp_path, path) as daemon:
        assert not daemon.events.recent(1, "config.reload_failed")
    enabled = write(tmp_path, '[traffic]\nenabled = true\ninterfaces = ["eth0", "lo"]\n')
    with pytest.raises(ConfigError, match="'lo' is the loopback"):
        config.load(enabled)


def test_a_reload_keeps_the_shaped_interfaces_until_a_restart(tmp_path: Path) -> None:
    """``traffic.interfaces`` is read once, by the service built at start: an interface
    taken out of the file on SIGHUP stays enforced, and counted from its last reading,
    until a restart builds a new service (with nothing read yet)."""
    path = write(tmp_path, '[traffic]\ninterfaces = ["eth9"]\n')
    with _reloaded_from(tmp_path, path) as daemon:
        (event,) = daemon.events.recent(1, "config.reload")
        assert "traffic.interfaces" in event.fields["restart_needed"]
        assert daemon.traffic.config.interfaces == daemon.config.traffic.interfaces == ()


def test_the_loopback_in_rdma_interfaces_is_refused_with_traffic_on_and_warned_about_off(
    tmp_path: Path,
) -> None:
    """``lo`` has no NIC, so no DSCP -> priority map to own: refused as in
    ``traffic.interfaces``, naming its own key, and only warned about with traffic off."""
    on = write(tmp_path, '[traffic]\nenabled = true\nrdma_interfaces = ["eth0", "lo"]\n')
    with pytest.raises(ConfigError, match="'lo' is the loopback: it has no NIC") as info:
        config.load(on)
    assert info.value.key == "traffic.rdma_interfaces" and str(on) in str(info.value)
    off = write(tmp_path, '[traffic]\nenabled = false\nrdma_interfaces = ["lo"]\n')
    (warning,) = config.config_warnings(config.load(off), path=str(off))
    assert warning.startswith(f"{off}:traffic.rdma_interfaces: 'lo' is the loopback")
    assert warning.endswith("refused once traffic.enabled = true")


def test_ignored_xids_are_a_list_of_xids_each_range_checked(tmp_path: Path) -> None:
    assert config.Config().telemetry.ignored_xids == (13, 31, 43, 45, 68, 109)
    loaded = config.load(write(tmp_path, "[telemetry]\nignored_xids = [13, 43]\n"))
    assert loaded.telemetry.ignored_xids == (13, 43)
    assert (
        config.load(write(tmp_path, "[telemetry]\nignored_xids = []\n")).telemetry.ignored_xids
        == ()
    )
    for bad, why in (
        ("[13, 0]", "0 is out of range: must be within [1, 999]"),
        ("[1000]", "1000 is out of range: must be within [1, 999]"),
        ("13", "must be an array"),
        ('["13"]', "must be an integer"),
    ):
        path = write(tmp_path, f"[telemetry]\nignored_xids = {bad}\n")
        with pytest.raises(ConfigError) as info:
            config.load(path)
        assert info.value.key == "telemetry.ignored_xids" and why in str(info.value), bad


@pytest.mark.parametrize(
    ("text", "key", "why"),
    [
        ('[metrics]\naddress = "127.0.0.1:\\u00b2"\n', "metrics.address", "is not HOST:PORT"),
        ('[api]\ntcp_address = "[::1]:\\u0663"\n', "api.tcp_address", "is not HOST:PORT"),
        ('[daemon]\nstate_dir = "/var/lib/x\\u0000y"\n', "daemon.state_dir", "NUL character"),
        ('[mps]\ncontrol_binary = "mps\\u0000"\n', "mps.control_binary", "NUL character"),
        # exec'd as is: each daemon's start would fail with "cannot run : Permission denied"
        ('[mps]\ncontrol_binary = ""\n', "mps.control_binary", "must name the MPS control"),
        ('[mps]\ncontrol_binary = "  "\n', "mps.control_binary", "must name the MPS control"),
    ],
)
def test_values_the_os_or_int_would_refuse_later_are_config_errors(
    tmp_path: Path, text: str, key: str, why: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=why) as info:
        config.load(path)
    assert info.value.key == key and info.value.path == str(path)


def test_a_config_path_that_is_no_regular_file_is_refused_without_blocking(
    tmp_path: Path,
) -> None:
    fifo = tmp_path / "gpud.toml"
    os.mkfifo(fifo)  # nobody writes: a plain read would wait for ever
    with pytest.raises(ConfigError, match=r"gpud\.toml: cannot read: not a regular file"):
        config.load(fifo, required=True)
    with pytest.raises(ConfigError, match=r"cannot read: Is a directory"):
        config.load(tmp_path, required=True)
    with pytest.raises(ConfigError, match=r"zero: cannot read: not a regular file"):
        config.load(Path("/dev/zero"), required=True)  # a device that never ends


def test_a_config_file_too_big_to_be_one_is_refused_unread(tmp_path: Path) -> None:
    """A file given by mistake (a log, a core file) is not read whole into memory."""
    path = write(tmp_path, "[telemetry]\ninterval_s = 2.0\n#" + "x" * config.MAX_CONFIG_BYTES)
    with pytest.raises(
        ConfigError,
        match=r"gpud\.toml: cannot read: 262174 bytes, more than a config file may hold "
        r"\(256 KiB\): is it the right file\?",
    ):
        config.load(path, required=True)
    path.write_text("[telemetry]\ninterval_s = 2.0\n#" + "x" * (config.MAX_CONFIG_BYTES - 30))
    assert config.load(path, required=True).telemetry.interval_s == 2.0  # at the limit: taken


def test_a_config_file_over_the_limit_is_refused_by_its_size_without_a_read(
    tmp_path: Path,
) -> None:
    """The size the file system gives is checked before a byte is read (a sparse file of
    terabytes, a file on a slow mount): the file's access time stays as it was."""
    path = write(tmp_path, "#" + "x" * config.MAX_CONFIG_BYTES)

    def read_at_all() -> bool:
        os.utime(path, (0, 1000))  # relatime: a read now sets the access time
        with contextlib.suppress(ConfigError):
            config.load(path, required=True)
        return path.stat().st_atime != 0

    os.truncate(path, config.MAX_CONFIG_BYTES)  # at the limit: read
    if not read_at_all():
        pytest.skip("this file system does not record reads (noatime)")
    os.truncate(path, config.MAX_CONFIG_BYTES + 1)
    assert not read_at_all()


def test_dev_null_as_the_config_means_all_defaults(tmp_path: Path) -> None:
    """`gpud --config /dev/null`: no settings, whatever link reaches it."""
    assert config.load(Path("/dev/null"), required=True) == config.Config()
    link = tmp_path / "gpud.toml"
    link.symlink_to("/dev/null")
    assert config.load(link, required=True) == config.Config()


def test_a_config_nested_too_deeply_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, "a = " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(ConfigError, match="not valid TOML: nested too deeply") as info:
        config.load(path)
    assert info.value.path == str(path)


def test_a_socket_path_too_long_for_a_unix_socket_is_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    long_dir = "/run/" + "d" * 100
    path = write(tmp_path, f'[daemon]\nrun_dir = "{long_dir}"\n')
    assert main(["--check-config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:daemon.run_dir: the socket {long_dir}/gpud.sock is 115 bytes long" in err
    # a short --socket makes the long run directory fine
    assert main(["--check-config", "--config", str(path), "--socket", "/run/g.sock"]) == 0
    args = ["--check-config", "--config", str(path), "--socket", f"{long_dir}/sock"]
    assert main(args) == 2
    assert "daemon.run_dir" not in capsys.readouterr().err


def test_a_flag_that_fails_a_check_is_named_as_the_command_line_not_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the file holds none of these keys: an error naming it would send the operator there
    path = write(tmp_path, "")
    long_dir = "/run/" + "d" * 100
    assert main(["--check-config", "--config", str(path), "--socket", f"{long_dir}/sock"]) == 2
    err = capsys.readouterr().err
    assert f"command line:api.socket: the socket {long_dir}/sock is 110 bytes long" in err
    assert main(["--check-config", "--config", str(path), "--run-dir", long_dir]) == 2
    assert "command line:daemon.run_dir: the socket " in capsys.readouterr().err
    args = ["--check-config", "--config", str(path), "--metrics-address", "192.0.2.7:9400"]
    assert main(args) == 2
    assert "command line:metrics.address: '192.0.2.7:9400': cannot serve on" in (
        capsys.readouterr().err
    )
    # set in the file, the file is named even when other flags are given
    path = write(tmp_path, f'[daemon]\nrun_dir = "{long_dir}"\n')
    assert main(["--check-config", "--config", str(path), "--simulate"]) == 2
    assert f"{path}:daemon.run_dir: the socket " in capsys.readouterr().err


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("nosuchhost.invalid:9400", "cannot serve on nosuchhost.invalid"),
        # TEST-NET-1 (RFC 5737): no address of this host
        ("192.0.2.7:9400", "cannot serve on 192.0.2.7: Cannot assign requested address"),
    ],
)
def test_check_config_finds_a_metrics_host_this_host_cannot_serve_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], address: str, why: str
) -> None:
    path = write(tmp_path, f'[metrics]\naddress = "{address}"\n')
    assert main(["--check-config", "--config", str(path)]) == 2
    assert f"{path}:metrics.address: {address!r}: {why}" in capsys.readouterr().err
    # a port in use (the running gpud's, during a reload check) is no error
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = write(tmp_path, f'[metrics]\naddress = "127.0.0.1:{port}"\n')
        assert main(["--check-config", "--config", str(path)]) == 0
    path = write(tmp_path, f'[metrics]\nenabled = false\naddress = "{address}"\n')
    assert main(["--check-config", "--config", str(path)]) == 0


def test_check_config_reads_the_mig_config_file_the_queue_would_offer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.yaml"
    path = write(tmp_path, f'[admission]\nmig_config = "{missing}"\n')
    assert main(["--check-config", "--config", str(path)]) == 2
    assert f"{path}:admission.mig_config: {missing}: " in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: v1\nmig-configs: 3\n")
    path = write(tmp_path, f'[admission]\nmig_config = "{bad}"\n')
    assert main(["--check-config", "--config", str(path)]) == 2
    assert f"{path}:admission.mig_config: " in capsys.readouterr().err
    good = tmp_path / "good.yaml"
    good.write_text(
        "version: v1\nmig-configs:\n  all-disabled:\n    - devices: all\n      mig-enabled: false\n"
    )
    path = write(tmp_path, f'[admission]\nmig_config = "{good}"\n')
    assert main(["--check-config", "--config", str(path)]) == 0


def test_a_mig_config_that_is_no_regular_file_is_refused_naming_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """``admission.mig_config`` is read only as a regular file of at most 128 KiB: a named
    pipe (which, with a writer, would hold the queue for as long as it stays open), a device
    that never ends and a 1 GiB file are refused at once, by ``--check-config`` and by the
    running gpud, naming the file and the key."""
    from gpud.admission.service import mig_file_layouts

    fifo = tmp_path / "layouts.fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse
    for named, said in (
        (fifo, "cannot read: not a regular file"),
        (Path("/dev/zero"), "cannot read: not a regular file"),
        (big, f"cannot read: {1 << 30} bytes, more than a mig-parted config file may hold"),
    ):
        path = write(tmp_path, f'[admission]\nmig_config = "{named}"\n')
        assert main(["--check-config", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"{path}:admission.mig_config: {named}: {said}" in err, err
        caplog.clear()
        with caplog.at_level("WARNING", logger="gpud.admission.service"):
            assert mig_file_layouts(named, list)() == {}
        assert f"admission.mig_config: {named}: {said}" in caplog.text


def test_a_socket_group_that_does_not_exist_names_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, '[api]\nsocket_group = "no-such-group-for-gpud"\n')
    assert main(["--check-config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:api.socket_group: group 'no-such-group-for-gpud' does not exist" in err
    path = write(tmp_path, '[api]\nsocket_group = "root"\n')
    assert main(["--check-config", "--config", str(path)]) == 0


def test_check_config_finds_a_tcp_address_this_host_cannot_serve_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, '[api]\ntcp_address = "192.0.2.7:7000"\n')
    assert main(["--check-config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:api.tcp_address: '192.0.2.7:7000': cannot serve on 192.0.2.7" in err
    path = write(tmp_path, '[api]\ntcp_address = "127.0.0.1:7000"\n')
    assert main(["--check-config", "--config", str(path)]) == 0


def test_check_config_warns_of_a_tcp_listener_serving_every_call_to_other_hosts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for address, access, warned in (
        ("0.0.0.0:7000", "full", True),
        ("[::]:7000", "full", True),
        ("0.0.0.0:7000", "read", False),  # the default: reads and jobs' reports only
        ("127.0.0.1:7000", "full", False),
        ("localhost:7000", "full", False),
    ):
        text = f'[api]\ntcp_address = "{address}"\ntcp_access = "{access}"\n'
        assert main(["--check-config", "--config", str(write(tmp_path, text))]) == 0
        err = capsys.readouterr().err
        assert (
            f'gpud: warning: api.tcp_access = "full" serves every call, changes included, to'
            f" whoever reaches api.tcp_address {address!r}" in err
        ) == warned, (address, access, err)
    with pytest.raises(ConfigError, match=r"api.tcp_access: 'write' is not one of 'read', 'full'"):
        config.from_dict({"api": {"tcp_access": "write"}})


def test_check_config_checks_the_cluster_certificates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tools.certs import make_ca, make_node

    make_ca(tmp_path)
    make_node(tmp_path, "n1", tmp_path, dns=("n1",))
    path = write(
        tmp_path,
        '[cluster]\nelection = "etcd"\nnode = "n1"\nlisten = "127.0.0.1:0"\n'
        f'ca_file = "{tmp_path}/ca.pem"\ncert_file = "{tmp_path}/n1.pem"\n'
        f'key_file = "{tmp_path}/n1-key.pem"\n',
    )
    assert main(["--check-config", "--config", str(path)], nvml=answering()) == 0
    assert capsys.readouterr().err == ""
    # as the start does: one expiring within a week (the earliest of a chain) is warned of
    soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=3)
    make_node(tmp_path, "n1", tmp_path, dns=("n1",), not_after=soon)
    assert main(["--check-config", "--config", str(path)], nvml=answering()) == 0
    out = capsys.readouterr()
    assert out.out == "config OK\n"
    assert f"gpud: warning: cluster.cert_file {tmp_path}/n1.pem expires at " in out.err, out.err
    (tmp_path / "n1.pem").write_text("not a certificate\n")
    assert main(["--check-config", "--config", str(path)], nvml=answering()) == 2
    err = capsys.readouterr().err
    assert f"cluster.cert_file: {tmp_path}/n1.pem: no PEM certificate" in err, err


def test_a_cluster_port_another_process_holds_is_named_with_its_key_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two gpuds on one host with the same cluster.listen: gRPC says only that the port
    "cannot listen"; the start names the key and the reason, and exits 1 as for
    metrics.address (the holder may be gone at the next try)."""
    from tools.certs import make_ca, make_node

    make_ca(tmp_path)
    make_node(tmp_path, "n1", tmp_path, dns=("n1",))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        path = write(
            tmp_path,
            '[cluster]\nelection = "etcd"\nnode = "n1"\n'
            f'listen = "127.0.0.1:{port}"\netcd_endpoints = "http://127.0.0.1:1"\n'
            f'ca_file = "{tmp_path}/ca.pem"\ncert_file = "{tmp_path}/n1.pem"\n'
            f'key_file = "{tmp_path}/n1-key.pem"\n',
        )
        flags = ["--simulate", "--state-dir", str(tmp_path / "state"), "--run-dir", str(tmp_path)]
        flags += ["--metrics-address", "127.0.0.1:0"]
        assert main(["--config", str(path), *flags]) == 1
    err = capsys.readouterr().err
    assert (
        f"cannot serve the cluster peer API on 127.0.0.1:{port}: Address already in use "
        "(cluster.listen; what holds it: ss -ltnp)"
    ) in err, err


@pytest.mark.parametrize("flag", ["--state-dir", "--run-dir", "--socket"])
def test_an_empty_path_flag_is_refused_not_taken_for_the_current_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    path = write(tmp_path, "")
    assert main(["--check-config", "--config", str(path), "--simulate", flag, ""]) == 2
    key = {"--state-dir": "daemon.state_dir", "--run-dir": "daemon.run_dir"}.get(flag, "api.socket")
    assert f"command line:{key}: must be a non-empty path string" in capsys.readouterr().err


def test_check_config_names_the_file_and_key_of_every_cluster_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tools.certs import make_ca, make_node

    make_ca(tmp_path)
    make_node(tmp_path, "n1", tmp_path, dns=("n1",))
    base = (
        '[cluster]\nelection = "etcd"\nnode = "n1"\n'
        f'ca_file = "{tmp_path}/ca.pem"\ncert_file = "{tmp_path}/n1.pem"\n'
        f'key_file = "{tmp_path}/n1-key.pem"\n'
    )
    path = write(tmp_path, base + 'listen = "127.0.0.1:0"\n')
    assert main(["--check-config", "--config", str(path)]) == 0
    for extra, where in [
        # the certificate is another node's: the config file that names it, too
        ('listen = "127.0.0.1:0"\nnode = "n2"\n', f"{path}:cluster.cert_file: "),
        # a peer address this host cannot serve on, as the start would find
        ('listen = "192.0.2.7:7443"\n', f"{path}:cluster.listen: '192.0.2.7:7443': cannot serve"),
        # files the start reads
        (
            f'listen = "127.0.0.1:0"\netcd_username = "gpud"\n'
            f'etcd_password_file = "{tmp_path}/none"\n',
            f"{path}:cluster.etcd_password_file: cannot read {tmp_path}/none",
        ),
        (
            f'listen = "127.0.0.1:0"\netcd_ca_file = "{tmp_path}/none.pem"\n',
            f"{path}:cluster.etcd_ca_file: cannot read {tmp_path}/none.pem",
        ),
    ]:
        text = base.replace('node = "n1"\n', "") if "node =" in extra else base
        path = write(tmp_path, text + extra)
        assert main(["--check-config", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert where in err, err


def test_check_config_checks_etcds_client_certificate_and_key_as_a_pair(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """etcd's HTTP client drops a certificate without its key (and a key without its
    certificate) and reports a bad file only as "etcd unreachable" on every call: each is
    a config error naming the key and the file, as for the peer API's files."""
    from tools.certs import make_ca, make_node

    make_ca(tmp_path)
    make_node(tmp_path, "n1", tmp_path, dns=("n1",))
    other = tmp_path / "other"
    make_ca(other)
    make_node(other, "gpud", other)
    base = (
        '[cluster]\nelection = "etcd"\nnode = "n1"\nlisten = "127.0.0.1:0"\n'
        f'ca_file = "{tmp_path}/ca.pem"\ncert_file = "{tmp_path}/n1.pem"\n'
        f'key_file = "{tmp_path}/n1-key.pem"\n'
    )
    cert, key = f"{other}/gpud.pem", f"{other}/gpud-key.pem"
    path = write(
        tmp_path,
        base + f'etcd_ca_file = "{other}/ca.pem"\n'
        f'etcd_cert_file = "{cert}"\netcd_key_file = "{key}"\n',
    )
    assert main(["--check-config", "--config", str(path)]) == 0
    for extra, where in [
        (
            f'etcd_cert_file = "{cert}"\n',
            "cluster.etcd_key_file: needed with cluster.etcd_cert_file",
        ),
        (
            f'etcd_key_file = "{key}"\n',
            "cluster.etcd_cert_file: needed with cluster.etcd_key_file",
        ),
        (
            f'etcd_cert_file = "{cert}"\netcd_key_file = "{tmp_path}/n1-key.pem"\n',
            f"cluster.etcd_key_file: {tmp_path}/n1-key.pem is not the key of the "
            f"certificate {cert}",
        ),
        (
            f'etcd_cert_file = "{key}"\netcd_key_file = "{key}"\n',
            f"cluster.etcd_cert_file: {key}: no PEM certificate can be read from it",
        ),
        (
            f'etcd_ca_file = "{key}"\n',
            f"cluster.etcd_ca_file: {key}: no PEM certificate can be read from it",
        ),
    ]:
        path = write(tmp_path, base + extra)
        assert main(["--check-config", "--config", str(path)]) == 2, extra
        err = capsys.readouterr().err
        assert f"{path}:{where}" in err, err


def _check_config_within(path: Path, timeout: float = 20.0) -> int:
    """``gpud --check-config --config PATH``'s exit code; a check that hangs fails the
    test (left on a daemon thread) rather than the run."""
    done: list[int] = []
    thread = threading.Thread(
        target=lambda: done.append(main(["--check-config", "--config", str(path)])), daemon=True
    )
    thread.start()
    thread.join(timeout)
    assert done, f"--check-config still runs after {timeout} s"
    return done[0]


@pytest.mark.parametrize(
    "key",
    [
        "ca_file",
        "cert_file",
        "key_file",
        "etcd_ca_file",
        "etcd_cert_file",
        "etcd_key_file",
        "etcd_password_file",
    ],
)
def test_a_cluster_file_that_is_a_pipe_or_too_big_is_refused_without_hanging(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    """The cluster's files are read at start, by --check-config and on a reload (on the
    event loop's behalf): a named pipe nobody writes to, a device, or a file far bigger
    than any certificate is a config error naming the key and the file, not a hang."""
    from gpud.cluster.tls import MAX_CLUSTER_FILE_BYTES
    from tools.certs import make_ca, make_node

    make_ca(tmp_path)
    make_node(tmp_path, "n1", tmp_path, dns=("n1",))
    files = {
        "ca_file": tmp_path / "ca.pem",
        "cert_file": tmp_path / "n1.pem",
        "key_file": tmp_path / "n1-key.pem",
        "etcd_ca_file": tmp_path / "ca.pem",
        "etcd_cert_file": tmp_path / "n1.pem",
        "etcd_key_file": tmp_path / "n1-key.pem",
        "etcd_password_file": tmp_path / "password",
    }
    files["etcd_password_file"].write_text("secret\n")
    fifo = tmp_path / "fifo.pem"
    os.mkfifo(fifo)  # nobody writes: a plain read waits for ever

    def check(named: Path) -> str:
        given = {**files, key: named}
        text = '[cluster]\nelection = "etcd"\nnode = "n1"\nlisten = "127.0.0.1:0"\n'
        text += 'etcd_username = "gpud"\n'
        text += "".join(f'{k} = "{v}"\n' for k, v in given.items())
        path = write(tmp_path, text)
        assert _check_config_within(path) == 2
        return capsys.readouterr().err

    try:
        err = check(fifo)
    finally:
        # unblock a read that waits (the old code's), so that its thread ends
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert f"gpud.toml:cluster.{key}: cannot read {fifo}: not a regular file" in err, err
    big = tmp_path / "big.pem"
    big.write_bytes(b"#" * (MAX_CLUSTER_FILE_BYTES + 1))
    err = check(big)
    assert (
        f"gpud.toml:cluster.{key}: cannot read {big}: {MAX_CLUSTER_FILE_BYTES + 1} bytes, more "
        "than a certificate, key or password file may hold (256 KiB): is it the right file?"
    ) in err, err


# gpud's console script with its loading stood in for by a wait: a Ctrl-C then
LOADING = """
import signal, sys, time
# as from a terminal: a shell without job control starts background commands with SIGINT
# ignored, and Python then leaves it so
signal.signal(signal.SIGINT, signal.default_int_handler)
import gpud, gpud.main

def loading() -> int:
    print("loading", flush=True)
    time.sleep(30)
    return 0

gpud.main.main = loading
sys.exit(gpud.daemon_entry())
"""


def test_ctrl_c_while_gpud_starts_stops_it_at_once_without_a_traceback() -> None:
    """Before the loop takes SIGINT as a stop, gpud ends on it as on SIGTERM (the default
    action), not with a KeyboardInterrupt traceback from the middle of an import."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LOADING],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "loading\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGINT and "Traceback" not in err
    with open(Path(__file__).parents[2] / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["project"]["scripts"]["gpud"] == "gpud:daemon_entry"


def test_a_dscp_pool_takes_spaces_around_its_items(tmp_path: Path) -> None:
    from gpud.net.tagstore import parse_pool

    spec = " 10 - 12 , 34 "
    path = write(tmp_path, f'[traffic]\ndscp_pool = "{spec}"\n')
    assert config.load(path).traffic.dscp_pool == spec
    assert parse_pool(spec, {0}) == {10, 11, 12, 34}


def test_an_empty_item_of_a_dscp_pool_is_skipped_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pool with an empty item ("10-30,", "10,,34") loads as it always has: gpud reads the
    traffic keys at start, so refusing it would leave gpud down after an upgrade. It is
    said, naming the file and the key, as a DSCP left out most likely."""
    from gpud.net.tagstore import parse_pool

    for spec, named in (("10-12,", {10, 11, 12}), ("10,,34", {10, 34}), (",10", {10})):
        path = write(
            tmp_path, f'[traffic]\nenabled = true\ninterfaces = ["eth0"]\ndscp_pool = "{spec}"\n'
        )
        assert parse_pool(config.load(path).traffic.dscp_pool, {0}) == named
        assert main(["--check-config", "--config", str(path)], nvml=answering()) == 0
        err = capsys.readouterr().err
        assert err == (
            f"gpud: warning: {path}:traffic.dscp_pool: {spec!r} has an empty item (nothing"
            " between two commas, or before or after them), skipped: a DSCP left out?\n"
        ), err
    # naming nothing at all is no pool, as before
    path = write(tmp_path, '[traffic]\ndscp_pool = ","\n')
    with pytest.raises(ConfigError, match="',' leaves no DSCP tag to hand out"):
        config.load(path)


def test_check_config_says_the_warnings_gpud_would_give_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Settings taken but odd (reserved DSCPs in the pool, NIC priorities that defeat the
    levels) are said by ``--check-config`` too, where a config is checked before a rollout."""
    path = write(
        tmp_path,
        '[traffic]\nenabled = true\ninterfaces = ["eth0"]\n'
        'dscp_pool = "10-12,46"\nlevel_priorities = [7, 7, 7, 7]\n',
    )
    assert main(["--check-config", "--config", str(path)], nvml=answering()) == 0
    out = capsys.readouterr()
    assert out.out == "config OK\n"
    # each named as a config error names it: FILE:key
    assert f"gpud: warning: {path}:traffic.dscp_pool: '10-12,46' names reserved DSCPs" in out.err
    assert "46 (in traffic.reserved_dscp)" in out.err
    assert (
        f"gpud: warning: {path}:traffic.level_priorities = [7, 7, 7, 7] maps every level" in out.err
    )
    plain = write(tmp_path, '[traffic]\nenabled = true\ninterfaces = ["eth0"]\n')
    assert main(["--check-config", "--config", str(plain)], nvml=answering()) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("code", "exit_code", "said"),
    [
        (fakenvml.NVML_ERROR_DRIVER_NOT_LOADED, 1, "`lsmod | grep nvidia`"),
        (fakenvml.NVML_ERROR_LIBRARY_NOT_FOUND, 69, "NVIDIA container runtime"),
        (fakenvml.NVML_ERROR_NO_PERMISSION, 77, "run gpud as root"),
    ],
)
def test_a_start_where_nvml_cannot_be_used_says_why_and_whether_it_is_restarted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], code: int, exit_code: int, said: str
) -> None:
    dirs = ["--state-dir", str(tmp_path / "state"), "--run-dir", str(tmp_path / "run")]
    path = write(tmp_path, "[metrics]\nenabled = false\n")
    assert main(["--config", str(path), *dirs], nvml=NoNvml(code)) == exit_code
    # the log's lines first: the directories made (gpud.main), none else
    logged, _, err = capsys.readouterr().err.partition("gpud: cannot use the GPUs: ")
    assert [line.split(" INFO ")[1].split(":")[0] for line in logged.splitlines()] == [
        "gpud.main",
        "gpud.main",
    ]
    err = "gpud: cannot use the GPUs: " + err
    assert err.startswith("gpud: cannot use the GPUs: nvmlInit failed: ")
    unit = (Path(__file__).parents[2] / "systemd" / "gpud.service").read_text()
    (prevent,) = [ln for ln in unit.splitlines() if ln.startswith("RestartPreventExitStatus=")]
    # a driver not loaded yet may load after gpud (a module built at boot): started again
    restarted = code == fakenvml.NVML_ERROR_DRIVER_NOT_LOADED
    assert said in err and ("started again" if restarted else "not restarted") in err
    assert (str(exit_code) in prevent.split("=")[1].split()) is not restarted
    # --check-config: the config is fine, and what a start would meet is said
    assert main(["--check-config", "--config", str(path), *dirs], nvml=NoNvml(code)) == 0
    out = capsys.readouterr()
    assert out.out == "config OK\n"
    assert "gpud: warning: a start would fail: nvmlInit failed: " in out.err and said in out.err


@pytest.mark.parametrize("kind", ["a directory", "a regular file", "a symbolic link"])
def test_a_socket_path_holding_something_else_is_a_config_error_before_the_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    taken = tmp_path / "gpud.sock"
    if kind == "a directory":
        taken.mkdir()
    elif kind == "a regular file":
        taken.write_text("")
    else:
        taken.symlink_to(tmp_path / "elsewhere.sock")
    path = write(tmp_path, f'[api]\nsocket = "{taken}"\n')
    assert main(["--check-config", "--config", str(path)]) == 2
    said = f"{path}:api.socket: {taken} is {kind}, not a socket"
    assert said in capsys.readouterr().err
    # a start stops there too, with the config's exit status (no restart mends it), having
    # made no directory and touched no GPU
    state, run = tmp_path / "state", tmp_path / "run"
    args = ["--config", str(path), "--simulate", "--state-dir", str(state), "--run-dir", str(run)]
    assert main(args) == 2
    assert said in capsys.readouterr().err
    assert not state.exists() and not run.exists()
    assert taken.is_symlink() or taken.exists()


def test_the_default_socket_path_holding_a_directory_names_the_run_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "run" / "gpud.sock").mkdir(parents=True)
    path = write(tmp_path, "")
    assert main(["--check-config", "--config", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"command line:daemon.run_dir: {tmp_path}/run/gpud.sock is a directory" in err


def test_a_stale_socket_at_the_path_is_no_config_error(tmp_path: Path) -> None:
    # what a killed gpud leaves: the start removes it once nothing listens there
    sock = tmp_path / "gpud.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))
    path = write(tmp_path, f'[api]\nsocket = "{sock}"\n')
    assert main(["--check-config", "--config", str(path)]) == 0
