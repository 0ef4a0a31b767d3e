"""The nftables adapter: gpud's own table that sets each job's DSCP by its cgroup.

What the kernel holds (``nft -a list table inet gpud``)::

    table inet gpud {
        chain jobs {
            type filter hook output priority mangle; policy accept;
            socket cgroupv2 level 2 "unified/gpud/gpud-job-a" meta nfproto ipv4 ip dscp set 10 counter comment "gpud job=a dscp=10 cgid=4711 ip"
            socket cgroupv2 level 2 "unified/gpud/gpud-job-a" meta nfproto ipv6 ip6 dscp set 10 counter comment "gpud job=a dscp=10 cgid=4711 ip6"
        }
    }

Packets of every socket created by a process of the job's cgroup get the job's DSCP in the
output hook, before the egress qdisc's filters classify them, so jobs whose libraries cannot
set a TOS (NCCL and Gloo over TCP) are marked all the same. The table belongs to gpud
alone; nothing else in the ruleset is read or touched, so only this table is guarded: a
chain in another table (``nft add table inet x``, a hook of its own) or any other
postrouting or output hook that rewrites the DSCP after gpud's goes unseen.

Reads go through libnftables' JSON output (``nft -j -n list table inet gpud``: numeric, so a
DSCP reads as 10, not ``af11``); a rule is gpud's while its comment, the DSCP it sets, its
family and its cgroup path are the ones wanted, and the chain while it is still an
``output`` filter hook at priority mangle with policy accept: anything else, changed in
place behind gpud's back, is deleted and written again. Any other chain in the table (one
added by hand: ``nft add chain inet gpud x { type filter hook output priority 0; }`` with
``ip dscp set cs0`` would undo every mark, unseen) has the table written again without it,
and is named in :attr:`MarkSync.foreign`. Writes are one atomic batch (``nft -f -``) in nft's own syntax: nft 1.0.6's JSON *parser* does not know the
``socket cgroupv2`` key ("Invalid socket key value") and its JSON output drops the ``level``,
so the rule's identity lives in its comment: job, DSCP and the cgroup's id (the inode of its
cgroup2 directory; nft resolves the path to that id when the rule is added, so a cgroup
that was removed and made again needs a new rule).

Nothing here imports the rest of the project; the ``nft`` program is the one dependency.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

FAMILY = "inet"
DEFAULT_TABLE = "gpud"
DEFAULT_CHAIN = "jobs"
_PRIORITY = "mangle"  # -150: before anything that filters on DSCP
_PRIORITY_VALUE = -150
_COMMENT = re.compile(r"^gpud job=(\S+) dscp=(\d+) cgid=(\d+) (ip6?)$")
_SAFE = re.compile(r'[^"\\\n\r]+')  # whole: "$" alone takes a path ending in a newline


def usable_path(path: str) -> bool:
    """Whether ``path`` can stand in nft's quoted string (``socket cgroupv2 level 2
    "PATH"``): no double quote, backslash or line break."""
    return bool(_SAFE.fullmatch(path))


Runner = Callable[[list[str], str | None], tuple[int, str, str]]
"""Runs ``nft`` with ``args`` and optional stdin; returns (exit code, stdout, stderr)."""


class NftError(RuntimeError):
    """nft failed or is missing; ``detail`` is what it said."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(f"{message}: {detail}" if detail else message)
        self.detail = detail


@dataclass(frozen=True, order=True, slots=True)
class CgroupMark:
    """Set ``dscp`` on packets of sockets of one cgroup.

    ``path`` is the cgroup as nft resolves it, relative to ``/sys/fs/cgroup`` (so
    ``unified/gpud/gpud-job-a`` where cgroup2 is mounted at ``/sys/fs/cgroup/unified``),
    ``level`` its depth under the cgroup2 root, ``cgroup_id`` the inode of its directory.
    """

    job: str
    dscp: int
    path: str
    level: int
    cgroup_id: int

    def __post_init__(self) -> None:
        if not 0 <= self.dscp <= 63:
            raise ValueError(f"{self.job}: DSCP must be in [0, 63], got {self.dscp}")
        if not usable_path(self.path) or not re.fullmatch(r"[A-Za-z0-9_.-]+", self.job):
            raise ValueError(f"{self.job}: unusable job name or cgroup path {self.path!r}")
        if self.level < 1:
            raise ValueError(f"{self.job}: cgroup level must be >= 1, got {self.level}")

    def comments(self) -> dict[str, str]:
        """family ("ip", "ip6") -> the comment of its rule."""
        base = f"gpud job={self.job} dscp={self.dscp} cgid={self.cgroup_id}"
        return {"ip": f"{base} ip", "ip6": f"{base} ip6"}


@dataclass(frozen=True, slots=True)
class MarkRule:
    """One rule as read back: its handle, comment, and the packets/bytes it marked; what
    it does: the family whose DSCP it sets, to what, for which cgroup path (None where it
    does not say)."""

    handle: int
    comment: str
    job: str | None
    packets: int
    bytes: int
    family: str | None = None
    dscp: int | None = None
    path: str | None = None


@dataclass(frozen=True, slots=True)
class TableState:
    """gpud's table as the kernel holds it (``present`` False: no table at all)."""

    present: bool
    chain_ok: bool
    rules: tuple[MarkRule, ...]
    foreign_chains: tuple[str, ...] = ()  # chains in gpud's table that gpud did not make


@dataclass(frozen=True, slots=True)
class MarkSync:
    """What :meth:`NftablesMarker.sync` changed (all empty: nothing to do): the comments of
    the rules ``added`` and ``removed`` (one per job and family, :meth:`CgroupMark.comments`),
    and of those ``kept`` as they were. ``created``: the table was written anew, ``rebuilt``
    when it was there before (deleted first, with every rule of it: all in ``removed``);
    ``foreign``: the chains in it that gpud did not make, deleted with it."""

    created: bool
    added: tuple[str, ...]
    removed: tuple[str, ...]
    kept: tuple[str, ...] = ()
    rebuilt: bool = False
    foreign: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return self.created or bool(self.added) or bool(self.removed)


def subprocess_runner(nft: str = "nft", timeout_s: float = 10.0) -> Runner:
    """Run the ``nft`` program (in the caller's network namespace)."""

    def run(args: list[str], stdin: str | None) -> tuple[int, str, str]:
        try:
            done = subprocess.run(
                [nft, *args],
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except FileNotFoundError as err:
            raise NftError(f"{nft} not found (install the nftables package)") from err
        except subprocess.TimeoutExpired as err:
            raise NftError(f"{nft} did not finish within {timeout_s:g} s") from err
        return done.returncode, done.stdout, done.stderr

    return run


class NftablesMarker:
    """gpud's marking table: read it, bring it to a set of :class:`CgroupMark`, delete it."""

    def __init__(
        self,
        *,
        table: str = DEFAULT_TABLE,
        chain: str = DEFAULT_CHAIN,
        runner: Runner | None = None,
    ) -> None:
        self.table = table
        self.chain = chain
        self._run = runner or subprocess_runner()

    def read(self) -> TableState:
        """``nft -j -n list table inet gpud``."""
        code, out, err = self._run(["-j", "-n", "list", "table", FAMILY, self.table], None)
        if code != 0:
            if "No such file or directory" in err:
                return TableState(False, False, ())
            raise NftError(f"cannot list table {FAMILY} {self.table}", err.strip())
        try:
            items = json.loads(out).get("nftables", [])
        except (ValueError, AttributeError) as e:
            raise NftError("nft -j printed no JSON", str(e)) from e
        chain_ok = False
        rules = []
        foreign: list[str] = []
        for item in items:
            if "chain" in item:
                c = item["chain"]
                if c.get("name") != self.chain:
                    foreign.append(str(c.get("name")))
                else:
                    chain_ok = (c.get("hook"), c.get("type"), c.get("prio"), c.get("policy")) == (
                        "output",
                        "filter",
                        _PRIORITY_VALUE,
                        "accept",
                    )
            elif "rule" in item:
                r = item["rule"]
                if r.get("chain") != self.chain:
                    continue
                comment = str(r.get("comment", ""))
                m = _COMMENT.match(comment)
                exprs = r.get("expr", [])
                packets, nbytes = _counter(exprs)
                job = m.group(1) if m else None
                rules.append(
                    MarkRule(int(r["handle"]), comment, job, packets, nbytes, *_action(exprs))
                )
        return TableState(True, chain_ok, tuple(rules), tuple(foreign))

    def sync(self, marks: Iterable[CgroupMark]) -> MarkSync:
        """Make the table hold exactly ``marks`` (one atomic batch; only what differs)."""
        wanted: dict[str, tuple[CgroupMark, str]] = {}
        for mark in sorted(marks):
            for family, comment in mark.comments().items():
                wanted[comment] = (mark, family)
        state = self.read()
        lines: list[str] = []
        removed: list[str] = []
        created = False
        if not state.present or not state.chain_ok or state.foreign_chains:
            created = True
            if state.present:
                # gone since the read (``nft flush ruleset``)? Adding it first makes the
                # delete one that cannot fail (ENOENT) in the same batch
                lines.append(f"add table {FAMILY} {self.table}")
                lines.append(f"delete table {FAMILY} {self.table}")
                removed = [rule.comment for rule in state.rules]
            lines.append(f"add table {FAMILY} {self.table}")
            lines.append(
                f"add chain {FAMILY} {self.table} {self.chain} "
                f"{{ type filter hook output priority {_PRIORITY}; policy accept; }}"
            )
            have: dict[str, int] = {}
        else:
            have = {}
            for rule in state.rules:
                if (
                    rule.comment in wanted
                    and rule.comment not in have
                    and _does(rule, *wanted[rule.comment])
                ):
                    have[rule.comment] = rule.handle
                else:  # not ours to keep, a duplicate, or changed in place
                    removed.append(rule.comment)
                    lines.append(
                        f"delete rule {FAMILY} {self.table} {self.chain} handle {rule.handle}"
                    )
        added = []
        for comment, (mark, family) in wanted.items():
            if comment in have:
                continue
            nfproto = "ipv4" if family == "ip" else "ipv6"
            lines.append(
                f"add rule {FAMILY} {self.table} {self.chain} "
                f'socket cgroupv2 level {mark.level} "{mark.path}" '
                f"meta nfproto {nfproto} {family} dscp set {mark.dscp} counter "
                f'comment "{comment}"'
            )
            added.append(comment)
        if lines:
            self._apply(lines)
        return MarkSync(
            created,
            tuple(added),
            tuple(removed),
            tuple(have),
            rebuilt=created and state.present,
            foreign=state.foreign_chains,
        )

    def delete(self) -> bool:
        """Remove gpud's table; False when there was none."""
        if not self.read().present:
            return False
        # added first: one gone since the read is no failed delete
        self._apply([f"add table {FAMILY} {self.table}", f"delete table {FAMILY} {self.table}"])
        return True

    def _apply(self, lines: list[str]) -> None:
        code, _, err = self._run(["-f", "-"], "\n".join(lines) + "\n")
        if code != 0:
            raise NftError(f"nft refused the batch for table {FAMILY} {self.table}", err.strip())


def _does(rule: MarkRule, mark: CgroupMark, family: str) -> bool:
    """Whether ``rule`` sets ``mark``'s DSCP on ``family`` for ``mark``'s cgroup."""
    return (rule.family, rule.dscp, rule.path) == (family, mark.dscp, mark.path)


def _action(exprs: list[Any]) -> tuple[str | None, int | None, str | None]:
    """The family whose DSCP a rule's expressions set, the DSCP, and the cgroup path."""
    family: str | None = None
    dscp: int | None = None
    path: str | None = None
    for e in exprs:
        if not isinstance(e, dict):
            continue
        mangle, match = e.get("mangle"), e.get("match")
        if isinstance(mangle, dict):
            payload = (mangle.get("key") or {}).get("payload") or {}
            value = mangle.get("value")
            if payload.get("field") == "dscp" and isinstance(value, int):
                family, dscp = payload.get("protocol"), value
        elif isinstance(match, dict) and (match.get("left") or {}).get("socket") == {
            "key": "cgroupv2"
        }:
            right = match.get("right")
            path = right if isinstance(right, str) else None
    return family, dscp, path


def _counter(exprs: list[Any]) -> tuple[int, int]:
    for e in exprs:
        if isinstance(e, dict) and isinstance(e.get("counter"), dict):
            return int(e["counter"].get("packets", 0)), int(e["counter"].get("bytes", 0))
    return 0, 0
