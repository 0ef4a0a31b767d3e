"""``gpuctl events``: the daemon's recent decisions from its structured event log."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from gpud.cli.context import INT32, Context, Subparsers
from gpud.cli.output import message_to_dict
from gpud.shared import is_about
from gpud.v1 import node_pb2 as pb
from gpud.v1 import node_pb2_grpc as pb_grpc


def _given(what: str) -> Callable[[str], str]:
    """An argparse ``type`` that refuses an empty value (an unset variable) rather than
    take it for the option left out, which would list every event."""

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"give {what}, got {text!r}")
        return text

    return parse


def event_gpu(text: str) -> str:
    """An argparse ``type``: a GPU as the event log names it, its index or a GPU or MIG
    device UUID. Anything else would match no event and list nothing, as if the GPU had no
    history."""
    gpu = text.strip()
    if (gpu.isascii() and gpu.isdigit()) or gpu.startswith(("GPU-", "MIG-")):
        return gpu
    raise argparse.ArgumentTypeError(
        f"expected a GPU index (0..N-1, gpuctl gpus lists them) or a GPU-/MIG- UUID, got {text!r}"
    )


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser("events", help="recent structured events, oldest first")
    filters: tuple[tuple[str, Callable[[str], str], str, str], ...] = (
        (
            "--kind",
            _given("a kind or its start"),
            "PREFIX",
            'only kinds starting with PREFIX (e.g. "gpu.")',
        ),
        (
            "--gpu",
            event_gpu,
            "GPU",
            "only events about this GPU: its index (also its MIG devices'), or a GPU or MIG"
            " device UUID",
        ),
        ("--job", _given("a job name"), "NAME", "only events about job NAME"),
    )
    for flag, parse, metavar, help_text in filters:
        # None: the option left out (a default of "" would go through its type and be refused)
        parser.add_argument(flag, default=None, type=parse, metavar=metavar, help=help_text)
    parser.add_argument(
        "--limit", type=INT32, default=0, metavar="N", help="the newest N (default 100)"
    )
    parser.set_defaults(run=run)


# Messages are padded to this many characters at most, so that the FIELDS of most events line
# up without every line taking the width of the longest message in the listing.
MESSAGE_PAD = 72


def _fields(event: pb.Event) -> dict[str, Any]:
    return message_to_dict(event.fields) if event.HasField("fields") else {}


def _when(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


def run(ctx: Context, args: argparse.Namespace) -> int:
    kind, gpu, job = args.kind or "", args.gpu or "", args.job or ""
    request = pb.ListEventsRequest(kind_prefix=kind, limit=args.limit, gpu=gpu, job=job)
    resp: pb.ListEventsResponse = ctx.call(ctx.stub(pb_grpc.NodeStub).ListEvents, request)
    if gpu or job:
        # a gpud older than these filters ignores them: filter here too
        kept = [e for e in resp.events if is_about(_fields(e), gpu=gpu, job=job)]
        if len(kept) != len(resp.events):
            resp = pb.ListEventsResponse(events=kept)
    if ctx.out.json:
        ctx.out.print_json(resp)
        return 0
    rows = []
    for event in resp.events:
        fields = _fields(event)
        detail = " ".join(f"{k}={json.dumps(v)}" for k, v in sorted(fields.items()))
        rows.append((_when(event.time_unix_seconds), event.kind, event.message, detail))
    ctx.out.print_table(("TIME", "KIND", "MESSAGE", "FIELDS"), rows, pad_at_most={2: MESSAGE_PAD})
    return 0
