"""MIG layouts in ``nvidia-mig-parted``'s config format, read as it is and written back.

The format (``version: v1``)::

    mig-configs:
      all-balanced:
        - device-filter: ["0x233010DE", "0x20B210DE"]   # optional: PCI device ids
          devices: all                                  # or a list of GPU indexes
          mig-enabled: true
          mig-devices:
            "1g.10gb": 2        # one GPU instance per device, full-size compute instance
            "2g.20gb": 1
            "1c.3g.40gb": 1     # a 3g.40gb GPU instance holding a 1-slice compute instance

A device filter is the combined PCI id NVML reports (``device << 16 | vendor``, as
``nvidia-smi -q`` shows under "PCI Device/Vendor ID"); a GPU that no entry of the chosen
config matches is left alone, as mig-parted does. Matching one GPU with two entries is an
error here, since which one wins would be a guess.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from gpud.backend.port import GpuIdentity
from gpud.errors import ConfigError, InvalidArgument, NotFound
from gpud.shared import (
    MAX_LAYOUT_BYTES,
    check_config_name,
    read_regular,
    shown,
    utf8_text,
)

# [<C>c.]<G>g.<GB>gb[+attr|-attr...]: "1g.10gb", "1g.10gb+me", "1c.3g.40gb", "1g.24gb-me"
_PROFILE_RE = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.(\d+)gb((?:[+-][a-z][a-z.]*)*)$")


@dataclass(frozen=True, slots=True, order=True)
class MigProfile:
    """One ``mig-devices`` key: a GPU instance profile and the compute instance inside it."""

    gi_slices: int
    memory_gb: int
    attrs: str  # "", "+me", "-me", "+me.all", "+gfx"
    ci_slices: int | None  # None: one compute instance over the whole GPU instance

    @classmethod
    def parse(cls, text: str) -> MigProfile:
        m = _PROFILE_RE.match(text.strip())
        if m is None:
            raise InvalidArgument(
                f"{text!r} is not a MIG profile (expected e.g. '1g.10gb' or '1c.3g.40gb')",
                field="mig-devices",
            )
        ci, gi, mem, attrs = m.groups()
        ci_slices = int(ci) if ci is not None else None
        if ci_slices is not None and (ci_slices < 1 or ci_slices > int(gi)):
            raise InvalidArgument(
                f"{text!r}: a compute instance cannot have more slices than its GPU instance",
                field="mig-devices",
            )
        if ci_slices == int(gi):
            ci_slices = None  # "3c.3g.40gb" is the full-size compute instance
        return cls(int(gi), int(mem), attrs, ci_slices)

    @property
    def gi_name(self) -> str:
        """The GPU instance profile name as ``nvidia-smi mig -lgip`` prints it."""
        return f"{self.gi_slices}g.{self.memory_gb}gb{self.attrs}"

    def __str__(self) -> str:
        if self.ci_slices is None:
            return self.gi_name
        return f"{self.ci_slices}c.{self.gi_name}"


@dataclass(frozen=True, slots=True)
class DeviceLayout:
    """What one GPU should look like: MIG mode and how many of each MIG device."""

    mig_enabled: bool
    devices: tuple[tuple[MigProfile, int], ...] = ()  # sorted, counts > 0

    @classmethod
    def of(
        cls, mig_enabled: bool, devices: Mapping[str, int] | Mapping[MigProfile, int]
    ) -> DeviceLayout:
        counts: dict[MigProfile, int] = {}
        for key, count in devices.items():
            profile = key if isinstance(key, MigProfile) else MigProfile.parse(key)
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise InvalidArgument(
                    f"count for {key} must be a non-negative integer, not {count!r}",
                    field="mig-devices",
                )
            if count:
                counts[profile] = counts.get(profile, 0) + count
        if counts and not mig_enabled:
            raise InvalidArgument("mig-devices given with mig-enabled: false", field="mig-devices")
        return cls(mig_enabled, tuple(sorted(counts.items(), key=_display_order)))

    def profiles(self) -> list[MigProfile]:
        """One entry per MIG device, larger ones first."""
        return [p for p, n in self.devices for _ in range(n)]

    def to_dict(self) -> dict[str, Any]:
        """mig-parted's per-entry form, without ``devices``."""
        out: dict[str, Any] = {"mig-enabled": self.mig_enabled}
        if self.mig_enabled:
            out["mig-devices"] = {str(p): n for p, n in self.devices}
        return out

    def describe(self) -> str:
        if not self.mig_enabled:
            return "MIG disabled"
        if not self.devices:
            return "MIG enabled, no instances"
        return ", ".join(f"{n}x {p}" for p, n in self.devices)


def _display_order(item: tuple[MigProfile, int]) -> tuple[int, int, str, int]:
    p = item[0]
    return (-p.gi_slices, -p.memory_gb, p.attrs, -(p.ci_slices or p.gi_slices))


Devices = Literal["all"] | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ConfigEntry:
    """One list item of a named config."""

    devices: Devices
    device_filter: tuple[int, ...]  # empty: any device
    layout: DeviceLayout

    def matches(self, gpu: GpuIdentity) -> bool:
        if self.devices != "all" and gpu.index not in self.devices:
            return False
        if not self.device_filter:
            return True
        # A filter may be the full "0x233010DE" or only the device half "0x2330".
        return any(
            f == gpu.pci_device_id or (f <= 0xFFFF and f == gpu.pci_device_id >> 16)
            for f in self.device_filter
        )


@dataclass(frozen=True, slots=True)
class MigConfigFile:
    """A parsed mig-parted file: named configs, each a list of entries."""

    version: str
    configs: dict[str, tuple[ConfigEntry, ...]]
    path: str | None = None  # the file it was read from, for messages

    def layouts(
        self,
        name: str,
        gpus: Sequence[GpuIdentity],
        *,
        faults: Mapping[int, str] | None = None,
    ) -> dict[int, DeviceLayout]:
        """:func:`resolve` config ``name`` on ``gpus``, naming this file and config in errors.

        Each GPU no entry matches is left alone, as mig-parted does; a config that matches
        none of the GPUs (its device filters name other products) would apply nothing and
        report success, and is refused instead (:class:`InvalidArgument`), unless a GPU
        never read might match it (see :meth:`unjudged`). The refusal names the node's
        GPUs; one never read as unknown, with why from ``faults`` (GPU index -> reason).
        """
        entries = self.config(name)
        layouts = resolve(entries, gpus, where=self.where(name))
        if gpus and not layouts and not unjudged(entries, gpus, layouts):
            raise _matches_none(entries, gpus, self.where(name), faults or {})
        return layouts

    def unjudged(self, name: str, gpus: Sequence[GpuIdentity]) -> list[int]:
        """The GPUs config ``name`` may or may not give a layout: see :func:`unjudged`."""
        entries = self.config(name)
        return unjudged(entries, gpus, resolve(entries, gpus, where=self.where(name)))

    def where(self, name: str = "") -> str:
        """``mig-configs.NAME in PATH``: where config ``name`` is, for messages; with no
        name, ``mig-configs in PATH``, where all of them are."""
        return (
            "mig-configs" + (f".{name}" if name else "") + (f" in {self.path}" if self.path else "")
        )

    def config(self, name: str) -> tuple[ConfigEntry, ...]:
        try:
            return self.configs[name]
        except KeyError:
            known = ", ".join(sorted(self.configs)) or "none"
            # the file too: an operator with several layout files passed the wrong one
            raise InvalidArgument(
                f"no config named {name!r} (the file has: {known})", field=self.where()
            ) from None


# Aliases let a few hundred bytes stand for a billion values (each one repeats an anchor's
# whole tree), which reading or printing the document would then spell out. A document may
# stand for no more values than a file of the largest size could spell out without them.
MAX_LAYOUT_NODES = MAX_LAYOUT_BYTES


def _expanded_nodes(node: yaml.Node, seen: dict[int, int]) -> int:
    """How many nodes ``node`` stands for once every alias is spelled out (an anchor that
    holds itself counts once)."""
    known = seen.get(id(node))
    if known is not None:
        return known
    seen[id(node)] = 1
    total = 1
    if isinstance(node, yaml.SequenceNode):
        total += sum(_expanded_nodes(item, seen) for item in node.value)
    elif isinstance(node, yaml.MappingNode):
        total += sum(_expanded_nodes(k, seen) + _expanded_nodes(v, seen) for k, v in node.value)
    seen[id(node)] = total
    return total


class _Loader(yaml.SafeLoader):
    """Mapping keys are the text the file spells: names (configs, profiles, keys) are
    strings to mig-parted, and YAML 1.1 would read a config named ``off`` as false and one
    named ``010`` as 8, which ``-c off`` would then never find."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        self.flatten_mapping(node)  # "<<" merge keys, as SafeLoader has them
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key: Any = key_node.value
            else:  # a collection as a key: constructed (and refused as unhashable) as before
                key = self.construct_object(key_node, deep=deep)
            try:
                out[key] = self.construct_object(value_node, deep=deep)
            except TypeError as err:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found an unhashable key ({err})",
                    key_node.start_mark,
                ) from err
        return out


def _load_yaml(text: str, path: str | None) -> Any:
    loader = _Loader(text)
    if path is not None:
        loader.name = path  # marks in errors say where: the file, not "<unicode string>"
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_nodes(node, {}) > MAX_LAYOUT_NODES:
            raise ConfigError(
                f"its aliases stand for more than {MAX_LAYOUT_NODES} values: not a file of "
                "this kind",
                path=path,
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def parse_config(text: str, *, path: str | None = None) -> MigConfigFile:
    """Parse mig-parted YAML (JSON is YAML too). Raises :class:`ConfigError` naming the key."""
    try:
        doc = _load_yaml(text, path)
    except yaml.YAMLError as err:
        raise ConfigError(f"not valid YAML: {err}", path=path) from err
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ConfigError("nested too deeply: not a file of this kind", path=path) from None
    if not isinstance(doc, dict):
        raise ConfigError("expected a mapping with 'version' and 'mig-configs'", path=path)
    version = doc.get("version")
    if version != "v1":
        raise ConfigError(
            f"unsupported version {version!r} (expected 'v1')", path=path, key="version"
        )
    raw_configs = doc.get("mig-configs")
    if not isinstance(raw_configs, dict):
        raise ConfigError("expected a mapping of config names", path=path, key="mig-configs")
    configs: dict[str, tuple[ConfigEntry, ...]] = {}
    for position, (name, raw_entries) in enumerate(raw_configs.items(), start=1):
        _check_name_in_file(str(name), position, path)
        key = f"mig-configs.{name}"
        if not isinstance(raw_entries, list):
            raise ConfigError("expected a list of entries", path=path, key=key)
        entries = []
        for i, raw in enumerate(raw_entries):
            try:
                entries.append(_parse_entry(raw))
            except InvalidArgument as err:
                raise ConfigError(str(err), path=path, key=f"{key}[{i}]") from err
        configs[str(name)] = tuple(entries)
    return MigConfigFile(str(version), configs, path)


def _check_name_in_file(name: str, position: int, path: str | None) -> None:
    """Refuse a config name no ``-c`` can give (:func:`gpud.shared.check_config_name`: a newline, an
    escape sequence, past :data:`gpud.shared.MAX_CONFIG_NAME`), naming the file and where the name
    stands in ``mig-configs``; the name itself only as ``repr`` writes it, as it would
    split or rewrite the line that says so."""
    try:
        check_config_name(name, field="")
    except InvalidArgument as err:
        raise ConfigError(
            f"config name {position} ({shown(name, 64)}): {err}; no `-c` can name it",
            path=path,
            key="mig-configs",
        ) from None


def load_config(path: Path) -> MigConfigFile:
    """A mig-parted file named in gpud's config (``admission.mig_config``): only a regular
    file of at most ``MAX_LAYOUT_BYTES`` (:func:`read_regular`), as a named
    pipe with a writer would hold the daemon's admission for as long as it stays open, and
    /dev/zero never ends. A ConfigError naming ``path`` when it cannot be taken."""
    try:
        raw = read_regular(path, MAX_LAYOUT_BYTES, kind="a mig-parted config file")
    except OSError as err:
        raise ConfigError(f"cannot read: {err.strerror or err}", path=str(path)) from err
    try:
        text = utf8_text(raw)
    except ValueError as err:
        raise ConfigError(str(err), path=str(path)) from None
    return parse_config(text, path=str(path))


def _parse_entry(raw: object) -> ConfigEntry:
    if not isinstance(raw, dict):
        raise InvalidArgument("expected a mapping")
    unknown = set(raw) - {"devices", "device-filter", "mig-enabled", "mig-devices"}
    if unknown:
        raise InvalidArgument(f"unknown keys: {', '.join(sorted(map(str, unknown)))}")
    devices = _parse_devices(raw.get("devices"))
    device_filter = _parse_filter(raw.get("device-filter"))
    enabled = raw.get("mig-enabled")
    if not isinstance(enabled, bool):
        raise InvalidArgument("must be true or false", field="mig-enabled")
    mig_devices = raw.get("mig-devices") or {}
    if not isinstance(mig_devices, dict):
        raise InvalidArgument("expected a mapping of profile to count", field="mig-devices")
    layout = DeviceLayout.of(enabled, {str(k): v for k, v in mig_devices.items()})
    return ConfigEntry(devices, device_filter, layout)


def _parse_devices(raw: object) -> Devices:
    if raw == "all":
        return "all"
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = [raw]
    if (
        isinstance(raw, list)
        and raw
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw)
    ):
        return tuple(sorted(set(raw)))
    raise InvalidArgument("expected 'all' or a list of GPU indexes", field="devices")


def _parse_filter(raw: object) -> tuple[int, ...]:
    if raw is None:
        return ()
    items = raw if isinstance(raw, list) else [raw]
    out = []
    for item in items:
        try:
            out.append(int(str(item), 16))
        except ValueError:
            raise InvalidArgument(
                f"{item!r} is not a PCI device id like '0x233010DE'", field="device-filter"
            ) from None
    return tuple(out)


def resolve(
    entries: Sequence[ConfigEntry], gpus: Sequence[GpuIdentity], *, where: str = ""
) -> dict[int, DeviceLayout]:
    """The layout each GPU gets from one named config; GPUs no entry matches are absent.

    A GPU index the node lacks is :class:`NotFound` (as an unknown GPU is in every gpud
    command); ``where`` (e.g. ``"mig-configs.x in /etc/mig.yaml"``) says who named it.
    """
    present = {g.index for g in gpus}
    named = {d for e in entries if e.devices != "all" for d in e.devices}
    missing = sorted(named - present)
    if missing:
        plural = "es" if len(missing) > 1 else ""
        raise NotFound(
            f"no GPU with index{plural} {', '.join(map(str, missing))} on this node "
            f"({len(gpus)} GPUs, indexes {_index_forms(sorted(present))})"
            + (f", named in devices of {where}" if where else "")
        )
    out: dict[int, DeviceLayout] = {}
    for gpu in gpus:
        matched = [e for e in entries if e.matches(gpu)]
        if len(matched) > 1 and any(m.layout != matched[0].layout for m in matched):
            raise InvalidArgument(
                f"GPU {gpu.index} ({gpu.product}) matches {len(matched)} entries"
                + (f" of {where}" if where else "")
                + " with different layouts",
                field="devices",
            )
        if matched:
            out[gpu.index] = matched[0].layout
    return out


def unjudged(
    entries: Sequence[ConfigEntry],
    gpus: Sequence[GpuIdentity],
    layouts: Mapping[int, DeviceLayout],
) -> list[int]:
    """The GPUs without a layout in ``layouts`` (:func:`resolve`) that an entry with a
    ``device-filter`` names (by index or ``all``) but that were never read
    (:attr:`GpuIdentity.read`): their PCI device id (``nvidia-smi -q``: "Device Id") is
    unknown, so whether the filter matches them cannot be told. Whoever applies the config
    reports them, as faulty, instead of leaving them out as not matching."""
    return [
        g.index
        for g in gpus
        if not g.read
        and g.index not in layouts
        and any(e.device_filter and (e.devices == "all" or g.index in e.devices) for e in entries)
    ]


def _matches_none(
    entries: Sequence[ConfigEntry],
    gpus: Sequence[GpuIdentity],
    where: str,
    faults: Mapping[int, str],
) -> InvalidArgument:
    """The refusal of a config that matches none of ``gpus``, naming each GPU's product and
    PCI device id; a GPU never read has neither (its zero id is no fact), so it is named
    unknown with why it was never read (``faults``)."""
    if not entries:
        return InvalidArgument(f"{where} has no entries", field="mig-configs")
    filters = dict.fromkeys(f for e in entries for f in e.device_filter)  # in file order
    by_kind: dict[str, list[int]] = {}
    for g in gpus:
        if g.read:
            kind = f"{g.product}, {_pci_id(g.pci_device_id)}"
        else:
            why = faults.get(g.index)
            kind = "unknown, never read" + (f": {why}" if why else "")
        by_kind.setdefault(kind, []).append(g.index)
    here = "; ".join(
        f"GPU{'s' if len(indexes) > 1 else ''} {_index_forms(sorted(indexes))} ({kind})"
        for kind, indexes in by_kind.items()
    )
    return InvalidArgument(
        f"no entry of {where} matches a GPU of this node (filters "
        f"{', '.join(map(_pci_id, filters))}; the node has {here})",
        field="device-filter",
    )


def _pci_id(value: int) -> str:
    """A device-filter item as mig-parted spells it: 0x233010DE, or the device half 0x2330."""
    return f"0x{value:04X}" if value <= 0xFFFF else f"0x{value:08X}"


def _index_forms(indexes: Sequence[int]) -> str:
    if not indexes:
        return "none"
    if list(indexes) == list(range(indexes[0], indexes[-1] + 1)) and len(indexes) > 2:
        return f"{indexes[0]}-{indexes[-1]}"
    return ", ".join(map(str, indexes))


def export_config(name: str, layouts: Mapping[int, DeviceLayout], *, gpu_count: int) -> str:
    """mig-parted YAML for ``layouts``, one entry per distinct layout (``devices: all`` when
    every GPU has the same one), so that ``nvidia-mig-parted apply`` reads it unchanged."""
    return yaml.safe_dump(export_dict(name, layouts, gpu_count=gpu_count), sort_keys=False)


def export_dict(
    name: str, layouts: Mapping[int, DeviceLayout], *, gpu_count: int
) -> dict[str, Any]:
    groups: dict[DeviceLayout, list[int]] = {}
    for index in sorted(layouts):
        groups.setdefault(layouts[index], []).append(index)
    entries: list[dict[str, Any]] = []
    for layout, indexes in groups.items():
        devices: Any = "all" if len(groups) == 1 and len(indexes) == gpu_count else indexes
        entries.append({"devices": devices, **layout.to_dict()})
    return {"version": "v1", "mig-configs": {name: entries}}


def layout_to_json(layout: DeviceLayout) -> str:
    return json.dumps(layout.to_dict(), sort_keys=True)


def layout_from_json(text: str) -> DeviceLayout:
    raw = json.loads(text)
    return DeviceLayout.of(bool(raw["mig-enabled"]), raw.get("mig-devices") or {})
