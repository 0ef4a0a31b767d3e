"""``gpuctl events``: the daemon's recent decisions from its structured event log."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from gpud.cli.context import (
    EXIT_NOT_RUNNING,
    JOB_NAME,
    CliError,
    Context,
    Subparsers,
    given,
    integer,
)
from gpud.cli.output import json_text, message_to_dict
from gpud.cli.pipes import when_reader_goes
from gpud.errors import InvalidArgument
from gpud.shared import (
    MAX_EVENT_LIMIT,
    WATCHING_KEY,
    check_kind_prefix,
    is_about,
    names_an_event_gpu,
)
from gpud.v1 import node_pb2 as pb
from gpud.v1 import node_pb2_grpc as pb_grpc


def event_gpu(text: str) -> str:
    """An argparse ``type``: a GPU as the event log names it (:func:`names_an_event_gpu`)."""
    gpu = text.strip()
    if names_an_event_gpu(gpu):
        return gpu
    raise argparse.ArgumentTypeError(
        f"expected a GPU index (0..N-1, gpuctl gpus lists them) or a GPU-/MIG- UUID, got {text!r}"
    )


_SOME_KIND = given("a kind or its start")


def event_kind(text: str) -> str:
    """An argparse ``type``: the start of an event kind, refused as gpud refuses it
    (:func:`gpud.shared.check_kind_prefix`) when no event's kind could start with it."""
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            return text  # a byte that is not UTF-8: gpuctl says so of any argument, after parsing
    try:
        return check_kind_prefix(_SOME_KIND(text), field="")
    except InvalidArgument as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser("events", help="recent structured events, oldest first")
    filters: tuple[tuple[str, Callable[[str], str], str, str], ...] = (
        (
            "--kind",
            event_kind,
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
        ("--job", JOB_NAME, "NAME", "only events about job NAME"),
    )
    for flag, parse, metavar, help_text in filters:
        # None: the option left out (a default of "" would go through its type and be refused)
        parser.add_argument(flag, default=None, type=parse, metavar=metavar, help=help_text)
    parser.add_argument(
        "--limit",
        # the range gpud takes, so that -1 and 10**11 are refused alike, before asking
        type=integer(0, MAX_EVENT_LIMIT),
        default=0,
        metavar="N",
        help=f"the newest N, at most {MAX_EVENT_LIMIT} (default and 0: 100)",
    )
    parser.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="then each new event as gpud emits it, one line each (--json: one object a"
        " line), until Ctrl-C; across a restart of gpud it reconnects and goes on (--json:"
        ' {"gpud": "stopped"} and {"gpud": "back"} in the stream)',
    )
    parser.set_defaults(run=run)


# Messages are padded to this many characters at most, so that the FIELDS of most events line
# up without every line taking the width of the longest message in the listing.
MESSAGE_PAD = 72


def _fields(event: pb.Event) -> dict[str, Any]:
    return message_to_dict(event.fields) if event.HasField("fields") else {}


def _when(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


def _detail(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={json.dumps(v)}" for k, v in sorted(fields.items()))


def run(ctx: Context, args: argparse.Namespace) -> int:
    if args.follow:
        return follow(ctx, args)
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
        detail = _detail(_fields(event))
        rows.append((_when(event.time_unix_seconds), event.kind, event.message, detail))
    ctx.out.print_table(("TIME", "KIND", "MESSAGE", "FIELDS"), rows, pad_at_most={2: MESSAGE_PAD})
    return 0


# --follow cannot line up columns it has not seen yet: the kind is padded to this width
KIND_PAD = 22
# seconds between tries to reach gpud again after it stopped: doubled from the first to the last
RECONNECT_FIRST_S = 0.2
RECONNECT_MOST_S = 5.0


def _follow_line(ctx: Context, item: pb.WatchEventsResponse) -> str:
    if item.WhichOneof("item") == "event":
        event = item.event
        if ctx.out.json:
            return json_text(message_to_dict(event), sort_keys=True)
        detail = _detail(_fields(event))
        head = f"{_when(event.time_unix_seconds)}  {event.kind:<{KIND_PAD}} {event.message}"
        return f"{head}  {detail}" if detail else head
    if item.WhichOneof("item") == "expired":
        if ctx.out.json:
            return json.dumps({"expired": item.expired})
        return (
            f"gpuctl: {item.expired} events (of any kind) said while gpuctl was away are no"
            " longer kept by gpud"
        )
    if ctx.out.json:
        return json.dumps({"missed": item.missed})
    return f"gpuctl: missed {item.missed} events (reading too slowly)"


def follow(ctx: Context, args: argparse.Namespace) -> int:
    """``gpuctl events --follow``: WatchEvents, printed a line at a time and flushed. When
    gpud stops (the stream ends, or gpud is gone), it is reached again every few seconds
    and the watch resumes after the last event seen (``after_seq``, checked by its time):
    nothing emitted in between is lost while gpud's ring still keeps it. The stream is live
    once gpud sends its initial metadata (the watch is set up), before any event."""
    # not gRPC's own log line (`Got goaway ... Cancelling all calls`) each time gpud stops:
    # gpuctl says it once, in its words. gRPC reads it when it makes its first channel, after
    # this (ctx.stub below).
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    import grpc

    # gpud went away under the stream: killed, or stopped past its grace
    went = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    request = pb.WatchEventsRequest(
        kind_prefix=args.kind or "", limit=args.limit, gpu=args.gpu or "", job=args.job or ""
    )
    streams: list[Any] = []
    # events may be hours apart: `--follow | head -3` ends once head has gone
    gone = when_reader_goes(lambda: streams[-1].cancel() if streams else None)
    pause, away, answered = RECONNECT_FIRST_S, False, False

    def say(gpud: str, text: str) -> None:
        # on stderr for people; under --json also in the stream, where a consumer reads
        print(f"gpuctl: {text}", file=sys.stderr)
        if ctx.out.json:
            ctx.out.print(json.dumps({"gpud": gpud}))
            ctx.out.flush()

    def live() -> None:
        nonlocal pause, away, answered
        if away:
            say("back", "gpud is back: following again")
            pause, away = RECONNECT_FIRST_S, False
        answered = True

    try:
        while not gone.is_set():
            try:
                stream = ctx.stub(pb_grpc.NodeStub).WatchEvents(request)
                streams[:] = [stream]
                if gone.is_set():  # the reader went before the stream could be cancelled
                    stream.cancel()
                # gpud sends it once the watch is set up (an older gpud, without the key:
                # live at its first item)
                if dict(stream.initial_metadata() or ()).get(WATCHING_KEY) == "1":
                    live()
                for item in stream:
                    live()
                    if item.WhichOneof("item") == "event" and item.event.seq:
                        request.after_seq = item.event.seq
                        request.after_time_unix_seconds = item.event.time_unix_seconds
                    ctx.out.print(_follow_line(ctx, item))
                    ctx.out.flush()
            except grpc.RpcError as err:
                if gone.is_set():
                    break
                if err.code() not in went or not (answered or away):
                    raise ctx.translate(err) from None
            except CliError as err:
                if err.exit_code != EXIT_NOT_RUNNING or not away:
                    raise  # at the start: gpud is not running, as for every command
            if not away:
                say("stopped", "gpud stopped: reconnecting until it is back (Ctrl-C ends)")
                away = True
            ctx.close()  # a new channel: gRPC's own would wait up to 2 minutes between tries
            gone.wait(pause)  # a reader gone (a terminal closed) ends it now, not after
            pause = min(pause * 2, RECONNECT_MOST_S)
    except KeyboardInterrupt:
        return 130
    raise BrokenPipeError  # exit 141 (129: a terminal hung up), as the next write would have
