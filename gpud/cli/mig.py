"""``gpuctl mig``: MIG layouts in nvidia-mig-parted's config format.

::

    gpuctl mig show [--profiles]                  instances, MIG UUIDs, processes and jobs
    gpuctl mig apply -f FILE -c NAME [--drain [--drain-timeout S] | --force] [--dry-run]
                     [--skip-reset]
    gpuctl mig assert -f FILE -c NAME             exit 0: the GPUs match; 1: they differ
    gpuctl mig export [-c NAME]                   the current layout as a mig-parted file
    gpuctl mig forget [--gone] GPU-UUID           drop the layout recorded for a GPU gone
                                                  (--gone: from the bus, for good)

With ``--drain``, ``--drain-timeout`` is how long to wait for processes to leave the
instances that would be destroyed (default: the daemon's ``mig.drain_timeout_s``); the call
itself waits that long plus a margin.

A MIG mode change that waits for a GPU reset (A100) is finished by resetting the GPU when
nothing runs on it (the busy, ``--drain`` and ``--force`` rules apply), and the instances are
created in the same apply; ``--skip-reset`` leaves it pending for the next reset or reboot.
An apply (not a dry run) is waited for 10 minutes at least, whatever ``--timeout`` says: GPUs
are applied one after another, each may wait for its MPS control daemons to stop, and resets
take a while. Should that pass while gpud still answers, gpuctl says so and exits 1; a Ctrl-C
meanwhile says that an apply that had begun goes on in gpud.

``--dry-run`` makes the apply's checks and changes nothing: it lists each GPU's steps and
answers with the status words and exit code the apply would (``busy`` and exit 6: refused,
processes or jobs' reservations hold instances it would destroy; ``faulty`` and exit 11: left alone;
``reset_pending`` with ``--skip-reset``; ``failed`` and exit 1 where ``--force`` would leave a
MIG mode change pending behind processes and the GPU reset would be refused), listing the
GPU reset where the apply makes one. With ``--drain`` it does not wait: it names the
processes the apply would wait for.

A faulty GPU (lost, not answering) is shown with its reason and left alone while the others
are shown, applied, checked or exported: the command then exits 11 (partial), and says each
such GPU and why on stderr (``gpuctl: faulty: GPU 1 (GPU-...): GPU lost ...``; ``not
checked: ...`` for ``assert``, ``not exported: ...`` for ``export``). A GPU whose
MIG devices' processes alone cannot be listed is no faulty GPU: its instances are shown with
``?`` for processes and the reason on the GPU's line (``--json``: ``processes_unknown``,
``processes`` null); one whose MIG devices' memory alone cannot be read likewise, with ``?``
for memory used (``memory_unknown``).

With ``--json`` the answer is the document on stdout; the note said beside an answer that
exits non-zero (busy, partial: a faulty GPU shown, not checked or left out of an export) is
the JSON error document on stderr, as an error's is, and that of one that exits 0
(``reset_pending``) is left out.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from pathlib import Path

from gpud.cli.context import (
    EXIT_NOT_RUNNING,
    EXIT_PARTIAL,
    EXIT_USAGE,
    CliError,
    Context,
    Subparsers,
    given,
    seconds,
)
from gpud.cli.output import NA, cell_first_few, gib, last_seen
from gpud.errors import ERROR_TABLE, FailedPrecondition, InvalidArgument
from gpud.shared import (
    MAX_DRAIN_SECONDS,
    MAX_LAYOUT_BYTES,
    check_config_name,
    read_small_text,
)
from gpud.v1 import mig_pb2 as pb
from gpud.v1 import mig_pb2_grpc as pb_grpc


def config_name(text: str) -> str:
    """An argparse ``type``: the name of a config, as gpud takes it
    (:func:`gpud.shared.check_config_name`), so that one no apply could take is a usage
    error naming ``-c`` (exit 2), never a name export writes into its YAML."""
    given("the config's name")(text)
    try:
        return check_config_name(text, field="")
    except InvalidArgument as err:
        raise argparse.ArgumentTypeError(str(err)) from None


EXIT_DIFFERS = 1
EXIT_FAILED = 1
# 6 (Busy, a FailedPrecondition): refused, processes run on what would be destroyed or a
# job reserved it; a FailedPrecondition too: another apply is in flight
EXIT_BUSY = ERROR_TABLE[FailedPrecondition][1]
# How long an apply that changes GPUs is waited for, --skip-reset or not: it takes the GPUs
# one after another, and a GPU may wait for its reset (seconds to tens of seconds:
# nvidia-mig-parted apply blocks as long) and, before its changes, for the MPS control
# daemons on it to stop: a busy one up to its longest command and request_timeout_s (12 s
# by default), then its quit, SIGTERM and SIGKILL (about 23 s in all, twice where one
# would not stop before). Ten minutes holds eight GPUs whose daemons all hang.
_APPLY_WAIT_S = 600.0
# How long gpuctl asks gpud's health service whether gpud answers at all, once an apply
# was not answered in time
_HEALTH_WAIT_S = 5.0
_CALL_MARGIN_S = 60.0

INSTANCE_HEADERS = (
    "GPU",
    "GI",
    "CI",
    "PROFILE",
    "PLACEMENT",
    "MIG",
    "UUID",
    "MEM GiB",
    "PROCESSES",
)
PROFILE_HEADERS = ("GPU", "PROFILE", "FREE", "PLACEMENTS")


def register(subparsers: Subparsers) -> None:
    mig = subparsers.add_parser("mig", help="MIG layouts (mig-parted format; default: show)")
    mig.set_defaults(run=run_show, profiles=False)
    commands = mig.add_subparsers(dest="mig_command", metavar="COMMAND")

    show = commands.add_parser("show", help="MIG mode, instances, UUIDs, processes and jobs")
    show.add_argument("--profiles", action="store_true", help="also list profiles and placements")
    show.set_defaults(run=run_show)

    apply = commands.add_parser("apply", help="apply a named config of a mig-parted file")
    _config_args(apply)
    mode = apply.add_mutually_exclusive_group()
    mode.add_argument(
        "--drain",
        action="store_true",
        help="wait for processes to leave instances to be destroyed (see --drain-timeout)",
    )
    apply.add_argument(
        "--drain-timeout",
        type=seconds(MAX_DRAIN_SECONDS),
        metavar="SECONDS",
        help="with --drain: how long to wait (default: the daemon's mig.drain_timeout_s)",
    )
    mode.add_argument(
        "--force", action="store_true", help="do not check for processes (the driver may refuse)"
    )
    apply.add_argument(
        "--dry-run",
        action="store_true",
        help="print what the apply would do and exit as it would; change nothing",
    )
    apply.add_argument(
        "--skip-reset",
        action="store_true",
        help="leave a MIG mode change pending a GPU reset instead of resetting the GPU",
    )
    apply.set_defaults(run=run_apply)

    check = commands.add_parser("assert", help="exit 0 when the GPUs match a config, 1 if not")
    _config_args(check)
    check.set_defaults(run=run_assert)

    export = commands.add_parser("export", help="print the current layout as a mig-parted file")
    # -c "": an unset variable, which gpud would take as "current"
    export.add_argument(
        "-c", "--config", default="current", type=config_name, metavar="NAME", help="config name"
    )
    export.set_defaults(run=run_export)

    forget = commands.add_parser(
        "forget", help="drop the layout recorded for a GPU no longer present (replaced)"
    )
    forget.add_argument(
        "gpu_uuid", metavar="GPU-UUID", type=given("the GPU's UUID"), help="as mig show says it"
    )
    forget.add_argument(
        "--gone",
        action="store_true",
        help="the board is removed for good: drop its layout though it is gone from the bus"
        " (recorded at an index the driver no longer counts)",
    )
    forget.set_defaults(run=run_forget)


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-f",
        "--file",
        required=True,
        # -f "": an unset variable; as a Path it would be ".", the directory
        type=given("the file's path"),
        metavar="FILE",
        help="mig-parted config file (-: standard input)",
    )
    parser.add_argument(
        "-c",
        "--config",
        required=True,
        type=config_name,
        metavar="NAME",
        help="entry of mig-configs",
    )


def _source(args: argparse.Namespace) -> pb.MigConfigSource:
    path = Path(args.file)
    try:
        text = read_small_text(path, MAX_LAYOUT_BYTES)
    except OSError as err:
        raise CliError(f"cannot read {path}: {err.strerror}", EXIT_USAGE) from None
    except ValueError as err:
        raise CliError(f"{path}: {err}", EXIT_USAGE) from None
    return pb.MigConfigSource(text=text, path=str(path), name=args.config)


# processes named in an instance's row, the last column: its row alone grows with them
PROCESSES_SHOWN = 8


def _processes(inst: pb.MigInstance) -> str:
    if inst.processes_unknown:
        return "?"  # not listed: the GPU's header line says why
    parts = [f"{p.pid}" + (f" ({p.job})" if p.job else "") for p in inst.processes]
    return cell_first_few(parts, PROCESSES_SHOWN, ", ")


def _left_alone(ctx: Context, what: str, gpus: Sequence[str]) -> int:
    """Exit 11 (partial) where ``gpus`` name GPUs left alone (``GPU N: why``), each said on
    stderr as ``gpuctl: WHAT: GPU N: why`` after the answer, so that one who reads only the
    exit code or stderr learns which and why; under ``--json`` they are the one JSON error
    document on stderr (its message: each said so, joined by ``; ``), stdout keeping the
    answer. 0 where ``gpus`` is empty."""
    if not gpus:
        return 0
    if ctx.out.json:
        raise CliError(f"{what}: {'; '.join(gpus)}", EXIT_PARTIAL)
    _say_left_alone(ctx, what, gpus)
    return EXIT_PARTIAL


def _say_left_alone(ctx: Context, what: str, gpus: Sequence[str]) -> None:
    """``gpuctl: WHAT: GPU N: why`` on stderr for each of ``gpus``, after the answer."""
    # the answer before the lines about it, on a terminal or merged; a reader of stdout
    # that went away (``| head``), or a terminal of stdout's that hung up, does not keep them
    # from stderr: the exit's own flush then fails again and exits 141 (129), as for any
    # output into a closed pipe (a closed terminal); other failures are OutputError
    with contextlib.suppress(OSError):
        ctx.out.flush()
    for gpu in gpus:
        print(f"gpuctl: {what}: {gpu}", file=sys.stderr)


def _mode_off_from_older_gpud(gpu: pb.MigGpu) -> None:
    """Read ``gpu``'s absent MIG mode as off where it was read, MIG capable and not faulty:
    a gpud from before ``mig_current`` and ``mig_pending`` were optional sends MIG off as a
    plain false, which is not on the wire, and that GPU is not unknown (null) but off."""
    if gpu.mig_capable and not gpu.fault:
        for name in ("mig_current", "mig_pending"):
            if not gpu.HasField(name):
                setattr(gpu, name, False)


def run_show(ctx: Context, args: argparse.Namespace) -> int:
    resp: pb.ShowMigResponse = ctx.call(ctx.stub(pb_grpc.MigStub).ShowMig, pb.ShowMigRequest())
    for gpu in resp.gpus:
        _mode_off_from_older_gpud(gpu)
    faulty = [
        f"GPU {gpu.index}{f' ({gpu.uuid})' if gpu.uuid else ''}: {gpu.fault}"
        for gpu in resp.gpus
        if gpu.fault
    ]
    if ctx.out.json:
        ctx.out.print_json(resp)
        return _left_alone(ctx, "faulty", faulty)
    if resp.unfinished_apply:
        ctx.out.print(f"unfinished apply: {resp.unfinished_apply}")
    for gpu in resp.gpus:
        # mig_capable is set once the GPU answered in this run: else, as `gpuctl gpus`
        # shows it, its product and UUID are what an earlier run last read
        product = last_seen(gpu.product, gpu.HasField("mig_capable"))
        name = " ".join(x for x in (product, gpu.uuid) if x)
        desired = (
            f"; desired: {gpu.desired_layout} ({gpu.desired_config})" if gpu.desired_config else ""
        )
        if gpu.fault:
            # what reconcile brings it to once it answers
            ctx.out.print(
                f"GPU {gpu.index}{' ' + name if name else ''}: faulty: {gpu.fault}{desired}"
            )
            continue
        mode = "not MIG capable"
        if gpu.mig_capable:
            mode = "MIG " + ("on" if gpu.mig_current else "off")
            if gpu.mig_pending != gpu.mig_current:
                mode += f" ({'on' if gpu.mig_pending else 'off'} pending a GPU reset)"
        # the reasons once per GPU, not per instance: a driver that does not support the
        # query answers so for each MIG device
        unknown = dict.fromkeys(i.processes_unknown for i in gpu.instances if i.processes_unknown)
        why = f"; processes unknown: {'; '.join(unknown)}" if unknown else ""
        no_mem = dict.fromkeys(i.memory_unknown for i in gpu.instances if i.memory_unknown)
        why += f"; memory unknown: {'; '.join(no_mem)}" if no_mem else ""
        # the layout less what the mode said: "MIG off", not "MIG off; MIG disabled", and
        # "MIG on; no instances", not "MIG on; MIG enabled, no instances"
        # (gpud.mig.layout.DeviceLayout.describe)
        layout = gpu.layout.removeprefix("MIG enabled, ") if gpu.mig_current else ""
        held = f"; {layout}" if layout else ""
        ctx.out.print(f"GPU {gpu.index} {name}: {mode}{held}{desired}{why}")
    rows = []
    for gpu in resp.gpus:
        for inst in gpu.instances:
            mem = NA
            if inst.HasField("memory_total_bytes"):
                used = gib(inst.memory_used_bytes) if inst.HasField("memory_used_bytes") else NA
                if inst.memory_unknown:
                    used = "?"  # not read: the GPU's header line says why
                mem = f"{used} / {gib(inst.memory_total_bytes)}"
            rows.append(
                (
                    str(gpu.index),
                    str(inst.gpu_instance_id),
                    # a GPU instance without one: no MIG device, so no UUID, memory or
                    # processes either (the GPU's line names it)
                    str(inst.compute_instance_id)
                    if inst.HasField("compute_instance_id")
                    else "none",
                    inst.compute_profile or inst.profile,
                    f"{inst.placement_start}:{inst.placement_size}",
                    f"{gpu.index}:{inst.mig}" if inst.HasField("mig") else "-",
                    inst.uuid or "-",
                    mem,
                    _processes(inst),
                )
            )
    if rows:
        ctx.out.print()
        ctx.out.print_table(INSTANCE_HEADERS, rows)
    if args.profiles:
        prow = [
            (
                str(gpu.index),
                p.name,
                str(p.free),
                ",".join(map(str, p.placement_starts)) + f":{p.placement_size}",
            )
            for gpu in resp.gpus
            for p in gpu.profiles
        ]
        ctx.out.print()
        ctx.out.print_table(PROFILE_HEADERS, prow)
    return _left_alone(ctx, "faulty", faulty)


def run_apply(ctx: Context, args: argparse.Namespace) -> int:
    request = pb.ApplyMigRequest(
        config=_source(args),
        drain=args.drain,
        force=args.force,
        dry_run=args.dry_run,
        skip_reset=args.skip_reset,
    )
    if args.drain_timeout is not None and not args.drain:
        raise CliError("--drain-timeout goes with --drain", EXIT_USAGE)
    if args.drain:
        if args.drain_timeout is not None:
            request.timeout_seconds = args.drain_timeout
        # The daemon waits up to the drain timeout (its default when not given).
        wait = args.drain_timeout if args.drain_timeout is not None else MAX_DRAIN_SECONDS
        ctx.timeout = max(ctx.timeout, wait + _CALL_MARGIN_S)
    if not args.dry_run:
        ctx.timeout = max(ctx.timeout, _APPLY_WAIT_S)
    try:
        resp: pb.ApplyMigResponse = ctx.call(ctx.stub(pb_grpc.MigStub).ApplyMig, request)
    except KeyboardInterrupt:
        if not args.dry_run:
            print(
                f"gpuctl: interrupted: an apply of {args.config} that had begun its changes"
                " goes on in gpud; see `gpuctl mig show`",
                file=sys.stderr,
            )
        raise
    except CliError as err:
        if err.deadline_s is None or not _answers(ctx):
            raise
        what, then = (
            ("dry run", " (raise --timeout)")
            if args.dry_run
            else (
                "apply",
                ": one that had begun its changes goes on in gpud, one that had not is dropped"
                " (its mig.apply event says which: result not_started); see `gpuctl mig show`",
            )
        )
        raise CliError(
            f"gpud answers, but the {what} of {args.config} did not end within"
            f" {err.deadline_s:g} s{then}",
            EXIT_FAILED,
            status=err.status,
            deadline_s=err.deadline_s,
        ) from None
    if ctx.out.json:
        ctx.out.print_json(resp)
    else:
        # a refused apply runs no step on any GPU: a dry run lists what --drain or --force
        # would run
        verb = "would" if resp.dry_run else "did"
        ran = "would be refused" if resp.result == "busy" else f"{verb} run"
        for o in resp.gpus:
            if o.steps:
                ctx.out.print(f"GPU {o.gpu}: {o.status} ({len(o.steps)} steps {ran})")
                for step in o.steps:
                    ctx.out.print(f"  {step.removeprefix(f'GPU {o.gpu}: ')}")
            else:
                ctx.out.print(f"GPU {o.gpu}: {o.status}")
            if o.detail:
                ctx.out.print(f"  {o.detail}")
        ctx.out.print(f"{resp.config_name}: {resp.result}")
    # With --json the note for people of an answer that exits 0 is left out (the document
    # says it), and one that does not is the JSON error document on stderr (CliError).
    if resp.result == "reset_pending" and not ctx.out.json:
        are, creates = ("would be", "would create") if resp.dry_run else ("are", "creates")
        print(
            f"gpuctl: MIG mode changes {are} pending a GPU reset or reboot; "
            f"gpud {creates} the instances after it",
            file=sys.stderr,
        )
    if resp.result == "busy":  # only a dry run answers so: an apply is refused with Busy
        raise CliError(
            "the apply would be refused: processes or jobs' reservations hold instances it"
            " would destroy (use --drain or --force)",
            EXIT_BUSY,
        )
    faulty = [_why_left_alone(o) for o in resp.gpus if o.status == "faulty"]
    if resp.result == "partial":
        return _left_alone(ctx, "faulty, left alone", faulty)
    if resp.result == "failed":
        # the failure decides the exit; a GPU left alone is still said, for one who reads
        # only stderr (under --json the answer's GPUs say it)
        if faulty and not ctx.out.json:
            _say_left_alone(ctx, "faulty, left alone", faulty)
        return EXIT_FAILED
    return 0


def _answers(ctx: Context) -> bool:
    """Whether gpud answers a call (its gRPC health service), after one it did not answer
    in time: then it is running, and busy with that call."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        resp = ctx.call(
            health_pb2_grpc.HealthStub(ctx.channel()).Check,
            health_pb2.HealthCheckRequest(),
            timeout=_HEALTH_WAIT_S,
        )
    except CliError as err:
        return err.deadline_s is None and err.exit_code != EXIT_NOT_RUNNING
    # a gpud that is stopping says NOT_SERVING: the apply ends with it
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


def _why_left_alone(o: pb.MigGpuOutcome) -> str:
    """``GPU N (UUID): why`` of a GPU an apply left alone as faulty, as ``mig show`` names a
    faulty GPU: its detail without the words the line already says, whether the GPU was
    found faulty before its steps (``GPU N (PRODUCT) is faulty, left alone: why``) or went
    so during them (``GPU N (PRODUCT) is faulty: why``: lost in the middle of the apply)."""
    why = o.detail
    if why.startswith((f"GPU {o.gpu} ", f"GPU {o.gpu}:")):
        for said in (" is faulty, left alone: ", " is faulty: "):
            if said in why:
                why = why.partition(said)[2]
                break
    return f"GPU {o.gpu}{f' ({o.uuid})' if o.uuid else ''}: {why}"


def run_assert(ctx: Context, args: argparse.Namespace) -> int:
    request = pb.AssertMigRequest(config=_source(args))
    resp: pb.AssertMigResponse = ctx.call(ctx.stub(pb_grpc.MigStub).AssertMig, request)
    if ctx.out.json:
        ctx.out.print_json(resp)
    else:
        if resp.matches:
            which = "the GPUs that answer match" if resp.faulty else "the GPUs match"
            ctx.out.print(f"{args.config}: {which}")
        for line in resp.differences:
            ctx.out.print(line)
        for line in resp.faulty:
            ctx.out.print(f"{line} (not checked)")
    if not resp.matches:
        # the differences decide the exit; a GPU not checked is still said, for one who
        # reads only stderr (under --json the answer's ``faulty`` says it)
        if not ctx.out.json:
            _say_left_alone(ctx, "not checked", resp.faulty)
        return EXIT_DIFFERS
    return _left_alone(ctx, "not checked", resp.faulty)


def run_export(ctx: Context, args: argparse.Namespace) -> int:
    resp: pb.ExportMigResponse = ctx.call(
        ctx.stub(pb_grpc.MigStub).ExportMig, pb.ExportMigRequest(name=args.config)
    )
    if ctx.out.json:
        ctx.out.print_json(resp)
    else:
        ctx.out.write(resp.yaml)
    return _left_alone(ctx, "not exported", resp.left_out)


def run_forget(ctx: Context, args: argparse.Namespace) -> int:
    resp: pb.ForgetMigResponse = ctx.call(
        ctx.stub(pb_grpc.MigStub).ForgetMig,
        pb.ForgetMigRequest(gpu_uuid=args.gpu_uuid, gone=args.gone),
    )
    if ctx.out.json:
        ctx.out.print_json(resp)
    else:
        ctx.out.print(
            f"forgot {resp.gpu_uuid}: its layout of {resp.config_name}"
            f" (recorded at GPU {resp.gpu}) is no longer managed"
        )
    return 0
