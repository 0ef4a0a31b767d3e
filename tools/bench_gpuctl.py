"""gpuctl start-up, measured side by side against its practical floors in one run.

::

    .venv/bin/python -m tools.bench_gpuctl [--reps 21]

Two pairs of commands, each a fresh process, on a running ``gpud --simulate`` node:

- ``gpuctl status`` against ``floor``: a minimal script that imports grpc and the generated
  node stubs and makes the same ``GetStatus`` call over the same socket (what any Python
  gRPC client must pay), printing the answer;
- ``gpuctl --help`` against ``python3 -c pass`` (the interpreter's own start-up).

Each repetition runs the four commands back to back, in an order that alternates between
repetitions, so that both sides of a ratio see the same machine load; the reported ratio is
the median of the per-repetition ratios (medians of each side shown too). Targets: status
<= 1.3 x the floor, --help <= 3 x ``python3 -c pass``. A SIGTERM or SIGINT stops it: gpud
stopped, its directory removed, the repetitions done so far reported, "cut short by SIGNAL",
dying by it (128 + its number).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from tools.simdaemon import cut_short, exit_as, restores_signals, simulated_gpud, stopped_by_signal

GPUCTL = "import sys; from gpud.cli.main import main; sys.exit(main())"  # the console script
FLOOR = """
import sys
import grpc
from gpud.v1 import node_pb2, node_pb2_grpc
channel = grpc.insecure_channel("unix:" + sys.argv[1])
resp = node_pb2_grpc.NodeStub(channel).GetStatus(node_pb2.GetStatusRequest(), timeout=10)
print(resp.version, resp.gpu_count, resp.healthy_gpu_count)
"""
NAMES = ("gpuctl status", "floor", "gpuctl --help", "python -c pass")
TARGETS = {"status": 1.3, "help": 3.0}


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


@restores_signals
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--simulate", default="H100-SXM5-80GB:8")
    args = parser.parse_args(argv)
    py = sys.executable
    times: dict[str, list[float]] = {name: [] for name in NAMES}
    with stopped_by_signal() as stopped, simulated_gpud(args.simulate) as daemon:
        sock = str(daemon.socket)
        commands = {
            "gpuctl status": [py, "-c", GPUCTL, "--socket", sock, "status"],
            "floor": [py, "-c", FLOOR, sock],
            "gpuctl --help": [py, "-c", GPUCTL, "--help"],
            "python -c pass": [py, "-c", "pass"],
        }
        for cmd in commands.values():  # warm the page cache and .pyc files
            wall(cmd)
        print(f"measuring: {args.reps} repetitions", flush=True)
        for rep in range(args.reps):
            names = NAMES if rep % 2 == 0 else NAMES[::-1]
            rep_times = {name: wall(commands[name]) for name in names}
            for name, took in rep_times.items():  # a repetition counts whole or not at all
                times[name].append(took)
    done = len(times[NAMES[0]])
    if stopped.by and not done:
        return cut_short(stopped.by, f"0 of {args.reps} repetitions")
    ratios = {
        "status": [s / f for s, f in zip(times["gpuctl status"], times["floor"], strict=True)],
        "help": [
            h / p for h, p in zip(times["gpuctl --help"], times["python -c pass"], strict=True)
        ],
    }
    print(f"{done} repetitions, {args.simulate} simulated node, {py}")
    for name, values in times.items():
        print(f"  {name:<15} median {statistics.median(values) * 1000:6.1f} ms"
              f"  min {min(values) * 1000:6.1f} ms")  # fmt: skip
    ok = True
    for key, label in (("status", "gpuctl status / floor"), ("help", "gpuctl --help / -c pass")):
        ratio = statistics.median(ratios[key])
        good = ratio <= TARGETS[key]
        ok &= good
        print(f"  {label:<25} {ratio:5.2f} x  (target <= {TARGETS[key]:g} x: "
              f"{'met' if good else 'MISSED'})")  # fmt: skip
    if stopped.by:
        return cut_short(stopped.by, f"{done} of {args.reps} repetitions")
    return 0 if ok else 1


if __name__ == "__main__":
    exit_as(main())
