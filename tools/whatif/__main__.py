"""``python -m tools.whatif TRACE``: what a change to the node would do to queue waits.

::

    python -m tools.whatif history.json --gpus 12 --json             # four more GPUs
    python -m tools.whatif pai_task_table.csv --mig-config mig.yaml -c all-balanced --json
    python -m tools.whatif TRACE --product H200-SXM-141GB --plot waits.png

The trace (gpud's ``gpuctl jobs history --json``, or an Alibaba PAI task CSV: see
:mod:`tools.whatif.traces`) is replayed through gpud's own admission queue and placement on a
simulated clock, once on the node as it is (``--node-*``, default 8x H100-SXM5-80GB, whole)
and once as modified (``--gpus``, ``--product``, ``--mig-config FILE -c NAME``). Printed for
both: mean and p95 wait, the fraction of jobs the node can never run, and the Weighted
Wait-Time Score (:mod:`gpud.admission.wws`; ``docs/admission.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpud.admission.node import MIB
from gpud.backend.products import lookup
from gpud.cli.pipes import quiet_on_broken_pipe
from gpud.errors import GpudError
from tools.whatif.replay import NodeSpec, Replay, compare
from tools.whatif.traces import TraceError, load

DEFAULT_PRODUCT = "H100-SXM5-80GB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.whatif", description=__doc__.split("\n")[0]
    )
    parser.add_argument("trace", type=Path)
    parser.add_argument("--format", choices=("auto", "gpud", "pai"), default="auto")
    parser.add_argument("--node-gpus", type=int, default=8, metavar="N", help="the node as it is")
    parser.add_argument("--node-product", default=DEFAULT_PRODUCT, metavar="P")
    parser.add_argument("--node-mig-config", type=Path, metavar="FILE")
    parser.add_argument("--node-config", metavar="NAME", help="config of --node-mig-config")
    parser.add_argument("--gpus", type=int, metavar="N", help="modified: this many GPUs")
    parser.add_argument("--product", metavar="P", help="modified: this product")
    parser.add_argument("--mig-config", type=Path, metavar="FILE", help="modified: mig-parted file")
    parser.add_argument("-c", "--config", metavar="NAME", help="config of --mig-config")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="wait distributions")
    args = parser.parse_args(argv)
    as_is = NodeSpec(args.node_product, args.node_gpus, args.node_mig_config, args.node_config)
    modified = NodeSpec(
        args.product or as_is.product,
        args.gpus or as_is.gpus,
        args.mig_config if args.mig_config is not None else as_is.mig_file,
        args.config if args.mig_config is not None else as_is.mig_config,
    )
    try:
        spec = lookup(as_is.product)
        memory = spec.memory_mib * MIB if spec is not None else 80 << 30
        trace = load(args.trace, fmt=args.format, gpu_memory_bytes=memory)
        if not trace.jobs:
            raise TraceError(f"{args.trace}: no job to replay ({trace.skipped} skipped)")
        result, before, after = compare(trace.jobs, as_is, modified)
    except (TraceError, GpudError) as err:
        print(f"whatif: {err}", file=sys.stderr)
        return 2
    result = {"trace": str(args.trace), "skipped": trace.skipped, **result}
    if args.plot is not None:
        from tools.netsim.plot import MissingMatplotlib

        try:
            plot(before, after, args.plot)
        except MissingMatplotlib as err:
            print(f"whatif: {err}", file=sys.stderr)
            return 2
        result["plot"] = str(args.plot)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(
        f"{result['jobs']} jobs ({trace.skipped} skipped), mean run {result['mean_service_s']:.0f} s"
    )
    for side in ("as_is", "modified"):
        r = result[side]
        print(
            f"{side:>9}: {r['gpus']}x {r['product']}{' ' + r['mig_config'] if 'mig_config' in r else ''}:"
            f" mean wait {r['mean_wait_s']:.0f} s, p95 {r['p95_wait_s']:.0f} s,"
            f" unfeasible {r['unfeasible_fraction']:.1%}, WWS {r['wws']:.3f}"
        )
    return 0


def plot(before: Replay, after: Replay, out: Path) -> None:
    """Empirical CDFs of the waits, as-is and modified, side by side."""
    from tools.netsim.plot import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharex=True, sharey=True)
    for ax, (name, run) in zip(axes, (("as is", before), ("modified", after)), strict=True):
        waits = sorted(run.waits)
        n = len(waits)
        ax.step(waits, [(i + 1) / n for i in range(n)], where="post")
        mean = sum(waits) / n if n else 0.0
        ax.axvline(mean, linestyle="--", linewidth=0.8, color="gray")
        ax.set_title(f"{name}: mean {mean:.0f} s; {run.unfeasible} of {run.jobs} unfeasible")
        ax.set_xlabel("wait (s)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of jobs")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(quiet_on_broken_pipe(main))
