"""Re-prioritization cost: 63 job tags move to new levels in one tick, three ways.

Runs as root in a network namespace of its own (a veth pair; both deleted at the end,
also on failure or Ctrl-C). The interface holds the full tree for 63 jobs over 8 levels
(DSCP has 63 codepoints besides 0, the untagged default, so 63 tags is the most one
interface can tell apart; the default tag pool hands out 55);
each step moves every job to another level (``level -> (level + 1 + rep) % 8``), which is
4 tc operations per job (add the leaf under the new level, re-point the IPv4 and IPv6
filters, delete the old leaf), 252 in all; with ``--in-place`` (what the daemon does: a
leaf stays under the level class it was first placed at) one class change per job, 63 in
all. Measured side by side, in rotating order
within every repetition:

- ``ours``: ``TcNetlink.sync(plan)``: diff against the adapter's view of the kernel, one
  batch over one netlink socket, every ack checked;
- ``ours_read``: ``TcNetlink.drift(plan)``: the same, after re-reading the interface's
  qdisc, classes and filters from the kernel (what a drift check each tick costs);
- ``tc_batch``: one ``tc -batch FILE`` process doing the same operations;
- ``tc_each``: one ``tc`` process per operation.

Every method starts from the same kind of state and its result is checked against the
plan (read back from the kernel) outside the timed part. Reported: per-method medians and
minimums (ms) and the medians of per-repetition ratios to ``tc_batch``.

Target: ours <= 2.5 x tc -batch. A SIGTERM or SIGINT stops it: its namespace deleted, the
figures of the repetitions done so far printed (with ``--json``, as its one JSON object,
with ``cut_short``), "cut short by SIGNAL after N of M repetitions", exit 128 + its number.

    sudo .venv/bin/python -m tools.bench_reprio [--reps N] [--jobs 63] [--ifaces 1] [--json]

``--ifaces N`` puts every job on N interfaces (a node with N NICs): N times the operations,
still one netlink batch for gpud and one ``tc -batch`` file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from netshaper import tcplan
from netshaper.tc_netlink import TcNetlink
from tools.simdaemon import cut_short, exit_as, held, restores_signals, stopped_by_signal

LEVELS = 8
LINK_BPS = 10_000_000_000


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


def _tags(n: int) -> dict[str, int]:
    pool = list(range(1, 64))  # every codepoint but 0 (untagged), reserved ones included
    if n > len(pool):
        raise SystemExit(f"--jobs must be at most {len(pool)}")
    return {f"job-{i:02d}": pool[i] for i in range(n)}


def _ifaces(n: int) -> list[str]:
    return [f"gpb{i}" for i in range(n)]


def _plan(
    tags: dict[str, int], shift: int, ifaces: list[str], in_place: bool = False
) -> tcplan.TcPlan:
    levels = {job: (i + shift) % LEVELS for i, job in enumerate(sorted(tags))}
    # The daemon keeps each leaf under the level class it was first placed at (its home)
    # and changes only its prio; without homes every move re-places the leaf.
    homes = {job: i % LEVELS for i, job in enumerate(sorted(tags))} if in_place else None
    return tcplan.plan(dict.fromkeys(ifaces, LINK_BPS), tags, levels, [0.02] * LEVELS, homes=homes)


def _check(tc: TcNetlink, want: tcplan.TcPlan) -> None:
    for iface in want.ifaces:
        ops = tcplan.diff(tc.read(iface), want.interface(iface))
        if ops:
            raise SystemExit(f"{iface} differs from the plan after a step: {ops[0].tc_args()}")


METHODS = ("ours", "ours_read", "tc_batch", "tc_each")
NAMESPACE_DELETED = "its network namespace deleted"


def run(
    reps: int,
    jobs: int,
    n_ifaces: int = 1,
    in_place: bool = False,
    *,
    samples: dict[str, list[float]] | None = None,
    op_counts: set[int] | None = None,
) -> dict[str, Any]:
    """The figures of ``reps`` repetitions; ``samples`` (each method's seconds) and
    ``op_counts`` filled as they are measured (what a run cut short has)."""
    if os.geteuid() != 0:
        raise SystemExit("bench_reprio needs root (it creates a network namespace)")
    tc_bin = shutil.which("tc")
    if tc_bin is None:
        raise SystemExit("bench_reprio needs iproute2's tc")
    samples = {} if samples is None else samples
    samples.update({m: [] for m in METHODS})
    op_counts = set() if op_counts is None else op_counts
    ns = f"gpud-bench-{os.getpid()}"
    tmp = ""
    try:
        with held():  # a signal between the two would leave them: it waits for the finally
            _sh("ip", "netns", "add", ns)
            tmp = tempfile.mkdtemp(prefix="bench_reprio-")
        ifaces = _ifaces(n_ifaces)
        for i, iface in enumerate(ifaces):
            _sh("ip", "-n", ns, "link", "add", iface, "type", "veth", "peer", "name", f"gpp{i}")
            _sh("ip", "-n", ns, "link", "set", iface, "up")
        tags = _tags(jobs)
        tc = TcNetlink(netns=ns)
        shift = 0
        current = _plan(tags, shift, ifaces, in_place)
        first = tc.sync(current)
        if not first.ok:
            raise SystemExit(f"initial sync failed: {first.errors}")
        batch_file = os.path.join(tmp, "ops.tc")

        def ours(want: tcplan.TcPlan) -> Callable[[], None]:
            tc.drift(current)  # untimed: the adapter's view matches the kernel, as after a tick

            def go() -> None:
                r = tc.sync(want)
                if not r.ok:
                    raise SystemExit(f"sync failed: {r.errors}")
                op_counts.add(r.op_count)

            return go

        def ours_read(want: tcplan.TcPlan) -> Callable[[], None]:
            def go() -> None:
                r = tc.drift(want)
                if not r.ok:
                    raise SystemExit(f"drift failed: {r.errors}")
                op_counts.add(r.op_count)

            return go

        def ops_for(want: tcplan.TcPlan) -> list[list[str]]:
            ops = [op for i in ifaces for op in tcplan.diff(tc.read(i), want.interface(i))]
            op_counts.add(len(ops))
            return [op.tc_args() for op in ops]

        def tc_batch(want: tcplan.TcPlan) -> Callable[[], None]:
            with open(batch_file, "w") as f:
                f.writelines(" ".join(args) + "\n" for args in ops_for(want))

            def go() -> None:
                subprocess.run([tc_bin, "-n", ns, "-batch", batch_file], check=True)

            return go

        def tc_each(want: tcplan.TcPlan) -> Callable[[], None]:
            cmds = ops_for(want)

            def go() -> None:
                for args in cmds:
                    subprocess.run([tc_bin, "-n", ns, *args], check=True)

            return go

        methods = {"ours": ours, "ours_read": ours_read, "tc_batch": tc_batch, "tc_each": tc_each}
        names = list(methods)
        print(f"measuring: {reps} repetitions", file=sys.stderr, flush=True)
        for rep in range(reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                shift += 1 + rep % (LEVELS - 1)
                want = _plan(tags, shift, ifaces, in_place)
                go = methods[name](want)
                t0 = time.perf_counter()
                go()
                samples[name].append(time.perf_counter() - t0)
                current = want
                _check(tc, current)
        tc.close()
    finally:
        with held():
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
    return figures(samples, op_counts, jobs, n_ifaces)


def figures(
    samples: dict[str, list[float]], op_counts: set[int], jobs: int, n_ifaces: int
) -> dict[str, Any]:
    """The figures of the repetitions every method measured (``reps`` of them)."""
    done = min((len(v) for v in samples.values()), default=0)
    whole = {name: v[:done] for name, v in samples.items()}

    def ratio(name: str) -> float:
        return statistics.median(a / b for a, b in zip(whole[name], whole["tc_batch"], strict=True))

    return {
        "jobs": jobs,
        "interfaces": n_ifaces,
        "ops_per_step": sorted(op_counts),
        "reps": done,
        "ms": {
            name: {
                "median": round(statistics.median(v) * 1e3, 3),
                "min": round(min(v) * 1e3, 3),
            }
            for name, v in whole.items()
            if done
        },
        "ratio_to_tc_batch": {name: round(ratio(name), 3) for name in whole if done},
        "target": "ours <= 2.5 x tc_batch",
    }


@restores_signals
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_reprio", description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20, help="repetitions (default 20)")
    p.add_argument("--jobs", type=int, default=63, help="job tags that move (default 63)")
    p.add_argument("--ifaces", type=int, default=1, help="interfaces, each with every job (1)")
    p.add_argument(
        "--in-place",
        action="store_true",
        help="leaves stay under their home level and only their prio changes, as in gpud",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if not 1 <= args.reps <= 1000:
        p.error(f"--reps must be in [1, 1000], got {args.reps}")
    if not 1 <= args.ifaces <= 16:
        p.error(f"--ifaces must be in [1, 16], got {args.ifaces}")
    samples: dict[str, list[float]] = {}
    op_counts: set[int] = set()
    with stopped_by_signal() as stopped:
        r = run(
            args.reps, args.jobs, args.ifaces, args.in_place, samples=samples, op_counts=op_counts
        )
    if stopped.by:
        r = figures(samples, op_counts, args.jobs, args.ifaces)
        done, shown = f"{r['reps']} of {args.reps} repetitions", None if args.json else show
        return cut_short(stopped.by, done, figures=r, show=shown, cleaned=NAMESPACE_DELETED)
    if args.json:
        print(json.dumps(r, indent=2, sort_keys=True))
        return 0
    show(r)
    return 0


def show(r: dict[str, Any]) -> None:
    """The figures as text."""
    print(
        f"move {r['jobs']} job tags to new levels on {r['interfaces']} interface(s)"
        f" ({r['ops_per_step']} tc ops), {r['reps']} reps"
    )
    for name, v in r["ms"].items():
        print(
            f"  {name:10s} median {v['median']:8.2f} ms  min {v['min']:8.2f} ms"
            f"  ratio to tc -batch {r['ratio_to_tc_batch'][name]:6.2f}"
        )
    print(f"  target: {r['target']}")


if __name__ == "__main__":
    exit_as(main())
