"""NftablesMarker against the real nft in a network namespace (created and deleted here)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.net.cgroups import JobCgroups, find_cgroup2
from netshaper.nftables import NftablesMarker, NftError

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="needs nft"),
    pytest.mark.skipif(find_cgroup2() is None, reason="needs cgroup v2"),
]


def _runner(ns: str):  # type: ignore[no-untyped-def]
    def run(args: list[str], stdin: str | None) -> tuple[int, str, str]:
        r = subprocess.run(
            ["nsenter", f"--net=/run/netns/{ns}", "nft", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        return r.returncode, r.stdout, r.stderr

    return run


@pytest.fixture
def ns() -> Iterator[str]:
    name = f"gtn{os.getpid()}{uuid.uuid4().hex[:4]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.fixture
def cgroups() -> Iterator[JobCgroups]:
    mount = find_cgroup2()
    assert mount is not None
    cg = JobCgroups(mount, parent=f"gpudtest-{os.getpid()}{uuid.uuid4().hex[:4]}")
    try:
        yield cg
    finally:
        for job in cg.jobs():
            cg.remove(job)
        with contextlib.suppress(OSError):
            cg.base.rmdir()


def nft(ns: str, *args: str) -> str:
    return subprocess.run(
        ["nsenter", f"--net=/run/netns/{ns}", "nft", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout


def test_sync_is_idempotent_and_repairs(ns: str, cgroups: JobCgroups) -> None:
    marker = NftablesMarker(runner=_runner(ns))
    assert not marker.read().present
    cgroups.ensure("a")
    cgroups.ensure("b")
    marks = [m for m in (cgroups.mark("a", 10), cgroups.mark("b", 12)) if m is not None]
    first = marker.sync(marks)
    assert first.created and len(first.added) == 4
    text = nft(ns, "list", "table", "inet", "gpud")
    assert "type filter hook output priority mangle" in text
    rel = Path(cgroups.dir("a")).relative_to("/sys/fs/cgroup")
    assert f'socket cgroupv2 level 2 "{rel}" ip dscp set' in text
    assert not marker.sync(marks).changed  # nothing to do
    # a job's tag changes: only its two rules are replaced
    marks2 = [m for m in (cgroups.mark("a", 10), cgroups.mark("b", 14)) if m is not None]
    again = marker.sync(marks2)
    assert not again.created and len(again.added) == 2 and len(again.removed) == 2
    assert again.kept == tuple(marks2[0].comments().values())  # a's two, as they were
    # someone deletes a rule, then the whole table
    handle = next(r.handle for r in marker.read().rules if r.job == "a")
    nft(ns, "delete", "rule", "inet", "gpud", "jobs", "handle", str(handle))
    assert len(marker.sync(marks2).added) == 1
    nft(ns, "delete", "table", "inet", "gpud")
    assert marker.sync(marks2).created
    # a cgroup made again has a new id: its rule must follow
    cgroups.remove("a")
    cgroups.ensure("a")
    fresh = cgroups.mark("a", 10)
    assert fresh is not None
    assert marker.sync([fresh, marks2[1]]).added
    assert marker.delete() and not marker.read().present


def test_a_missing_cgroup_is_a_clear_error(ns: str) -> None:
    from netshaper.nftables import CgroupMark

    marker = NftablesMarker(runner=_runner(ns))
    with pytest.raises(NftError, match="cgroupv2 path fails"):
        marker.sync([CgroupMark("x", 10, "unified/nope-gpud-test", 1, 1)])


def test_a_rule_or_chain_changed_in_place_is_repaired(ns: str, cgroups: JobCgroups) -> None:
    """A rule that keeps gpud's comment but sets another DSCP (which may be another job's
    tag), and a chain whose policy became drop (every packet of the namespace dropped),
    are put back, as a deleted rule or table is."""
    marker = NftablesMarker(runner=_runner(ns))
    cgroups.ensure("a")
    mark = cgroups.mark("a", 10)
    assert mark is not None
    marker.sync([mark])
    rule = next(r for r in marker.read().rules if r.comment.endswith(" ip"))
    nft(
        ns,
        "replace",
        "rule",
        "inet",
        "gpud",
        "jobs",
        "handle",
        str(rule.handle),
        "socket",
        "cgroupv2",
        "level",
        "2",
        mark.path,
        "ip",
        "dscp",
        "set",
        "12",
        "counter",
        "comment",
        f'"{rule.comment}"',
    )
    repaired = marker.sync([mark])
    assert repaired.added == (rule.comment,) and repaired.removed == (rule.comment,)
    assert "dscp set 0x0c" not in nft(ns, "-n", "list", "table", "inet", "gpud")
    assert not marker.sync([mark]).changed
    nft(ns, "add", "chain", "inet", "gpud", "jobs", "{ policy drop; }")
    assert marker.sync([mark]).created
    assert "policy accept;" in nft(ns, "list", "table", "inet", "gpud")
    assert not marker.sync([mark]).changed


def test_a_chain_added_to_gpuds_table_by_hand_is_removed(ns: str, cgroups: JobCgroups) -> None:
    """A hooked chain of someone else's in gpud's table runs after gpud's and may undo every
    mark (``ip dscp set cs0``): the table is written again without it."""
    marker = NftablesMarker(runner=_runner(ns))
    cgroups.ensure("a")
    mark = cgroups.mark("a", 10)
    assert mark is not None
    marker.sync([mark])
    nft(ns, "add", "chain", "inet", "gpud", "zap", "{ type filter hook output priority 0; }")
    nft(ns, "add", "rule", "inet", "gpud", "zap", "ip", "dscp", "set", "cs0")
    nft(ns, "add", "chain", "inet", "gpud", "idle")
    repaired = marker.sync([mark])
    assert repaired.created and len(repaired.added) == 2
    assert repaired.rebuilt and sorted(repaired.removed) == sorted(repaired.added)
    assert repaired.foreign == ("zap", "idle")  # named, for the warning
    text = nft(ns, "list", "table", "inet", "gpud")
    assert "zap" not in text and "idle" not in text and "dscp set cs0" not in text
    assert "chain jobs" in text and "dscp set af11" in text
    assert not marker.sync([mark]).changed


def test_a_table_flushed_between_the_read_and_the_write_is_written_all_the_same(
    ns: str, cgroups: JobCgroups
) -> None:
    """``nft flush ruleset`` after the read found a table to rebuild: the batch that deletes
    it first still applies (no "No such file or directory"), and the table is whole."""
    cgroups.ensure("a")
    mark = cgroups.mark("a", 10)
    assert mark is not None
    run = _runner(ns)
    NftablesMarker(runner=run).sync([mark])
    nft(ns, "add", "chain", "inet", "gpud", "zap")

    def flushed_after_read(args: list[str], stdin: str | None) -> tuple[int, str, str]:
        if args[:1] == ["-f"]:
            nft(ns, "flush", "ruleset")
        return run(args, stdin)  # type: ignore[no-any-return]

    marker = NftablesMarker(runner=flushed_after_read)
    assert marker.sync([mark]).rebuilt
    text = nft(ns, "list", "table", "inet", "gpud")
    assert "chain jobs" in text and "dscp set af11" in text and "zap" not in text
    assert NftablesMarker(runner=run).delete() is True
    nft(ns, "add", "table", "inet", "gpud")
    assert marker.delete() is True  # flushed again before its write
