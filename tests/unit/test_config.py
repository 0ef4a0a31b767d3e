from pathlib import Path

import pytest

from gpud import config
from gpud.errors import ConfigError
from gpud.main import build_parser, load_config


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


@pytest.mark.parametrize(
    ("text", "key", "why"),
    [
        ("[telemetry]\ninterval = 1\n", "telemetry.interval", "unknown key"),
        ("[nope]\nx = 1\n", "nope", "unknown section"),
        ('[telemetry]\ninterval_s = "fast"\n', "telemetry.interval_s", "must be a number"),
        ("[telemetry]\ninterval_s = 0\n", "telemetry.interval_s", "must be > 0"),
        ("[telemetry]\ninterval_s = inf\n", "telemetry.interval_s", "finite"),
        ("[daemon]\ntick_s = nan\n", "daemon.tick_s", "finite"),
        ("[mig]\ndrain_timeout_s = inf\n", "mig.drain_timeout_s", "finite"),
        ('[mig]\non_start = "maybe"\n', "mig.on_start", "is not one of"),
        ('[metrics]\naddress = "nope"\n', "metrics.address", "is not HOST:PORT"),
        ("[metrics]\nenabled = 1\n", "metrics.enabled", "true or false"),
        ("telemetry = 3\n", "telemetry", "must be a table"),
        ('[backend]\nkind = "sim"\nsimulate = "Z80:1"\n', "backend.simulate", "Z80"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path: Path, text: str, key: str, why: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=why) as info:
        config.load(path)
    assert info.value.key == key
    assert info.value.path == str(path)
    assert str(path) in str(info.value)


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


def test_bad_flag_value_names_the_key() -> None:
    args = build_parser().parse_args(["--metrics-address", "x"])
    with pytest.raises(ConfigError, match=r"metrics\.address"):
        config.Config().with_overrides({"metrics.address": args.metrics_address})
