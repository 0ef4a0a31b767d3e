"""Every relative link of README.md and docs/*.md leads somewhere: the file or folder it
names exists, and its ``#anchor`` is a heading of that file as GitHub spells its anchors
(lower case, punctuation other than ``-`` and ``_`` dropped, spaces as ``-``; a repeated
heading gets ``-1``, ``-2``...). Links inside code (fenced blocks, backticks) are text, not
links. Only files are read."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE = re.compile(r"(`+).+?\1", re.S)
_LINK = re.compile(r"\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """``text`` without its fenced blocks and code spans."""
    return _CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text (code marks and link targets dropped),
    lower case, only letters, digits, ``-``, ``_`` and spaces kept, spaces as ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a markdown text, repeated headings numbered as GitHub does."""
    seen: Counter[str] = Counter()
    found = set()
    for match in _HEADING.finditer(_FENCE.sub("", text)):
        base = slug(match[1])
        found.add(f"{base}-{seen[base]}" if seen[base] else base)
        seen[base] += 1
    return found


def broken_links(path: Path, text: str) -> list[str]:
    """The relative links of ``text`` (the file at ``path``) that lead nowhere, each said
    with why."""
    wrong = []
    for target in _LINK.findall(prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            wrong.append(f"{path.name}: {target}: no such file {dest.relative_to(ROOT)}")
        elif anchor and (
            dest.is_dir() or anchor not in anchors(dest.read_text() if file else text)
        ):
            wrong.append(f"{path.name}: {target}: no heading #{anchor} in {file or path.name}")
    return wrong


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken_links(path, path.read_text()) == []


def test_the_link_check_finds_what_is_wrong() -> None:
    readme = ROOT / "README.md"
    text = "\n".join(
        [
            "# Top",
            "## A `code` heading, with: marks",
            "## Top",
            "[ok](docs/admission.md#hand-over) [ok](#a-code-heading-with-marks) [ok](#top-1)",
            "[ok](https://example.com/x#y) `[code](nowhere.md)`",
            "```",
            "[fenced](nowhere.md)",
            "```",
            "[bad](docs/nowhere.md) [bad](docs/admission.md#no-such) [bad](#top-2)",
        ]
    )
    assert broken_links(readme, text) == [
        "README.md: docs/nowhere.md: no such file docs/nowhere.md",
        "README.md: docs/admission.md#no-such: no heading #no-such in docs/admission.md",
        "README.md: #top-2: no heading #top-2 in README.md",
    ]
