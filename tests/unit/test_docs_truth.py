"""The hand-written reference docs agree with the code they describe.

- docs/configuration.md's table: every key of :class:`gpud.config.Config` once, with its
  default, its range, the ``gpud`` flag that sets it and whether a reload applies it;
- the metric names README.md and docs/ name are ones gpud exports, and every family gpud
  exports is in docs/metrics.md, with its labels;
- README.md shows every ``gpuctl`` command, and every ``gpuctl`` command line it shows parses
  (its words name a command, its ``--flags`` are that command's);
- README.md's table of gpuctl's exit codes lists each code gpuctl gives of its own, and no
  other.

Only files are read: nothing runs.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import json
import math
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpud import config
from gpud.cli.main import build_parser as build_gpuctl_parser
from gpud.daemon import RESTART_KEYS
from gpud.errors import ERROR_TABLE, ConfigError
from gpud.main import build_parser as build_gpud_parser
from gpud.main import flag_overrides

ROOT = Path(__file__).resolve().parents[2]
CONFIGURATION = ROOT / "docs" / "configuration.md"
README = ROOT / "README.md"

# ---------------------------------------------------------------- docs/configuration.md

# Keys whose code default (None or "") stands for a value worked out at start: the table
# says what it is instead.
WORKED_OUT = {
    "api.socket": "`<run_dir>/gpud.sock`",
    "cluster.node": "host name",
    "cluster.advertise": "`listen`",
}


@dataclasses.dataclass(frozen=True)
class Row:
    keys: tuple[str, ...]
    default: str
    flag: str
    meaning: str


def config_rows(text: str) -> list[Row]:
    """The rows of the reference table: ``| `key`[, `key2`...] | default | flag | meaning |``;
    a bare name after the first key is of the first key's section."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        key_cell, default, flag, meaning = cells[0], cells[1], cells[2], "|".join(cells[3:])
        names = re.findall(r"`([^`]+)`", key_cell)
        section = names[0].partition(".")[0]
        keys = tuple(n if "." in n else f"{section}.{n}" for n in names)
        rows.append(Row(keys, default, flag, meaning))
    return rows


def code_defaults() -> dict[str, Any]:
    defaults = {}
    cfg = config.Config()
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for key in dataclasses.fields(values):
            defaults[f"{section.name}.{key.name}"] = getattr(values, key.name)
    return defaults


NOT_A_VALUE = object()  # a default cell that is empty or prose


def documented_default(cell: str) -> Any:
    """The value a default cell gives: its first code span read as TOML (``1.0``, ``[]``,
    ``""``, ``true``), a bare word as a string; ``unset`` as None."""
    if cell == "unset":
        return None
    span = re.match(r"`([^`]*)`", cell)
    if span is None:
        return NOT_A_VALUE
    raw = span.group(1)
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def same_default(documented: Any, code: Any) -> bool:
    if documented is NOT_A_VALUE:
        return False
    if documented is None:
        return code is None or code == ""
    if isinstance(code, bool) or isinstance(documented, bool):
        return documented is code
    if isinstance(code, int | float) and isinstance(documented, int | float):
        return math.isclose(documented, code)
    if isinstance(code, tuple):
        return isinstance(documented, list) and tuple(documented) == code
    return isinstance(documented, str) and documented == str(code)


_NUMBER = r"-?\d+(?:\.\d+)?"
_UNIT = r"(?:\s*(s|days?)\b)?"
_RANGES = (
    re.compile(rf"\[({_NUMBER}), ({_NUMBER})\]"),
    re.compile(rf"({_NUMBER}){_UNIT}\s*(?:to|\.\.)\s*({_NUMBER}){_UNIT}"),
)


def documented_ranges(meaning: str) -> set[tuple[float, float]]:
    """Every ``LOW to HIGH``, ``LOW..HIGH`` and ``[LOW, HIGH]`` in a meaning, in seconds
    where the bounds carry ``s`` or ``days``."""
    found = set()
    for pattern in _RANGES:
        for match in pattern.finditer(meaning.replace("\u202f", " ")):
            groups = match.groups()
            if len(groups) == 2:
                found.add((float(groups[0]), float(groups[1])))
                continue
            low, low_unit, high, high_unit = groups
            scale = {"day": 86400.0, "days": 86400.0}
            found.add(
                (
                    float(low) * scale.get(low_unit or "", 1.0),
                    float(high) * scale.get(high_unit or "", 1.0),
                )
            )
    return found


def flags_by_key() -> dict[str, set[str]]:
    """The ``gpud`` flags that set each config key, found by giving each flag alone to the
    parser and reading :func:`flag_overrides`."""
    parser = build_gpud_parser()
    found: dict[str, set[str]] = {}
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0:
            continue
        flag = action.option_strings[-1]
        argv = [flag] if action.nargs == "?" else [flag, str((action.choices or ["x"])[0])]
        for key in flag_overrides(parser.parse_args(argv)):
            found.setdefault(key, set()).add(flag)
    return found


def restart_marked(rows: list[Row]) -> set[str]:
    """Keys a row marks *restart*, or a section a row says is *restart* as a whole
    ("like every `traffic.*` key")."""
    marked = set()
    whole = set()
    for row in rows:
        if "*restart*" in row.meaning:
            marked.update(row.keys)
        whole.update(re.findall(r"\*restart\*, like every `(\w+)\.\*` key", row.meaning))
    return marked | {k for k in code_defaults() if k.partition(".")[0] in whole}


def config_disagreements(text: str) -> list[str]:
    rows = config_rows(text)
    defaults = code_defaults()
    ranges = config.numeric_ranges(config.Config())
    flags = flags_by_key()
    wrong = []
    seen: dict[str, int] = {}
    for row in rows:
        for key in row.keys:
            seen[key] = seen.get(key, 0) + 1
            if key not in defaults:
                wrong.append(f"{key}: documented, but no such key")
                continue
            if key in WORKED_OUT:
                if row.default != WORKED_OUT[key] or defaults[key] not in (None, ""):
                    wrong.append(f"{key}: default {row.default!r}, code {defaults[key]!r}")
            elif not same_default(documented_default(row.default), defaults[key]):
                wrong.append(f"{key}: default {row.default!r}, code {defaults[key]!r}")
            shown = set(re.findall(r"--[a-z][a-z-]*", row.flag))
            if shown != flags.get(key, set()):
                wrong.append(f"{key}: flags {sorted(shown)}, code {sorted(flags.get(key, ()))}")
            if key in ranges:
                _, low, high = ranges[key]
                if (float(low), float(high)) not in documented_ranges(row.meaning):
                    wrong.append(f"{key}: range [{low:g}, {high:g}] not in {row.meaning!r}")
    wrong += [f"{key}: in {n} rows" for key, n in seen.items() if n > 1]
    wrong += [f"{key}: not documented" for key in defaults if key not in seen]
    marked = restart_marked(rows)
    needs = set(RESTART_KEYS)
    wrong += [f"{key}: marked *restart*, but a reload applies it" for key in marked - needs]
    wrong += [f"{key}: a reload keeps it, but not marked *restart*" for key in needs - marked]
    return wrong


def test_configuration_table_matches_the_config_code() -> None:
    assert config_disagreements(CONFIGURATION.read_text()) == []


def test_the_configuration_check_finds_what_is_wrong() -> None:
    text = CONFIGURATION.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `colocate.tick_s`"))
    changed = {
        "default": row.replace("| `5.0` |", "| `2.0` |"),
        "range": row.replace("[0.1, 3600]", "[0.1, 600]"),
        "flag": row.replace("| `5.0` | |", "| `5.0` | `--tick` |"),
        "restart": row.replace("seconds,", "seconds (*restart*),"),
        "unknown": row.replace("colocate.tick_s", "colocate.tick"),
        "twice": row + "\n" + row,
    }
    for what, new in changed.items():
        assert config_disagreements(text.replace(row, new)), what
    assert any("not documented" in w for w in config_disagreements(text.replace(row + "\n", "")))


def test_documented_ranges_reads_every_notation() -> None:
    assert documented_ranges("0.01 to 3600; in [0.1, 3600]; 0..63; 0.1..86400 s") == {
        (0.01, 3600.0),
        (0.1, 3600.0),
        (0.0, 63.0),
        (0.1, 86400.0),
    }
    assert documented_ranges("60 s to 366 days") == {(60.0, 366 * 86400.0)}


def test_every_gpud_flag_sets_a_documented_key() -> None:
    keys = {k for row in config_rows(CONFIGURATION.read_text()) for k in row.keys}
    assert set(flags_by_key()) <= keys


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"telemetry": {"interval": 1}}, "telemetry.interval"),
        ({"telemetry": {"call_timeout_s": 1e10}}, "telemetry.call_timeout_s"),
    ],
)
def test_the_example_errors_are_the_ones_gpud_gives(settings: dict[str, Any], key: str) -> None:
    prefix = f"gpud: config error: /etc/gpud/gpud.toml:{key}: "
    (shown,) = [x for x in CONFIGURATION.read_text().splitlines() if x.startswith(prefix)]
    with pytest.raises(ConfigError) as err:
        config.from_dict(settings, path="/etc/gpud/gpud.toml")
    assert shown == f"gpud: config error: {err.value}"


def test_readme_lists_every_gpud_flag() -> None:
    """README's ``Flags:`` line under Configuration: the options of ``gpud``'s parser."""
    text = README.read_text()
    line = re.search(r"Flags:\s*`(gpud [^`]*)`", text)
    assert line, "README.md has no `Flags: `gpud ...`` line"
    shown = set(re.findall(r"--[a-z][a-z-]*", line.group(1)))
    options = {
        flag
        for action in build_gpud_parser()._actions
        for flag in action.option_strings
        if flag.startswith("--") and flag not in ("--help", "--version")
    }
    assert shown == options


# ---------------------------------------------------------------- gpuctl in README.md


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def gpuctl_commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    """Every command path of the parser: ``("mig",)``, ``("mig", "apply")``, ..."""
    for name, child in _subcommands(parser).items():
        yield (*path, name)
        yield from gpuctl_commands(child, (*path, name))


def shown_gpuctl_lines(text: str, *, blocks: tuple[str, ...] | None = None) -> list[str]:
    """The ``gpuctl`` command lines a page shows: lines of code blocks that start with
    ``gpuctl`` (or ``$ gpuctl``), and code spans in the prose that do; comments dropped.
    ``blocks``: only code blocks of these languages (``("sh",)``: not diagrams)."""
    lines = []
    in_block = False
    language = ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_block = not in_block
            language = line.strip().removeprefix("```")
            continue
        if in_block and blocks is not None and language not in blocks:
            continue
        if in_block:
            command = re.sub(r"^\s*(\$ )?", "", line)
            if command.startswith("gpuctl ") and not command.startswith("gpuctl: "):
                lines.append(command.split("  #")[0].split(" # ")[0].split(";")[0])
        else:
            lines += [span for span in re.findall(r"`(gpuctl [^`]*)`", line)]
    return lines


def parse_gpuctl_line(
    parser: argparse.ArgumentParser, line: str
) -> tuple[tuple[str, ...], list[str]]:
    """The command path a shown line names, and what in it the parser would refuse: a word
    where a command is expected that is none, a ``--flag`` the command does not take.
    Optional parts (``[--drain | --force]``) count as given; ``...`` and upper-case
    placeholders as arguments."""
    depth = 0
    for end, char in enumerate(line):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "|" and depth == 0:  # a pipe into another program
            line = line[:end]
            break
    words = shlex.split(re.sub(r"[\[\]|]", " ", line), posix=True)[1:]
    path: tuple[str, ...] = ()
    wrong = []
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if word == "--":
            break
        if word.startswith("-") and len(word) > 1:
            flag = word.split("=")[0]
            action = parser._option_string_actions.get(flag)
            if action is None:
                wrong.append(f"gpuctl {' '.join(path)}: no option {flag}")
            elif action.nargs != 0 and "=" not in word:
                i += 1
            continue
        children = _subcommands(parser)
        if children:
            if word in children:
                parser = children[word]
                path = (*path, word)
            elif word != "...":
                wrong.append(f"gpuctl {' '.join(path)}: no command {word!r}")
                break
    return path, wrong


def gpuctl_disagreements(text: str) -> list[str]:
    parser = build_gpuctl_parser()
    wrong = []
    shown = set()
    for line in shown_gpuctl_lines(text):
        path, refused = parse_gpuctl_line(parser, line)
        wrong += [f"{line!r}: {why}" for why in refused]
        shown.update(path[:n] for n in range(1, len(path) + 1))
    wrong += [
        f"gpuctl {' '.join(path)}: not shown in README.md"
        for path in gpuctl_commands(parser)
        if path not in shown
    ]
    return wrong


def test_readme_shows_every_gpuctl_command_as_it_parses() -> None:
    assert gpuctl_disagreements(README.read_text()) == []


@pytest.mark.parametrize("path", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_gpuctl_lines_of_the_docs_parse(path: Path) -> None:
    parser = build_gpuctl_parser()
    wrong = [
        f"{line!r}: {why}"
        for line in shown_gpuctl_lines(path.read_text(), blocks=("sh",))
        for why in parse_gpuctl_line(parser, line)[1]
    ]
    assert wrong == []


def test_the_gpuctl_check_finds_what_is_wrong() -> None:
    parser = build_gpuctl_parser()
    assert parse_gpuctl_line(parser, "gpuctl mig apply -f F -c C [--drain | --force]") == (
        ("mig", "apply"),
        [],
    )
    assert parse_gpuctl_line(parser, "gpuctl --json gpus --gpu 9") == (("gpus",), [])
    assert parse_gpuctl_line(parser, "gpuctl run --job j -- ./train --bogus")[1] == []
    assert parse_gpuctl_line(parser, "gpuctl mig apply --bogus")[1] == [
        "gpuctl mig apply: no option --bogus"
    ]
    assert parse_gpuctl_line(parser, "gpuctl mig frob")[1] == ["gpuctl mig: no command 'frob'"]
    text = README.read_text()
    assert "gpuctl sim reboot: not shown in README.md" in gpuctl_disagreements(
        text.replace("gpuctl sim reboot", "gpuctl sim")
    )


# ---------------------------------------------------------------- metrics

METRICS = ROOT / "docs" / "metrics.md"
MONITORING = ROOT / "docs" / "monitoring"

# The callables that make a metric family, and the family's type
_FAMILY_KINDS = {
    "GaugeMetricFamily": "gauge",
    "g": "gauge",  # gpud.metrics' alias
    "CounterMetricFamily": "counter",
    "InfoMetricFamily": "info",
    "HistogramMetricFamily": "histogram",
    "histogram_family": "histogram",
}
# the sample names prometheus_client writes for a family of each type
_SAMPLE_SUFFIXES = {
    "gauge": ("",),
    "counter": ("_total",),
    "info": ("_info",),
    "histogram": ("_bucket", "_count", "_sum"),
}
# labels every series has once Prometheus scrapes it
_TARGET_LABELS = {"instance", "job"}


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # as exposed: a counter with _total, an info family with _info
    kind: str
    labels: frozenset[str]


def _module_tuples(tree: ast.Module) -> dict[str, tuple[str, ...]]:
    """Module-level ``NAME = ("a", "b", ...)`` constants (label sets)."""
    found: dict[str, tuple[str, ...]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = tuple(value)
    return found


def _labels(call: ast.Call, constants: dict[str, tuple[str, ...]]) -> frozenset[str]:
    node = next((k.value for k in call.keywords if k.arg == "labels"), None)
    positional = isinstance(call.func, ast.Name) and _FAMILY_KINDS.get(call.func.id) != "histogram"
    if node is None and len(call.args) > 2 and positional:
        node = call.args[2]
    if node is None:
        return frozenset()
    if isinstance(node, ast.Name):
        return frozenset(constants[node.id])
    assert isinstance(node, ast.Tuple | ast.List), ast.unparse(node)
    labels: set[str] = set()
    for item in node.elts:
        if isinstance(item, ast.Starred | ast.Name):  # (*LABELS, "x") or (parameter,)
            name = item.value if isinstance(item, ast.Starred) else item
            assert isinstance(name, ast.Name), ast.unparse(item)
            labels.update(constants[name.id])
        else:
            labels.add(ast.literal_eval(item))
    return frozenset(labels)


def _exposed(name: str, kind: str) -> str:
    return name + {"counter": "_total", "info": "_info"}.get(kind, "")


@functools.cache
def exported_families(package: Path = ROOT / "gpud") -> dict[str, Family]:
    """Every metric family gpud's code makes, read from its source: a call of a family
    class (or gpud.metrics' helpers) with the name as a string, or as an f-string
    ``f"{prefix}_rest"`` inside a function that callers give the prefix as a string."""
    families: dict[str, Family] = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        constants = _module_tuples(tree)
        # function name -> [(index of the prefix parameter, rest of the name, kind, labels)]
        templates: dict[str, list[tuple[int, str, str, ast.Call]]] = {}
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef):
                continue
            params = [a.arg for a in func.args.args]
            for call in ast.walk(func):
                if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
                    continue
                kind = _FAMILY_KINDS.get(call.func.id)
                first = call.args[0] if call.args else None
                if kind and isinstance(first, ast.JoinedStr) and len(first.values) == 2:
                    prefix, rest = first.values
                    if (
                        isinstance(prefix, ast.FormattedValue)
                        and isinstance(prefix.value, ast.Name)
                        and prefix.value.id in params
                        and isinstance(rest, ast.Constant)
                    ):
                        index = params.index(prefix.value.id)
                        templates.setdefault(func.name, []).append((index, rest.value, kind, call))
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
                continue
            first = call.args[0] if call.args else None
            kind = _FAMILY_KINDS.get(call.func.id)
            if kind and isinstance(first, ast.Constant) and isinstance(first.value, str):
                name = _exposed(first.value, kind)
                families[name] = Family(name, kind, _labels(call, constants))
            for index, rest, kind, made in templates.get(call.func.id, []):
                given = call.args[index] if len(call.args) > index else None
                if isinstance(given, ast.Constant) and isinstance(given.value, str):
                    # the template's labels name the function's parameters: resolve them
                    inner = {
                        **constants,
                        **{
                            kw.arg: (ast.literal_eval(kw.value),)
                            for kw in call.keywords
                            if kw.arg and isinstance(kw.value, ast.Constant)
                        },
                    }
                    params = [
                        a.arg
                        for f in ast.walk(tree)
                        if isinstance(f, ast.FunctionDef) and f.name == call.func.id
                        for a in f.args.args
                    ]
                    for position, arg in enumerate(call.args):
                        if isinstance(arg, ast.Constant) and position < len(params):
                            inner[params[position]] = (arg.value,)
                    name = _exposed(given.value + rest, kind)
                    families[name] = Family(name, kind, _labels(made, inner))
        _add_info_labels(tree, families)
    return families


def _add_info_labels(tree: ast.Module, families: dict[str, Family]) -> None:
    """An info family's labels include the keys of the dicts its ``add_metric`` is given
    (``info.add_metric([...], {"product": ...})``)."""
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef):
            continue
        made: dict[str, str] = {}  # variable -> family
        for node in ast.walk(func):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)
                and _FAMILY_KINDS.get(node.value.func.id) == "info"
                and node.value.args
                and isinstance(node.value.args[0], ast.Constant)
            ):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        made[target.id] = _exposed(node.value.args[0].value, "info")
        for call in ast.walk(func):
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr == "add_metric"
                and isinstance(call.func.value, ast.Name)
                and call.func.value.id in made
                and len(call.args) > 1
                and isinstance(call.args[1], ast.Dict)
            ):
                family = families[made[call.func.value.id]]
                keys = {ast.literal_eval(k) for k in call.args[1].keys if k is not None}
                families[family.name] = dataclasses.replace(family, labels=family.labels | keys)


def sample_names(families: dict[str, Family]) -> dict[str, Family]:
    """Every sample name a scrape shows, to the family it is of."""
    names = {}
    for family in families.values():
        base = family.name.removesuffix("_total") if family.kind == "counter" else family.name
        base = base.removesuffix("_info") if family.kind == "info" else base
        for suffix in _SAMPLE_SUFFIXES[family.kind]:
            names[base + suffix] = family
    if any(f.kind == "histogram" for f in families.values()):
        names.update({f.name: f for f in families.values() if f.kind == "histogram"})
    return names


def metrics_table_disagreements(text: str, families: dict[str, Family]) -> list[str]:
    wrong = []
    seen: dict[str, int] = {}
    for line in text.splitlines():
        if not line.startswith("| `gpud_"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name, kind, labels = cells[0].strip("`"), cells[1], set(re.findall(r"`(\w+)`", cells[2]))
        seen[name] = seen.get(name, 0) + 1
        family = families.get(name)
        if family is None:
            wrong.append(f"{name}: documented, but gpud exports no such family")
            continue
        if kind != family.kind:
            wrong.append(f"{name}: documented as a {kind}, exported as a {family.kind}")
        if labels != family.labels:
            wrong.append(f"{name}: labels {sorted(labels)}, exported {sorted(family.labels)}")
    wrong += [f"{name}: in {n} rows" for name, n in seen.items() if n > 1]
    wrong += [f"{name}: not in docs/metrics.md" for name in families if name not in seen]
    return wrong


def _expand_braces(text: str) -> str:
    """``gpud_gpu_memory_{total,used}_bytes`` -> ``gpud_gpu_memory_total_bytes
    gpud_gpu_memory_used_bytes``."""

    def expand(match: re.Match[str]) -> str:
        head, choices, tail = match.groups()
        return " ".join(f"{head}{choice}{tail}" for choice in choices.split(","))

    return re.sub(r"(gpud_[a-z0-9_]*)\{([a-z0-9_]+(?:,[a-z0-9_]+)+)\}([a-z0-9_]*)", expand, text)


def unknown_metric_names(text: str, families: dict[str, Family]) -> set[str]:
    """The ``gpud_*`` names a text uses that no scrape shows; a name ending in ``_`` is a
    prefix (``gpud_colo_*``) and must begin some family's name."""
    known = sample_names(families)
    unknown = set()
    for name in re.findall(r"\bgpud_[a-z0-9_]*", _expand_braces(text)):
        if name.endswith("_"):
            if not any(k.startswith(name) for k in known):
                unknown.add(name)
        elif name not in known:
            unknown.add(name)
    return unknown


# PromQL: a selector's matchers, and the labels of by/without
_SELECTOR = re.compile(r"\b(gpud_[a-z0-9_]+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
# by/without, and the labels a binary operation matches on: a label renamed in the exporter
# leaves an `on (...)` matching nothing, and the rule silently never fires
_GROUPING = re.compile(r"\b(by|without|on)\s*\(([^)]*)\)")


def unknown_labels(expr: str, families: dict[str, Family]) -> set[str]:
    """Labels a PromQL expression selects or groups by that its gpud series do not have."""
    known = sample_names(families)
    used = {known[n] for n in re.findall(r"\bgpud_[a-z0-9_]+", expr) if n in known}
    unknown = set()
    for name, matchers in _SELECTOR.findall(expr):
        family = known.get(name)
        allowed = _TARGET_LABELS | (family.labels if family else set())
        if family is not None and family.kind == "histogram":
            allowed |= {"le"}
        unknown |= {f"{name}{{{m}}}" for m in _MATCHER.findall(matchers) if m not in allowed}
    if used:
        allowed = _TARGET_LABELS | {"le"} | {label for f in used for label in f.labels}
        for keyword, grouping in _GROUPING.findall(expr):
            unknown |= {
                f"{keyword} ({g.strip()})"
                for g in grouping.split(",")
                if g.strip() and g.strip() not in allowed
            }
    return unknown


def _monitoring_exprs() -> dict[str, str]:
    rules = yaml.safe_load((MONITORING / "gpud-alerts.yml").read_text())["groups"][0]["rules"]
    exprs = {f"alert {r['alert']}": str(r["expr"]) for r in rules}
    for rule in rules:
        for key, text in rule.get("annotations", {}).items():
            exprs[f"alert {rule['alert']} {key}"] = str(text)
    dashboard = json.loads((MONITORING / "gpud-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            exprs[f"panel {panel['title']!r}"] = str(target.get("expr", ""))
    for variable in dashboard.get("templating", {}).get("list", []):
        exprs[f"variable {variable['name']}"] = json.dumps(variable.get("query", ""))
    return exprs


def test_metrics_reference_lists_every_exported_family() -> None:
    assert metrics_table_disagreements(METRICS.read_text(), exported_families()) == []


@pytest.mark.parametrize(
    "path",
    [README, *sorted((ROOT / "docs").glob("*.md"))],
    ids=lambda p: p.name,
)
def test_docs_name_only_exported_metrics(path: Path) -> None:
    assert unknown_metric_names(path.read_text(), exported_families()) == set()


def test_alerts_and_dashboard_use_exported_metrics_and_labels() -> None:
    families = exported_families()
    wrong = {}
    for where, expr in _monitoring_exprs().items():
        bad = unknown_metric_names(expr, families) | unknown_labels(expr, families)
        if bad:
            wrong[where] = sorted(bad)
    assert wrong == {}


def test_the_metrics_checks_find_what_is_wrong() -> None:
    families = exported_families()
    assert "gpud_net_job_sent_bytes_total" in families  # made from a prefix
    assert families["gpud_gpu_info"].labels >= {"product", "pci_bus_id"}  # add_metric's dict
    assert unknown_metric_names("`gpud_events` `gpud_colo_*` gpud_x_{a,b}", families) == {
        "gpud_events",
        "gpud_x_a",
        "gpud_x_b",
    }
    assert unknown_metric_names("gpud_loop_duration_seconds_bucket gpud_", families) == set()
    assert (
        unknown_labels(
            'sum by (le) (rate(gpud_loop_duration_seconds_bucket{le="1"}[5m]))', families
        )
        == set()
    )
    assert unknown_labels('gpud_mig_apply_total{reason="x"} by (gpu)', families) == {
        "gpud_mig_apply_total{reason}",
        "by (gpu)",
    }
    # a join on a label the series do not have (renamed in the exporter) matches nothing
    assert unknown_labels(
        "gpud_gpu_healthy == 0 unless on (instance, gpu_index) gpud_gpu_critical_xid_uncleared",
        families,
    ) == {"on (gpu_index)"}
    assert (
        unknown_labels(
            "gpud_gpu_healthy == 0 unless on (instance, gpu) gpud_gpu_critical_xid_uncleared",
            families,
        )
        == set()
    )
    text = METRICS.read_text()
    assert metrics_table_disagreements(
        text.replace("| `gpud_gpus` | gauge |", "| `gpud_gpus` | counter |"), families
    ) == ["gpud_gpus: documented as a counter, exported as a gauge"]


# ---------------------------------------------------------------- README.md: exit codes


def readme_exit_codes(text: str) -> set[int]:
    """The codes of the table under README.md's ``### Exit codes``: ``| 125 | ... |``."""
    section = text.split("\n### Exit codes\n", 1)[1].split("\n#", 1)[0]
    return {int(code) for code in re.findall(r"^\| (\d+) \|", section, re.MULTILINE)}


def gpuctl_exit_codes() -> dict[int, str]:
    """Each exit code gpuctl gives of its own, with where it comes from: 0, gpud's error
    table (an error gpud sends carries its code), the ``EXIT_`` constants of gpud.cli's
    modules and a literal ``return N`` or ``sys.exit(N)`` there."""
    codes = {0: "success"}
    for cls, (_, code) in ERROR_TABLE.items():
        codes.setdefault(code, f"gpud.errors.{cls.__name__}")
    for path in sorted((ROOT / "gpud" / "cli").glob("*.py")):
        module = importlib.import_module(f"gpud.cli.{path.stem}".removesuffix(".__init__"))
        for name, value in vars(module).items():
            if name.startswith("EXIT_") and isinstance(value, int):
                codes.setdefault(value, f"{module.__name__}.{name}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Return):
                value = node.value
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == "sys.exit":
                value = node.args[0] if node.args else None
            else:
                continue
            if isinstance(value, ast.Constant) and type(value.value) is int:
                codes.setdefault(value.value, f"{path.name}:{node.lineno}")
    return codes


def test_readme_lists_every_exit_code_gpuctl_gives() -> None:
    codes = gpuctl_exit_codes()
    listed = readme_exit_codes(README.read_text())
    assert {c: codes[c] for c in sorted(codes.keys() - listed)} == {}, "not in README.md"
    assert sorted(listed - codes.keys()) == [], "listed in README.md, never given"


def test_the_exit_code_check_finds_what_is_wrong() -> None:
    codes = gpuctl_exit_codes()
    assert codes[11] == "gpud.errors.Partial" and codes[126] == "gpud.cli.run.EXIT_CANNOT_RUN"
    assert codes[125] == "gpud.cli.run.EXIT_GATE_CLOSED" and 130 in codes and 141 in codes
    table = (
        "### Exit codes\n\n| Exit | Why |\n|---|---|\n| 0 | ok |\n| 125 | x |\n\n## Next\n| 9 | y |"
    )
    assert readme_exit_codes(f"intro\n{table}") == {0, 125}


def error_kinds() -> set[str]:
    """The ``last_error_kind`` values gpud sets: gpud.cluster.agent's constants spelled as
    their value (``REPORT_REFUSED = "report_refused"``)."""
    tree = ast.parse((ROOT / "gpud" / "cluster" / "agent.py").read_text())
    return {
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        and [ast.unparse(t) for t in node.targets] == [node.value.value.upper()]
    }


def proto_error_kinds(text: str) -> set[str]:
    """The quoted words of the comment above ``last_error_kind`` in cluster.proto."""
    comment: list[str] = []
    for line in text.splitlines():
        if line.strip().startswith("//"):
            comment.append(line)
        elif "last_error_kind = " in line:
            return set(re.findall(r'"([a-z_]+)"', "\n".join(comment)))
        else:
            comment = []
    return set()


def test_the_docs_list_every_error_kind_gpud_sets() -> None:
    kinds = error_kinds()
    assert {"leader_unreachable", "report_refused", "own_certificate"} <= kinds
    proto = proto_error_kinds((ROOT / "proto" / "gpud" / "v1" / "cluster.proto").read_text())
    assert sorted(kinds - proto) == [], "not in cluster.proto's last_error_kind comment"
    (row,) = [r for r in README.read_text().splitlines() if r.startswith("| `last_error_kind` |")]
    assert sorted(kinds - set(re.findall(r"`([a-z_]+)`", row))) == [], "not in README.md"
