"""The hand-written reference docs agree with the code they describe.

- docs/configuration.md's table: every key of :class:`gpud.config.Config` once, with its
  default, its range, the ``gpud`` flag that sets it and whether a reload applies it;
- the metric names README.md and docs/ name are ones gpud exports, and every family gpud
  exports is in docs/metrics.md, with its labels;
- README.md shows every ``gpuctl`` command, and every ``gpuctl`` command line it shows parses
  (its words name a command, its ``--flags`` are that command's).

Only files are read: nothing runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpud import config
from gpud.cli.main import build_parser as build_gpuctl_parser
from gpud.daemon import RESTART_KEYS
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


def shown_gpuctl_lines(text: str) -> list[str]:
    """The ``gpuctl`` command lines README.md shows: lines of code blocks that start with
    ``gpuctl`` (or ``$ gpuctl``), and code spans in the prose that do; comments dropped."""
    lines = []
    in_block = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_block = not in_block
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
