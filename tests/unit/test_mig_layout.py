"""mig-parted config files: parse as they are, resolve per GPU, export and read back."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpud.errors import ConfigError, InvalidArgument, NotFound
from gpud.mig.layout import (
    DeviceLayout,
    MigProfile,
    export_config,
    layout_from_json,
    layout_to_json,
    load_config,
    parse_config,
    resolve,
)
from tests.unit.mig_tables import identity_for

DATA = Path(__file__).parent.parent / "data" / "mig-parted"


def test_profile_names_parse_like_mig_parted() -> None:
    assert str(MigProfile.parse("1g.10gb")) == "1g.10gb"
    me = MigProfile.parse("1g.10gb+me")
    assert (me.gi_slices, me.memory_gb, me.attrs, me.ci_slices) == (1, 10, "+me", None)
    ci = MigProfile.parse("1c.3g.40gb")
    assert ci.gi_name == "3g.40gb" and ci.ci_slices == 1 and str(ci) == "1c.3g.40gb"
    assert MigProfile.parse("3c.3g.40gb") == MigProfile.parse("3g.40gb")
    assert MigProfile.parse("1g.24gb-me").attrs == "-me"
    for bad in ("1g", "10gb", "4c.3g.40gb", "g.10gb", "1g.10gb+"):
        with pytest.raises(InvalidArgument):
            MigProfile.parse(bad)


def test_example_file_parses() -> None:
    cfg = load_config(DATA / "config.yaml")
    assert cfg.version == "v1"
    assert {"all-disabled", "all-enabled", "all-1g.10gb", "all-balanced", "custom-config"} <= set(
        cfg.configs
    )
    (enabled,) = cfg.config("all-enabled")
    assert enabled.devices == "all" and enabled.layout == DeviceLayout(True, ())
    balanced = cfg.config("all-balanced")
    assert [e.device_filter for e in balanced] == [
        (0x233510DE,),
        (0x233010DE, 0x20B210DE),
        (0x20B010DE,),
    ]
    custom = cfg.config("custom-config")
    assert custom[0].devices == (0, 1, 2, 3) and not custom[0].layout.mig_enabled
    assert custom[4].layout.describe() == "1x 3g.20gb, 1x 2g.10gb, 2x 1g.5gb"


def test_device_filters_choose_the_entry_per_product() -> None:
    cfg = load_config(DATA / "config.yaml")
    gpus = [
        identity_for("H100-SXM5-80GB", 0),
        identity_for("A100-SXM4-40GB", 1),
        identity_for("H200-SXM-141GB", 2),
    ]
    layouts = resolve(cfg.config("all-balanced"), gpus)
    assert layouts[0].describe() == "1x 3g.40gb, 1x 2g.20gb, 2x 1g.10gb"
    assert layouts[1].describe() == "1x 3g.20gb, 1x 2g.10gb, 2x 1g.5gb"
    assert layouts[2].describe() == "1x 3g.71gb, 1x 2g.35gb, 2x 1g.18gb"
    # a GPU no entry matches is left alone, as mig-parted does
    h100_only = parse_config(
        'version: v1\nmig-configs:\n  x:\n    - device-filter: "0x2330"\n      devices: all\n'
        "      mig-enabled: false\n"
    )
    assert set(resolve(h100_only.config("x"), gpus)) == {0}


def test_a_config_the_file_lacks_is_refused_naming_the_file() -> None:
    """`gpuctl mig apply -f FILE -c nope` said `mig-configs: no config named 'nope'`,
    leaving out which file was read."""
    cfg = load_config(DATA / "config.yaml")
    with pytest.raises(InvalidArgument) as unknown:
        cfg.config("nope")
    assert str(unknown.value).startswith(
        f"mig-configs in {DATA / 'config.yaml'}: no config named 'nope' (the file has: "
    )


def test_device_indexes_and_bad_entries() -> None:
    gpus = [identity_for("A100-SXM4-40GB", i) for i in range(8)]
    cfg = load_config(DATA / "config.yaml")
    layouts = resolve(cfg.config("custom-config"), gpus)
    assert [layouts[i].mig_enabled for i in range(8)] == [False] * 4 + [True] * 4
    # an index the node lacks is an unknown GPU, as in every command: NotFound, not a bad field
    with pytest.raises(
        NotFound, match=r"no GPU with indexes 4, 5, 6, 7 on this node \(4 GPUs, indexes 0-3\)"
    ):
        resolve(cfg.config("custom-config"), gpus[:4])
    with pytest.raises(NotFound) as unknown:
        cfg.layouts("custom-config", gpus[:4])
    assert str(unknown.value).endswith(
        f"named in devices of mig-configs.custom-config in {DATA / 'config.yaml'}"
    )
    with pytest.raises(InvalidArgument, match="no config named 'nope'"):
        cfg.config("nope")
    clash = parse_config(
        "version: v1\nmig-configs:\n  x:\n    - {devices: all, mig-enabled: false}\n"
        "    - {devices: [0], mig-enabled: true}\n"
    )
    with pytest.raises(InvalidArgument, match="matches 2 entries"):
        resolve(clash.config("x"), gpus)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("version: v2\nmig-configs: {}\n", "version"),
        ("version: v1\n", "mig-configs"),
        ("version: v1\nmig-configs:\n  x: {devices: all}\n", "mig-configs.x"),
        ("version: v1\nmig-configs:\n  x:\n    - {devices: all}\n", "mig-configs.x[0]"),
        (
            "version: v1\nmig-configs:\n  x:\n    - {devices: all, mig-enabled: false, mig-devices: {1g.10gb: 1}}\n",
            "mig-configs.x[0]",
        ),
        (
            "version: v1\nmig-configs:\n  x:\n    - {devices: [a], mig-enabled: true}\n",
            "mig-configs.x[0]",
        ),
        (
            "version: v1\nmig-configs:\n  x:\n    - {devices: all, mig-enabled: true, mig-devices: {1g.10gb: -1}}\n",
            "mig-configs.x[0]",
        ),
        (
            "version: v1\nmig-configs:\n  x:\n    - {devices: all, mig-enabled: true, device-filter: zz}\n",
            "mig-configs.x[0]",
        ),
        (
            "version: v1\nmig-configs:\n  x:\n    - {devices: all, mig-enabled: true, extra: 1}\n",
            "mig-configs.x[0]",
        ),
        ("version: v1\nmig-configs: [\n", None),
    ],
)
def test_bad_files_name_the_key(text: str, key: str | None) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(text, path="f.yaml")
    assert err.value.path == "f.yaml"
    assert err.value.key == key


def test_json_is_accepted() -> None:
    cfg = parse_config(
        '{"version": "v1", "mig-configs": {"a": [{"devices": [0], "mig-enabled": true, "mig-devices": {"7g.80gb": 1}}]}}'
    )
    assert cfg.config("a")[0].layout.describe() == "1x 7g.80gb"


def test_export_round_trips() -> None:
    balanced = DeviceLayout.of(True, {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1})
    off = DeviceLayout(False)
    text = export_config("current", {0: balanced, 1: balanced}, gpu_count=2)
    doc = yaml.safe_load(text)
    assert doc == {
        "version": "v1",
        "mig-configs": {
            "current": [
                {
                    "devices": "all",
                    "mig-enabled": True,
                    "mig-devices": {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2},
                }
            ]
        },
    }
    mixed = export_config("now", {0: balanced, 1: off, 2: balanced}, gpu_count=3)
    back = parse_config(mixed).config("now")
    gpus = [identity_for("H100-SXM5-80GB", i) for i in range(3)]
    assert resolve(back, gpus) == {0: balanced, 1: off, 2: balanced}
    assert layout_from_json(layout_to_json(balanced)) == balanced
    assert layout_from_json(layout_to_json(off)) == off


def _alias_bomb(levels: int, where: str) -> str:
    """``levels`` anchors, each a list of ten of the one before: 10**levels values."""
    lines = ['l0: &l0 ["1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb",'
             ' "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb"]']  # fmt: skip
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\nversion: v1\n" + where.replace("BOMB", f"*l{levels}") + "\n"


@pytest.mark.parametrize(
    "where",
    [
        "version: BOMB",  # each of these used to be printed in full in its error message
        'mig-configs: {a: [{devices: all, mig-enabled: true, mig-devices: {"1g.10gb": BOMB}}]}',
        "mig-configs: {a: [{devices: all, mig-enabled: BOMB}]}",
        "mig-configs: BOMB",
    ],
)
def test_aliases_that_stand_for_too_many_values_are_refused(where: str) -> None:
    text = _alias_bomb(8, where)
    assert len(text) < 1000
    with pytest.raises(ConfigError, match=r"^x\.yaml: its aliases stand for more than 131072"):
        parse_config(text, path="x.yaml")


def test_a_few_aliases_still_parse() -> None:
    text = (
        "version: v1\nmig-configs:\n"
        '  a:\n    - &half {devices: [0], mig-enabled: true, mig-devices: {"3g.40gb": 2}}\n'
        "  b:\n    - *half\n    - {devices: [1], mig-enabled: false}\n"
    )
    parsed = parse_config(text)
    assert parsed.config("a") == parsed.config("b")[:1]
    assert parse_config(_alias_bomb(3, "mig-configs: {}")).configs == {}


def test_a_document_nested_too_deeply_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^x\.yaml: nested too deeply"):
        parse_config("a: " + "[" * 5000 + "]" * 5000, path="x.yaml")


@pytest.mark.parametrize("name", ["off", "on", "yes", "no", "null", "true", "010", "0x10", "1.0"])
def test_config_names_are_the_text_as_written(name: str) -> None:
    # YAML 1.1 reads an unquoted `off:` as false and `010:` as 8: a config is still found
    # by the name the file spells, and exported back under it
    cfg = parse_config(f"version: v1\nmig-configs:\n  {name}:\n    - devices: all\n"
                       "      mig-enabled: false\n")  # fmt: skip
    assert list(cfg.configs) == [name]
    assert cfg.config(name)[0].layout == DeviceLayout(False)
    back = parse_config(export_config(name, {0: DeviceLayout(False)}, gpu_count=1))
    assert list(back.configs) == [name]


@pytest.mark.parametrize(
    ("name", "shown"),
    [("a\\nb", r"'a\nb'"), ("\\x1b[2J", r"'\x1b[2J'"), ("tab\\there", r"'tab\there'")],
)
def test_a_config_name_no_c_can_give_is_refused_naming_the_file_and_its_place(
    name: str, shown: str
) -> None:
    # double-quoted YAML keys: the escapes are YAML's, read as the control characters
    text = f'version: v1\nmig-configs:\n  ok: []\n  "{name}": []\n'
    with pytest.raises(ConfigError) as err:
        parse_config(text, path="/etc/gpud/mig.yaml")
    said = str(err.value)
    assert said.startswith(f"/etc/gpud/mig.yaml:mig-configs: config name 2 ({shown}): "), said
    assert "only printable characters" in said and "\n" not in said and "\x1b" not in said


def test_a_config_that_matches_no_gpu_of_the_node_is_refused() -> None:
    # each GPU no entry matches is left alone, but a config none of whose entries matches
    # any GPU here would apply nothing and report success: the filter is named instead
    a100_only = parse_config(
        'version: v1\nmig-configs:\n  x:\n    - device-filter: ["0x20B010DE", "0x20B2"]\n'
        "      devices: all\n      mig-enabled: true\n      mig-devices: {1g.5gb: 7}\n",
        path="m.yaml",
    )
    gpus = [identity_for("H100-SXM5-80GB", i) for i in range(2)]
    with pytest.raises(InvalidArgument) as err:
        a100_only.layouts("x", gpus)
    assert err.value.field == "device-filter"
    message = str(err.value)
    assert "mig-configs.x in m.yaml" in message
    assert "0x20B010DE, 0x20B2" in message
    assert "GPUs 0, 1 (H100-SXM5-80GB, 0x233010DE)" in message
    empty = parse_config("version: v1\nmig-configs:\n  x: []\n", path="m.yaml")
    with pytest.raises(InvalidArgument, match=r"mig-configs.x in m.yaml has no entries"):
        empty.layouts("x", gpus)
    # a node without GPUs has nothing to match
    assert a100_only.layouts("x", []) == {}


def test_a_yaml_error_names_the_file_not_a_unicode_string() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config('version: v1\nmig-configs:\n  a: {"x": 1\n', path="/etc/mig.yaml")
    assert "<unicode string>" not in str(err.value)
    assert 'in "/etc/mig.yaml", line 4' in str(err.value)
