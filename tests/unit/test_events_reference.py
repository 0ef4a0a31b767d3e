"""docs/events.md lists every event kind gpud can emit, with its fields; the docs name no
kind gpud does not emit.

The kinds and fields are read from the source (every ``emit``/``_emit``/``_notify`` call:
its kind, its keyword arguments and the keys of any dict it spreads), not from a running
daemon. Only files are read: nothing runs.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud import config

ROOT = Path(__file__).resolve().parents[2]
EVENTS_DOC = ROOT / "docs" / "events.md"
PACKAGES = ("gpud", "netshaper", "colocate")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# The calls that emit an event, and the helpers that forward a kind to one:
# EventLog.emit(kind, message, **fields), the sampler's _emit(kind, message, **fields),
# the cluster election's notify(kind, message, fields) (ClusterRuntime._emit).
EMITTERS = frozenset({"emit", "_emit", "_notify"})

# Kinds built from a prefix with an f-string: the prefix, and where the code lists the
# names it completes them with (a module-level dict literal: its values).
DYNAMIC = {"sim.fault.": ("gpud/api/node.py", "_FAULT_NAMES")}

# Backquoted dotted names in the docs that look like event kinds but are files.
NOT_KINDS = frozenset({"colo.json", "colo.json.unreadable", "colo.json.skipped"})


# Kinds whose fields differ from one call site to another, and why (docs/events.md says
# so): every other kind gives the same fields wherever it is emitted.
VARYING = {
    "mig.apply": "gpus, steps and client_gone only once the apply ran",
    "net.pin": "pinned only when a pin beyond traffic.levels is clamped",
    "net.untagged": "jobs and names (no job) for the jobs past the first 8 of one pass",
    "colo.evict": "gpu only from an SLO guard, not from the plan",
    "colo.leave": "no entry when the job is removed (every wait of it ends)",
}


@dataclasses.dataclass
class Kind:
    fields: set[str] = dataclasses.field(default_factory=set)
    sites: list[str] = dataclasses.field(default_factory=list)
    by_site: dict[str, frozenset[str]] = dataclasses.field(default_factory=dict)


def _name(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Attribute):
        return f.attr
    return f.id if isinstance(f, ast.Name) else None


def _dict_keys(fn: ast.AST, var: str) -> set[str]:
    """The string keys ``var`` gets in ``fn``: from a dict literal assigned to it and from
    ``var["key"] = ...`` (also as one target of a tuple assignment)."""
    keys: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            flat: list[ast.expr] = []
            for t in targets:
                flat += t.elts if isinstance(t, ast.Tuple) else [t]
            for t in flat:
                if isinstance(t, ast.Name) and t.id == var and isinstance(node.value, ast.Dict):
                    keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
                if (
                    isinstance(t, ast.Subscript)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == var
                    and isinstance(t.slice, ast.Constant)
                ):
                    keys.add(t.slice.value)
    return keys


def _module_dict_values(path: str, name: str) -> list[str]:
    tree = ast.parse((ROOT / path).read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            return [v.value for v in node.value.values if isinstance(v, ast.Constant)]
    raise AssertionError(f"{path}: no dict literal {name}")


def _functions(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _kinds_of(arg: ast.expr, where: str) -> list[str]:
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if isinstance(arg, ast.IfExp):
        return _kinds_of(arg.body, where) + _kinds_of(arg.orelse, where)
    if isinstance(arg, ast.JoinedStr):
        head = arg.values[0]
        prefix = head.value if isinstance(head, ast.Constant) else ""
        if prefix in DYNAMIC and len(arg.values) == 2:
            return [prefix + name for name in _module_dict_values(*DYNAMIC[prefix])]
    raise AssertionError(f"{where}: an event kind this test cannot read: {ast.unparse(arg)}")


def _fields_of(
    call: ast.Call,
    fn: ast.FunctionDef | ast.AsyncFunctionDef | None,
    tree: ast.Module,
    where: str,
) -> set[str]:
    fields = {k.arg for k in call.keywords if k.arg}
    if _name(call) == "_notify" and len(call.args) > 2:
        spread = call.args[2]
        if not isinstance(spread, ast.Dict):
            raise AssertionError(f"{where}: notify fields that are not a dict literal")
        fields |= {k.value for k in spread.keys if isinstance(k, ast.Constant)}
    for k in call.keywords:
        if k.arg is not None:
            continue
        value = k.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            helper = next((f for f in _functions(tree) if f.name == value.func.id), None)
            assert helper is not None, f"{where}: {value.func.id} not in the module"
            returned = [n.value for n in ast.walk(helper) if isinstance(n, ast.Return)]
            for r in returned:
                assert isinstance(r, ast.Name), f"{where}: {value.func.id} returns no name"
                fields |= _dict_keys(helper, r.id)
        elif isinstance(value, ast.Name) and fn is not None:
            kwarg = fn.args.kwarg
            if kwarg is not None and kwarg.arg == value.id:
                # **fields of the function itself: what its callers pass
                for other in ast.walk(tree):
                    if isinstance(other, ast.Call) and _name(other) == fn.name:
                        fields |= {kw.arg for kw in other.keywords if kw.arg}
            else:
                keys = _dict_keys(fn, value.id)
                assert keys, f"{where}: cannot tell the keys of **{value.id}"
                fields |= keys
        else:
            raise AssertionError(f"{where}: fields this test cannot read: {ast.unparse(value)}")
    return fields


def emitted_kinds_in(source: str, where: str) -> dict[str, Kind]:
    """The event kinds one module's source emits, with the fields of each."""
    tree = ast.parse(source)
    kinds: dict[str, Kind] = {}
    enclosing: dict[ast.Call, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    for fn in _functions(tree):
        for node in ast.walk(fn):
            if isinstance(node, ast.Call):
                enclosing.setdefault(node, fn)  # walk visits outer functions first
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and _name(node) in EMITTERS and node.args):
            continue
        site = f"{where}:{node.lineno}"
        fn = enclosing.get(node)
        first = node.args[0]
        if isinstance(first, ast.Name):
            # a forwarder (_emit(self, kind, ...)): its callers are the sites
            params = [a.arg for a in fn.args.args] if fn is not None else []
            assert first.id in params and fn is not None and fn.name in EMITTERS, (
                f"{site}: a kind passed as {first.id}, not by a known forwarder"
            )
            continue
        fields = _fields_of(node, fn, tree, site)
        for kind in _kinds_of(first, site):
            k = kinds.setdefault(kind, Kind())
            k.fields |= fields
            k.sites.append(site)
            k.by_site[site] = frozenset(fields)
    return kinds


@functools.cache
def emitted_kinds() -> dict[str, Kind]:
    kinds: dict[str, Kind] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            for name, k in emitted_kinds_in(path.read_text(), where).items():
                mine = kinds.setdefault(name, Kind())
                mine.fields |= k.fields
                mine.sites += k.sites
                mine.by_site |= k.by_site
    return kinds


@dataclasses.dataclass(frozen=True)
class Row:
    kind: str
    when: str
    fields: frozenset[str]
    alert: str


def documented_rows(text: str) -> list[Row]:
    rows = []
    for line in text.splitlines():
        if not re.match(r"\| `[a-z_]+\.[a-z_.]+(?:<kind>)?` \|", line):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 4, f"not 4 cells: {line}"
        fields = frozenset(re.findall(r"`(\w+)`", cells[2]))
        rows.append(Row(cells[0].strip("`"), cells[1], fields, cells[3]))
    return rows


def _collapsed(kinds: dict[str, Kind]) -> dict[str, Kind]:
    """The kinds built from a prefix (``sim.fault.lost``, ...) as the one row the reference
    gives them (``sim.fault.<kind>``), with the fields of them all."""
    out: dict[str, Kind] = {}
    for name, k in kinds.items():
        prefix = next((p for p in DYNAMIC if name.startswith(p)), None)
        mine = out.setdefault(name if prefix is None else f"{prefix}<kind>", Kind())
        mine.fields |= k.fields
        mine.sites += [s for s in k.sites if s not in mine.sites]
    return out


def reference_disagreements(text: str, all_kinds: dict[str, Kind]) -> list[str]:
    wrong = []
    seen: dict[str, int] = {}
    kinds = _collapsed(all_kinds)
    for row in documented_rows(text):
        seen[row.kind] = seen.get(row.kind, 0) + 1
        if row.kind.endswith("<kind>"):
            prefix = row.kind.removesuffix("<kind>")
            named = set(re.findall(rf"`({re.escape(prefix)}[a-z_]+)`", row.when))
            built = {name for name in all_kinds if name.startswith(prefix)}
            if named != built:
                wrong.append(f"{row.kind}: names {sorted(named)}, the code's {sorted(built)}")
        if not row.when:
            wrong.append(f"{row.kind}: no word on when it is written")
        if row.alert not in ("yes", "no"):
            wrong.append(f"{row.kind}: alert column {row.alert!r}, not yes or no")
        k = kinds.get(row.kind)
        if k is None:
            wrong.append(f"{row.kind}: documented, but gpud emits no such kind")
            continue
        if row.fields != k.fields:
            wrong.append(
                f"{row.kind}: fields {sorted(row.fields)}, the code's {sorted(k.fields)}"
                f" ({', '.join(k.sites)})"
            )
    wrong += [f"{kind}: in {n} rows" for kind, n in seen.items() if n > 1]
    wrong += [f"{kind}: not in docs/events.md" for kind in kinds if kind not in seen]
    return wrong


@functools.cache
def _config_names() -> tuple[frozenset[str], frozenset[str]]:
    """The config keys (``traffic.top_share``) and sections (``traffic``)."""
    cfg = config.Config()
    keys, sections = set(), set()
    for section in dataclasses.fields(cfg):
        sections.add(section.name)
        for key in dataclasses.fields(getattr(cfg, section.name)):
            keys.add(f"{section.name}.{key.name}")
    return frozenset(keys), frozenset(sections)


def _names_a_kind(name: str, kinds: dict[str, Kind]) -> bool:
    """``name`` is a kind, or a prefix of one when it ends in ``.``, ``_`` or ``.*``."""
    if name.endswith("*"):
        name = name[:-1]
    if name.endswith((".", "_")):
        return any(k.startswith(name) for k in kinds)
    return name in kinds


def unknown_kinds(text: str, kinds: dict[str, Kind]) -> set[str]:
    """The event kinds a text names that gpud does not emit: every ``gpuctl events --kind
    PREFIX``, and every backquoted dotted name of an event area (the first word of a kind:
    ``mig``, ``net``, ...) that is no config key (``traffic.top_share``), config section
    (``mig.*``) or file."""
    keys, sections = _config_names()
    areas = {k.split(".")[0] for k in kinds}
    unknown = set()
    for prefix in re.findall(r"gpuctl events\b[^\n`]*?--kind[ =]([a-z_.]+)", text):
        if not _names_a_kind(prefix, kinds):
            unknown.add(prefix)
    for name in re.findall(r"`([a-z_]+(?:\.[a-z_]+)+\.?(?:\*)?)`", text):
        head = name.split(".")[0]
        if head not in areas or name in keys or name in NOT_KINDS:
            continue
        if name.endswith(".*") and head in sections:
            continue
        if not _names_a_kind(name, kinds):
            unknown.add(name)
    return unknown


def test_events_reference_lists_every_kind_with_its_fields() -> None:
    assert reference_disagreements(EVENTS_DOC.read_text(), emitted_kinds()) == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_name_only_kinds_gpud_emits(path: Path) -> None:
    assert unknown_kinds(path.read_text(), emitted_kinds()) == set()


def kinds_with_varying_fields(kinds: dict[str, Kind]) -> dict[str, list[str]]:
    """Kind -> its call sites with their fields, for the kinds whose sites disagree."""
    return {
        name: [f"{site} {sorted(fields)}" for site, fields in k.by_site.items()]
        for name, k in kinds.items()
        if len(set(k.by_site.values())) > 1
    }


def test_every_site_of_a_kind_gives_the_same_fields() -> None:
    """A script that reads a field of a kind finds it on every event of the kind."""
    varying = kinds_with_varying_fields(emitted_kinds())
    assert {k: v for k, v in varying.items() if k not in VARYING} == {}
    assert set(VARYING) <= set(varying), "no longer varying: take it out of VARYING"


def test_names_kept_out_of_the_kind_check_are_no_kinds() -> None:
    kinds = emitted_kinds()
    assert not NOT_KINDS & set(kinds)
    assert all(any(k.startswith(prefix) for k in kinds) for prefix in DYNAMIC)


SOURCE = """
_NAMES = {1: "lost"}

def _where(t):
    where = {"uuid": t.uuid}
    if t.mig:
        where["mig"] = t.mig
    return where

class S:
    def _emit(self, kind, message, **fields):
        self._events.emit(kind, message, **fields)

    def _finish(self, name, **fields):
        self._events.emit("a.apply", name, config=name, **fields)

    def run(self, t, hung, kind):
        detail = {}
        detail["seconds"], blame = 1, "seconds"
        self._finish("x", steps=1)
        self._emit("a.hung" if hung else "a.failed", "m", **_where(t), error="e")
        self._events.emit(f"sim.fault.{kind}", "m", gpu=0, **detail)
        self._notify("a.elected", "m", {"epoch": 1})
"""


def test_the_kinds_are_read_from_every_form_of_call() -> None:
    kinds = {name: k.fields for name, k in emitted_kinds_in(SOURCE, "s.py").items()}
    faults = {f"sim.fault.{n}" for n in _module_dict_values(*DYNAMIC["sim.fault."])}
    assert kinds == {
        "a.apply": {"config", "steps"},
        "a.hung": {"uuid", "mig", "error"},
        "a.failed": {"uuid", "mig", "error"},
        "a.elected": {"epoch"},
        **{f: {"gpu", "seconds"} for f in faults},
    }
    with pytest.raises(AssertionError, match="cannot read"):
        emitted_kinds_in("e.emit(f'x.{y}', 'm')", "t.py")
    with pytest.raises(AssertionError, match="not by a known forwarder"):
        emitted_kinds_in("def f(k):\n    e.emit(k, 'm')", "t.py")


def test_the_reference_checks_find_what_is_wrong() -> None:
    kinds = {"a.b": Kind({"gpu"}, ["x.py:1"]), "a.c": Kind(set(), ["x.py:2"])}
    text = (
        "| `a.b` | when | `gpu`, `uuid` | yes |\n| `a.x` | when | | no |\n| `a.x` |  | | maybe |\n"
    )
    assert reference_disagreements(text, kinds) == [
        "a.b: fields ['gpu', 'uuid'], the code's ['gpu'] (x.py:1)",
        "a.x: documented, but gpud emits no such kind",
        "a.x: no word on when it is written",
        "a.x: alert column 'maybe', not yes or no",
        "a.x: documented, but gpud emits no such kind",
        "a.x: in 2 rows",
        "a.c: not in docs/events.md",
    ]
    named = (
        "`gpuctl events --kind a.` `gpuctl events --kind a.z` `a.b` `a.q` `a.*` `b.c`"
        " `traffic.top_share` `mig.*` `colo.json`"
    )
    assert unknown_kinds(named, kinds) == {"a.z", "a.q"}
