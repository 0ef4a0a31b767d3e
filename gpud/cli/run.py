"""``gpuctl run`` and ``gpuctl env``: launch a job with the environment gpud gives it.

::

    gpuctl run --job infer-a --kind inference --mig 3g.40gb --threads 40 --memory 20GiB -- python serve.py
    gpuctl run --job train-b --gpus 2 --memory 70GiB --no-wait -- ./train   # fail if taken
    gpuctl env --job infer-a            # export lines, for a Slurm prolog or a container hook
    gpuctl env --job infer-a --json

``run`` asks the co-location loop where a job that names no place should go (a GPU, its
MPS thread share); while the loop says wait (no GPU where sharing pays off now), ``run``
waits and asks again, saying why, unless ``--no-wait``. It registers the job if it is new, reserves its place (the reservation names this
gpuctl process, so gpud releases it even if gpuctl is killed), starts the command with
``CUDA_VISIBLE_DEVICES``, the MPS variables, ``GPUD_JOB``, ``GPUD_SOCKET`` and the run's
``GPUD_REPORT_TOKEN`` added to the
current environment, forwards SIGINT/SIGTERM/SIGHUP/SIGQUIT to it (not a Ctrl-C or Ctrl-\\
on the terminal, which reaches the command directly; one gpuctl was started ignoring,
``nohup``'s SIGHUP, stays ignored, by the command too; with ``--term-timeout``, a command
still running that many seconds after a SIGTERM passed on gets SIGKILL, said; without, it
takes as long as it needs), and when it ends stops what it
left running (SIGTERM, then SIGKILL after ``--kill-after`` seconds, or at once on a signal
since the command ended: every process whose environment carries the run's ``GPUD_RUN``),
releases the reservation, telling gpud how the
command ended (its exit status, or the signal that killed it: ``gpuctl jobs history``),
and exits with its exit status (128 + N when killed by signal N; as in a shell, 127 when
the command is not found and 126 when it is found but cannot be run: not executable, a
directory). Should gpud be away when the command ends (``systemctl restart gpud``, or
systemd starting it again after a crash), ``run`` says so once and tells it again, every
0.25 s and less often up to every 2 s, for up to RELEASE_WAIT_S (60 s) or until Ctrl-C (not
at all when ``run`` was itself sent a signal while the command ran or since: it ends then); gpud
keeps the reservation of a live ``run`` through its restart, and the history ends the run
when the first try was made. Given up, gpud releases the reservation by itself once ``run``
has exited (``holder gone when gpud started``), without the exit status; a gpud that
answered it cannot record the end (its state database cannot be written) does so at its
first loop pass that can write it again (``holder gone``), and ``run`` says what it answered.

When the devices it asks for are taken, ``run`` queues the job (unless ``--no-wait``) and
waits, printing its position and expected wait whenever they change, until gpud starts it;
then it runs as above. Ctrl-C (SIGTERM, SIGHUP, SIGQUIT) while waiting leaves the queue or the wait
for co-location (exit 130, said on one line, gpud there or not), telling gpud which signal
(its event says so, and ``gpuctl queue`` stops listing the run at once); one before the
command starts (asking gpud, reserving, held at its gate) ends the run the same way, and a
reservation made as it came is given back; ``gpuctl jobs rm --force``
of the job ends either wait with exit 4, nothing started. If gpud restarts meanwhile,
``run`` keeps waiting and finds its entry again. A request the node can never host fails at
once, saying why and which MIG layout would host it.

With traffic enforcement on, the environment also carries the job's ``GPUD_DSCP`` and
``NCCL_IB_TC``, and the command starts in the job's own cgroup v2 (``gpud-job-<name>``),
whose packets gpud marks with the job's DSCP: the command is held at a gate (a pipe) until
gpud has moved it into the cgroup, so not one of its sockets is opened outside. If gpud
cannot place it, gpuctl says why and runs it unmarked; if gpuctl dies first, the command
never runs (exit 125). Without traffic enforcement the command waits at the same gate
until gpuctl has seen its reservation still held. A ``gpuctl jobs rm --force`` of the job
before the command's exec (it SIGTERMs the process held there, or finds none yet; the
process keeps the gate's name, ``gpuctl/gate`` in ``ps``, until exec) keeps the command
from running: ``run`` says the job was removed as its command started, nothing started,
and exits 4; one after stops the command, and the run says the job was removed.

``env`` prints the environment of the job's latest reservation; for a job holding none, it
previews where the job would be placed now (no ``GPUD_RESERVATION``, a line on stderr says
so) and changes nothing: nothing is reserved, and no DSCP tag is taken (``GPUD_DSCP`` only
if the job holds one already).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import subprocess
    from types import FrameType

from gpud.cli.asking import (
    RELEASE_RETRY_MAX_S,
    RELEASE_RETRY_S,
    Stop,
    StoppedAsking,
    asked_once,
    enqueued_once,
)
from gpud.cli.context import (
    EXIT_NOT_RUNNING,
    EXIT_USAGE,
    JOB_NAME,
    CliError,
    Context,
    Subparsers,
    described,
    given,
    number,
    shown_word,
)
from gpud.cli.jobs import (
    add_placement_options,
    fill_placement,
    kind_value,
    mps_options,
    no_effect,
    owner_of,
    queued_line,
    warn_if_mps_down,
)
from gpud.cli.output import seconds
from gpud.cli.pipes import STDERR_MAY_GO
from gpud.errors import (
    ERROR_TABLE,
    ColocationOff,
    DscpPoolExhausted,
    LeftQueue,
    NotFound,
    ResourceExhausted,
)
from gpud.pdeathsig import dies_with_parent
from gpud.pidns import own_namespace
from gpud.shared import shell_exports
from gpud.v1 import colo_pb2, colo_pb2_grpc, net_pb2, net_pb2_grpc, queue_pb2, queue_pb2_grpc
from gpud.v1 import jobs_pb2 as pb
from gpud.v1 import jobs_pb2_grpc as pb_grpc

EXIT_CANNOT_EXEC = 127  # the command is not found, as from a shell
EXIT_CANNOT_RUN = 126  # found, but cannot be run: not executable, a directory
EXIT_INTERRUPTED = 130
EXIT_TAKEN = ERROR_TABLE[ResourceExhausted][1]
EXIT_NOT_FOUND = ERROR_TABLE[NotFound][1]
POLL_S = 1.0
# How long one question about a queued entry lets gpud wait for it to start or move up
# (GetEntryRequest.wait_s; at most half of --timeout): a freed device's next job is told at
# once. An older gpud answers at once: gpuctl then asks no more often than every POLL_S.
ENTRY_WAIT_S = 5.0
ADVICE_POLL_MAX_S = 4.0  # a wait for advice asks at least this often (gpud forgets at 10 s)
ADVICE_ROUNDS = 3  # advice asked for at most this many times when its GPU is taken meanwhile
QUEUE_OFF = "admission queue is off"  # gpud's message when admission.enabled = false
# The job's first process ended before it became the command: held at a gate gpuctl kept
# shut, or started after gpuctl died (as `env` and `docker run` use 125 for a failure of
# their own before the command runs)
EXIT_GATE_CLOSED = 125
# the status code name a --json error gives each of these (``code``: see CliError)
_STATUS_BY_GATE_EXIT = {
    EXIT_CANNOT_EXEC: "NOT_FOUND",
    EXIT_CANNOT_RUN: "FAILED_PRECONDITION",
    EXIT_GATE_CLOSED: "ABORTED",
}
KILL_AFTER_S = 10.0
# the shortest --term-timeout: a bound a stop request could mean (and a line can say)
TERM_TIMEOUT_MIN_S = 0.01
# How long `gpuctl run` keeps trying to tell a gpud that is away how its command ended:
# systemd starts a failed gpud again after RestartSec=2s (gpud.service), and gpud answers
# within seconds of starting; a `systemctl restart` waits for the old one to stop first.
RELEASE_WAIT_S = 60.0
# How long a stopped `gpuctl run` waits for gpud to take back its wait or reservation on
# the way out: whoever stopped it waits for it to end, and gpud drops them by itself anyway.
LEAVE_TIMEOUT_S = 2.0
# Says it is running (one byte on fd argv[2]: only then does /proc/PID/environ show the
# job's environment, which gpud checks), waits for one byte on fd argv[1], then becomes the
# command (the PID stays the same, so the cgroup gpud put it in is the command's).
# The job's first process: it asks the kernel to kill it with SIGKILL when gpuctl dies
# (PR_SET_PDEATHSIG, kept across exec), since gpud releases the reservation of a gpuctl
# that is gone and the job must not go on using what nothing reserves; then, with a gate,
# it waits until gpuctl has placed it (its cgroup); then it becomes the command.
GATE_NAME = "gpuctl/gate"
_GATE = (
    "import os,sys,ctypes,errno,signal\n"
    "a=sys.argv\n"
    # Python ignores these at start: the command gets them as a shell gives them (`yes | head`)
    "signal.signal(signal.SIGPIPE,signal.SIG_DFL)\n"
    "signal.signal(signal.SIGXFSZ,signal.SIG_DFL)\n"
    + dies_with_parent(signal.SIGKILL, "int(a[1])", EXIT_GATE_CLOSED)
    # its name until exec gives it the command's (PR_SET_NAME; a '/' no file name has)
    + f"ctypes.CDLL(None).prctl(15,b'{GATE_NAME}')\n"
    "fd,ready=int(a[2]),int(a[3])\n"
    "if fd>=0:\n"
    " os.write(ready,b'r')\n"
    " os.close(ready)\n"
    " ok=os.read(fd,1)\n"
    " os.close(fd)\n"
    f" ok or sys.exit({EXIT_GATE_CLOSED})\n"
    # a[5]: the command's name as its error shows it (shown_word, done by gpuctl); a[6:]: it
    "try:\n"
    " os.execvp(a[6],a[6:])\n"
    "except OSError as e:\n"
    f" c={EXIT_CANNOT_EXEC} if e.errno==errno.ENOENT else {EXIT_CANNOT_RUN}\n"
    " m=f'cannot run {a[5]}: {e.strerror}'\n"
    # under --json (a[4]) as gpuctl's other errors: one document (CliError.to_json)
    " if a[4]=='json':\n"
    "  import json\n"
    f"  s={_STATUS_BY_GATE_EXIT!r}[c]\n"
    "  m=json.dumps({'error':{'message':m,'code':s,'exit_code':c,'class':None}})\n"
    " else:\n"
    "  m='gpuctl: '+m\n"
    # a stderr gone (a hung-up terminal: EIO; its reader gone: EPIPE, SIGPIPE ignored for
    # it) loses the line, never the exit status; os._exit: no flush at exit to fail again
    " signal.signal(signal.SIGPIPE,signal.SIG_IGN)\n"
    " try:\n"
    "  sys.stderr.write(m+'\\n')\n"
    "  sys.stderr.flush()\n"
    " except OSError:\n"
    "  pass\n"
    " os._exit(c)\n"
)
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# the ones a terminal sends its whole foreground process group (Ctrl-C, Ctrl-\)
_FROM_THE_KEYBOARD = (signal.SIGINT, signal.SIGQUIT)


def _not_ignored() -> list[signal.Signals]:
    """Those of :data:`_FORWARDED` that gpuctl was not started ignoring: one it was
    (``nohup gpuctl run ...``: SIGHUP) stays ignored, by gpuctl and by the command, which
    inherits it."""
    return [sig for sig in _FORWARDED if signal.getsignal(sig) is not signal.SIG_IGN]


_GIVEN_COMMAND = given("the command's name")
RUN_FORM = "gpuctl run --job NAME [options] -- COMMAND [ARGS...]"


class _Command(argparse.Action):
    """The words after ``--``: the command and its arguments. None at all, or an empty (or
    blank) name, an unset variable most likely, is a usage error naming it (exit 2), as an
    empty value of an option is (:func:`gpud.cli.context.given`); an empty argument after
    it is the command's own business."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        words = [str(v) for v in values or ()]
        if words[:1] == ["--"]:
            words = words[1:]
        if not words:
            raise argparse.ArgumentError(self, f"give the command to run: {RUN_FORM}")
        try:
            _GIVEN_COMMAND(words[0])
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentError(self, str(err)) from None
        setattr(namespace, self.dest, words)


def register(subparsers: Subparsers) -> None:
    run = subparsers.add_parser(
        "run", help="run a command as a job, with its GPUs and MPS limits reserved"
    )
    run.add_argument("--job", required=True, type=JOB_NAME, metavar="NAME")
    add_placement_options(run)
    run.add_argument(
        "--no-wait",
        action="store_true",
        help="fail instead of waiting when its devices are taken or co-location says wait",
    )
    run.add_argument(
        "--kill-after",
        type=number(0, 86400),
        default=KILL_AFTER_S,
        metavar="SECONDS",
        help="once the command exits, processes it left running get SIGTERM, and SIGKILL "
        f"this many seconds later (default {KILL_AFTER_S:g})",
    )
    run.add_argument(
        "--term-timeout",
        type=described(
            number(TERM_TIMEOUT_MIN_S, 86400),
            f"a number of seconds ({TERM_TIMEOUT_MIN_S:g} <= s <= 86400)",
        ),
        default=None,
        metavar="SECONDS",
        help="a command still running this many seconds after a SIGTERM gpuctl passed on "
        f"gets SIGKILL ({TERM_TIMEOUT_MIN_S:g} to 86400; default: none, it takes as long as "
        "it needs)",
    )
    run.add_argument("command", nargs=argparse.REMAINDER, action=_Command, metavar="-- CMD ARGS...")
    run.set_defaults(run=run_run, **{STDERR_MAY_GO: True})
    env = subparsers.add_parser("env", help="print the environment of a job (export lines)")
    env.add_argument("--job", required=True, type=JOB_NAME, metavar="NAME")
    env.set_defaults(run=run_env)


def env_request(job: str, *, uid: int, pid: int, namespace: int | None) -> pb.GetJobEnvRequest:
    """``gpuctl env``'s request, sent by process ``pid`` (of PID namespace ``namespace``)
    of user ``uid``: the job's run would be held by a process of this user, so the preview
    is placed for it. Root is most often a Slurm prolog or a container hook asking for
    another user's job: its preview is for no known user, as an older gpuctl's is."""
    if uid == 0:
        return pb.GetJobEnvRequest(job=job)
    return pb.GetJobEnvRequest(job=job, holder_pid=pid, holder_pid_namespace=namespace)


def run_env(ctx: Context, args: argparse.Namespace) -> int:
    resp: pb.GetJobEnvResponse = ctx.call(
        ctx.stub(pb_grpc.JobsStub).GetJobEnv,
        env_request(args.job, uid=os.getuid(), pid=os.getpid(), namespace=own_namespace()),
    )
    preview = "GPUD_RESERVATION" not in resp.env  # gpud.jobs.env
    if preview:
        ctx.out.note(
            f"job {args.job} holds no reservation: where it would be placed now"
            " (nothing reserved, no DSCP tag taken)"
        )
    if ctx.out.json:
        ctx.out.print_json({"job": args.job, "env": dict(resp.env), "preview": preview})
    else:
        ctx.out.write(shell_exports(dict(resp.env)))
    return 0


def reserve_request(args: argparse.Namespace) -> pb.ReserveRequest:
    request = pb.ReserveRequest(
        job=args.job,
        kind=kind_value(args.kind),
        owner=owner_of(args),
        holder_pid=os.getpid(),
        # in a container, gpud numbers this process otherwise: it finds it by both
        holder_pid_namespace=own_namespace(),
        # this reservation's own: a try again after a lost answer gets the one gpud made
        request_id=str(uuid.uuid4()),
    )
    fill_placement(request, args)
    return request


def _reserve(ctx: Context) -> Any:
    return ctx.stub(pb_grpc.JobsStub).Reserve


NEVER_FITS = "never fits"  # the co-location loop's reason when waiting would not help


def advise(
    ctx: Context,
    args: argparse.Namespace,
    request: pb.ReserveRequest,
    stop: Stop,
    notes: list[str],
) -> bool:
    """Where the co-location loop would put a job that names no place (on the command line
    or when it was registered): its GPU and MPS thread share go into the request as advice
    for this run. Without advice (loop off, unreachable) or for a job that never fits, the
    jobs service places the job as it always does. When the loop says
    wait (no GPU where sharing pays off now), the job waits until it names one, unless
    ``--no-wait``: placing it anyway would share a GPU the loop just refused. False when
    Ctrl-C (or SIGTERM, SIGHUP, SIGQUIT) stopped the run (``stop``), said on stderr. Why it falls
    back to the default placement goes into ``notes``, said once the jobs service placed
    the job (or queued it), not before the refusal of a job that can never start."""
    if args.mig is not None or args.gpus is not None or args.devices is not None:
        return True
    known = _registered(ctx, args.job)
    if known is not None and (
        known.devices or known.HasField("mig_profile") or known.HasField("gpu_count")
    ):
        return True  # it runs where it was registered to, whatever the loop would say
    # whose run it is, as the reservation will say: advice keeps off GPUs whose MPS server
    # serves another user
    ask = colo_pb2.AdviseRequest(
        job=args.job,
        kind=args.kind or "training",
        holder_pid=request.holder_pid,
        reserving=True,  # it reserves the place it is given at once
    )
    if request.HasField("holder_pid_namespace"):
        ask.holder_pid_namespace = request.holder_pid_namespace
    if request.HasField("memory_limit_bytes"):
        ask.memory_bytes = request.memory_limit_bytes
    stub = ctx.stub(colo_pb2_grpc.ColocationStub)
    try:
        resp: colo_pb2.AdviseResponse = ctx.call(stub.Advise, ask)
    except CliError as err:
        if err.exit_code == EXIT_USAGE:
            raise  # a bad job name or size: the jobs service would refuse it the same way
        if err.error != ColocationOff.__name__:  # switched off: nothing worth a line
            notes.append(f"no co-location advice ({err}); default placement")
        return True
    if stop.is_set():  # a signal while it asked: nothing waits in gpud yet
        _stopped(args.job, stop.signum)
        return False
    if resp.gpu < 0 or not resp.device:
        if resp.reason.startswith(NEVER_FITS):
            notes.append(f"co-location: {resp.reason}; default placement")
            return True
        if args.no_wait:
            raise CliError(f"cannot start now: co-location: {resp.reason}", EXIT_TAKEN)
        ask.waiting = True  # listed by `gpuctl colo show` while it asks
        # its own id from the first question: another run of the job that waits too is
        # another entry (gpud keeps it, or answers another should a run hold it already)
        ask.waiter_id = secrets.token_hex(6)
        waited = _wait_for_advice(ctx, ask, resp, stop)
        if waited is None:
            return False
        if waited.gpu < 0 or not waited.device:
            return True  # the advice stopped: the jobs service places it
        resp = waited
    # For this run only: the job is not registered with the GPU it was advised today, and
    # a thread share it was registered with stays (the jobs service applies the advice
    # where neither the request nor the registered job says).
    request.advised_devices.append(resp.device)
    if resp.threads_percent < 100:
        request.advised_threads_percent = resp.threads_percent
    print(f"gpuctl: {args.job} on GPU {resp.gpu}: {resp.reason}", file=sys.stderr)
    return True


def _reserve_advised(
    ctx: Context, args: argparse.Namespace, stop: Stop, notes: list[str]
) -> pb.ReserveResponse | None:
    """Reserve what the request (and the loop's advice) names. A GPU the advice named but
    another run took in between is asked about again, up to ADVICE_ROUNDS times, so the
    job still goes where sharing pays off, unless a signal came meanwhile (``stop``); None
    when a signal stopped it while it asked for advice or waited for it. Why the advice
    was not followed is said once reserved, else left in ``notes`` (for the queue)."""
    rounds = 1
    while True:
        request = reserve_request(args)
        notes.clear()
        if not advise(ctx, args, request, stop, notes):
            return None
        try:
            # after the advice: a wait through a gpud restart has closed the channel it
            # started on, and reserve() takes its stub on the channel open then
            resp: pb.ReserveResponse = asked_once(ctx, _reserve, request, stop)
            _say(notes)
            return resp
        except CliError as err:
            if (
                err.exit_code != EXIT_TAKEN
                or err.error == DscpPoolExhausted.__name__  # no other place changes that
                or not request.advised_devices
                or rounds == ADVICE_ROUNDS
                or stop.is_set()
            ):
                raise
            rounds += 1
            print(f"gpuctl: {err}; asking co-location again", file=sys.stderr, flush=True)


def _say(notes: list[str]) -> None:
    for note in notes:
        print(f"gpuctl: {note}", file=sys.stderr, flush=True)


def _registered(ctx: Context, job: str) -> pb.Job | None:
    """``job`` as registered (``gpuctl jobs add``); None when this run registers it."""
    try:
        resp: pb.ListJobsResponse = ctx.call(
            ctx.stub(pb_grpc.JobsStub).ListJobs, pb.ListJobsRequest(name=job)
        )
    except CliError as err:
        if err.exit_code == EXIT_NOT_FOUND:
            return None
        raise
    return resp.jobs[0] if resp.jobs else None


def _wait_for_advice(
    ctx: Context, ask: colo_pb2.AdviseRequest, resp: colo_pb2.AdviseResponse, stop: Stop
) -> colo_pb2.AdviseResponse | None:
    """Ask again, every POLL_S and less often (up to ADVICE_POLL_MAX_S) while the answer
    stays the same, until the loop names a GPU (that advice), saying why it waits whenever
    the reason changes; None when a signal stopped the wait. Through a gpud
    restart it keeps asking; advice that stops (the loop turned off) ends the wait with the
    last answer, which places nothing, and the jobs service places the job. Stopped, it
    takes itself out of gpud's list at once (:func:`_leave_wait`). A job removed
    meanwhile (``gpuctl jobs rm --force``) ends it with gpud's NotFound (exit 4); a run
    taken out of its wait (``gpuctl queue --leave ID``), with exit 1, as a queued run
    taken out."""
    started = time.monotonic()
    shown = ""
    said = ""  # the id last said
    away = False
    interval = POLL_S
    while not (resp.gpu >= 0 and resp.device):
        line = f"waiting for co-location: {resp.reason}"
        if resp.waiter_id and resp.waiter_id != said:
            # its id in `gpuctl queue`, kept through a gpud restart
            ask.waiter_id = said = resp.waiter_id
            print(
                f"gpuctl: waiting as {resp.waiter_id} in gpuctl queue (gpuctl queue "
                f"--leave {resp.waiter_id} takes it out)",
                file=sys.stderr,
                flush=True,
            )
        if line != shown:
            print(f"gpuctl: {line}", file=sys.stderr, flush=True)
            shown = line
            interval = POLL_S
        else:
            # Each question is a planning pass in gpud: many runs waiting on an
            # unchanged answer ask less often.
            interval = min(ADVICE_POLL_MAX_S, interval * 1.5)
        if stop.wait(interval):
            break
        ask.waited_s = time.monotonic() - started  # its place, should gpud have restarted
        try:
            resp = ctx.call(ctx.stub(colo_pb2_grpc.ColocationStub).Advise, ask)
            away = False
        except CliError as err:
            if err.error == LeftQueue.__name__:  # `gpuctl queue --leave ID`
                raise CliError(str(err), 1, error=err.error) from None
            if err.exit_code == EXIT_NOT_FOUND:
                raise  # `gpuctl jobs rm --force` removed the job while it waited
            if err.error == ColocationOff.__name__:  # a reload turned it off meanwhile
                print(f"gpuctl: {err}: job {ask.job} stops waiting for it", file=sys.stderr)
                return resp
            if err.exit_code != EXIT_NOT_RUNNING:
                print(f"gpuctl: no co-location advice ({err}); default placement", file=sys.stderr)
                return resp
            if not away:
                _say_away(ctx, err, f"job {ask.job} is still waiting for co-location")
                away = True
            ctx.close()  # a fresh channel once gpud is back
    if not stop.is_set():
        return resp
    kept = ""
    if ask.waiter_id and not _leave_wait(ctx, ask.waiter_id, stop):
        kept = f": gpuctl queue lists {ask.waiter_id} up to 10 s more"
    print(
        f"gpuctl: job {ask.job} stopped waiting for co-location{_by(stop.signum)}, nothing started{kept}",
        file=sys.stderr,
        flush=True,
    )
    return None


def _leave_wait(ctx: Context, waiter_id: str, stop: Stop) -> bool:
    """Take this stopped run's wait for co-location out of gpud (Queue.Leave, saying the
    signal), so that `gpuctl queue` stops listing it now rather than once gpud finds it
    stopped asking (10 s); whether gpud lists it no more (NOT_FOUND: it never listed it,
    or dropped it already). A gpud that predates the field words the event as for `gpuctl
    queue --leave`."""
    request = queue_pb2.LeaveRequest(id=waiter_id, stopped_by=_stop_name(stop))
    try:
        ctx.call(ctx.stub(queue_pb2_grpc.QueueStub).Leave, request, timeout=LEAVE_TIMEOUT_S)
    except CliError as err:
        return err.exit_code == EXIT_NOT_FOUND  # else gpud is away, or has no queue
    return True


def _stop_name(stop: Stop) -> str:
    """The signal that stopped the run, as LeaveRequest.stopped_by says it ("": a Ctrl-C
    raised as KeyboardInterrupt, with no handler to say which)."""
    return _signame(stop.signum) if stop.signum is not None else ""


def _say_away(ctx: Context, err: CliError, still: str) -> None:
    """Say, once, that gpud went away while a run waits (``still``: what it waits as),
    keeping its place: a restart (which cuts the long poll in flight) keeps the wait, so
    gpuctl asks again once gpud is back, and nothing is to be checked or repeated."""
    why = "not answering" if err.deadline_s is not None else "away (stopped or restarting)"
    print(
        f"gpuctl: gpud on {ctx.socket_path} is {why}; {still}, and asks again once it is"
        " back (`systemctl status gpud`)",
        file=sys.stderr,
        flush=True,
    )


def _by(signum: int | None) -> str:
    """`` (SIGTERM)``: the signal that stopped the run, as its last line says it; nothing
    where none is known (a Ctrl-C raised as KeyboardInterrupt)."""
    return f" ({_signame(signum)})" if signum is not None else ""


def _stopped(job: str, signum: int | None) -> int:
    """Say that a signal (``signum``, where known) stopped the run before its command
    started; its exit status."""
    print(
        f"gpuctl: job {job} stopped{_by(signum)} before its command started: nothing was started",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_INTERRUPTED


def _give_back(ctx: Context, reservation: str) -> None:
    """Release a reservation whose command a signal kept from starting (made by a call
    in flight when it came)."""
    try:
        ctx.call(
            ctx.stub(pb_grpc.JobsStub).Release,
            pb.ReleaseRequest(reservation_id=reservation),
            timeout=LEAVE_TIMEOUT_S,
        )
    except CliError as err:
        if err.exit_code != EXIT_NOT_FOUND:  # NOT_FOUND: released already
            print(
                f"gpuctl: could not release reservation {reservation}: {err}; gpud releases "
                "it by itself once this gpuctl is gone (holder gone)",
                file=sys.stderr,
            )


def _setting(stop: Stop) -> Callable[[int, FrameType | None], None]:
    """A signal handler that sets ``stop``, naming the signal."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set(signum)

    return on_signal


def _hand_to(after: Stop, sigs: Iterable[int]) -> None:
    """Have each of ``sigs`` set ``after`` from now on (the command has ended, or never
    will): the caller puts the handlers back once it is done."""
    on_signal = _setting(after)
    for sig in sigs:
        signal.signal(sig, on_signal)


@contextlib.contextmanager
def _signals_stop() -> Iterator[Stop]:
    """A stop that SIGINT, SIGTERM, SIGHUP and SIGQUIT set while waiting (those gpuctl was
    not started ignoring: :func:`_not_ignored`). Raised inside a gRPC
    call, KeyboardInterrupt could leave the channel unusable for the calls that follow
    (leaving the queue, releasing)."""
    import threading  # imported here: only a waiting `gpuctl run` pays for it

    stop = Stop()
    main = threading.current_thread() is threading.main_thread()
    taken = _not_ignored() if main else []
    previous = {sig: signal.signal(sig, _setting(stop)) for sig in taken}
    stop.previous = previous
    try:
        yield stop
    except KeyboardInterrupt:
        stop.set()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop.close()


def run_run(ctx: Context, args: argparse.Namespace) -> int:
    command = list(args.command)  # without the "--" (_Command): never empty, nor its name
    # From the first call to gpud until the command runs, a signal stops the run with
    # nothing started and nothing left in gpud; _launch then forwards them to the command.
    # Once the command has ended, they set ``after`` (see _launch) until the with's end puts
    # the original handlers back.
    after = Stop()
    try:
        with _signals_stop() as stop:
            return _run(ctx, args, command, stop, after)
    finally:
        after.close()
    return EXIT_INTERRUPTED  # a Ctrl-C raised where no handler could be set (another thread)


def _run(
    ctx: Context, args: argparse.Namespace, command: list[str], stop: Stop, after: Stop
) -> int:
    try:
        notes: list[str] = []
        resp = _reserve_advised(ctx, args, stop, notes)
        if resp is None:
            return EXIT_INTERRUPTED
        reservation, devices, granted = (
            resp.reservation.id,
            list(resp.reservation.devices),
            dict(resp.env),
        )
    except StoppedAsking:
        return _stopped(args.job, stop.signum)
    except CliError as err:
        if err.exit_code != EXIT_TAKEN or args.no_wait:
            raise
        if stop.is_set():  # a signal while it asked: it joins no queue
            return _stopped(args.job, stop.signum)
        try:
            entry = wait_in_queue(ctx, reserve_request(args), stop, why=str(err), notes=notes)
        except StoppedAsking:
            return _stopped(args.job, stop.signum)
        except CliError as queue_err:
            refused = not isinstance(queue_err, TakenOut)  # by the Enqueue, not once waiting
            if refused and (
                str(queue_err).startswith("UNIMPLEMENTED") or QUEUE_OFF in str(queue_err)
            ):
                raise err from None  # a gpud without an admission queue, or with it off
            if refused and queue_err.exit_code == EXIT_TAKEN:  # the queue is full
                raise CliError(f"cannot start now: {err}; {queue_err}", EXIT_TAKEN) from None
            raise
        if entry is None:
            return EXIT_INTERRUPTED
        reservation, devices, granted = (
            entry.reservation.id,
            list(entry.reservation.devices),
            dict(entry.env),
        )
    options = mps_options(args)
    if options and "CUDA_MPS_PIPE_DIRECTORY" not in granted:
        why = (
            f"no MPS control daemon serves {', '.join(devices)} (gpud's mps.enabled is off, "
            "MPS is disabled for the device, or the job spans several devices)"
        )
        print(f"gpuctl: {no_effect(options, why)}", file=sys.stderr)
    warn_if_mps_down(ctx, granted)
    from gpud.jobs import leftovers  # stdlib only; loaded by `gpuctl run` alone

    env = {**os.environ, **granted, leftovers.RUN_VAR: reservation}
    traffic = "GPUD_DSCP" in granted
    net = ctx.stub(net_pb2_grpc.NetStub)
    namespace = own_namespace()  # the one ``pid`` is numbered in (a container's, say)

    def place(pid: int) -> None:
        """Let the command through once ``pid`` (held at the gate, its environment naming
        the run) is in the job's cgroup, with traffic on; without, once the reservation is
        seen still held. A `gpuctl jobs rm --force` from then on finds that process and
        SIGTERMs it; one since the reservation (nothing to find then) keeps the gate shut."""
        if not traffic:
            if _reservation_gone(ctx, args.job, reservation):
                raise NotStarted(removed=True)
            return
        try:
            # the response names the cgroup ("" when the daemon marks nothing by cgroup)
            ctx.call(
                net.PlaceProcess,
                net_pb2.PlaceProcessRequest(job=args.job, pid=pid, pid_namespace=namespace),
            )
        except CliError as err:
            if err.exit_code == EXIT_NOT_FOUND and _reservation_gone(ctx, args.job, reservation):
                raise NotStarted(removed=True) from err
            raise

    if stop.is_set():  # a signal since it asked: the reservation goes back, nothing ran
        _give_back(ctx, reservation)
        return _stopped(args.job, stop.signum)
    returncode: int | None = None  # None: gpuctl itself stopped before the command's end
    told: list[int] = []  # the signals gpuctl was sent while the command ran
    never: NotStarted | None = None  # set when the command never started
    try:
        returncode = _launch(
            command,
            env,
            place,
            told.append,
            stop,
            after=after,
            json_errors=ctx.out.json,
            term_timeout=args.term_timeout,
        )
        return exit_status(returncode)
    except NotStarted as err:
        never = err
        # a signal passed on is to blame only when it is the one that ended the first
        # process: another (`gpuctl jobs rm --force`'s SIGTERM, a SIGKILL) came from
        # elsewhere, whatever gpuctl was sent
        ended_by = -never.returncode if never.returncode is not None else None
        blamed = ended_by if ended_by in told else None
        # stopped by a signal (before the gate opened, or taken after it, ``blamed``): no
        # asking whether the job is gone (up to --timeout with gpud hung) before giving the
        # reservation back, which finds it gone if it is
        never.removed = never.removed or (
            not stop.is_set() and blamed is None and _reservation_gone(ctx, args.job, reservation)
        )
        return _not_started(args.job, never, stop, blamed)
    finally:
        # a signal from the command's end on (``after``) cuts these waits short
        _stop_leftovers(args.job, reservation, args.kill_after, after)
        if never is None:
            release_run(
                ctx, args.job, reservation, returncode, told[0] if told else None, after=after
            )
        elif not never.removed:  # else released with the job, the history ending it then
            _give_back(ctx, reservation)


def _reservation_gone(ctx: Context, job: str, reservation: str) -> bool:
    """Whether ``reservation`` of ``job`` is held no more: the job was removed (``gpuctl
    jobs rm --force``, which releases it), or removed and added again. False when gpud
    cannot say."""
    try:
        known = _registered(ctx, job)
    except CliError:
        return False
    return known is None or reservation not in {r.id for r in known.reservations}


def _not_started(job: str, never: NotStarted, stop: Stop, told: int | None = None) -> int:
    """Say why the command of ``job`` never ran; gpuctl's exit status. Removed as it
    started (``gpuctl jobs rm --force`` between the reservation and the command's exec,
    which SIGTERMs the gate's process, also once the gate has opened, or leaves nothing to
    place): exit 4, as a run removed while it waits; its command never ran, so not the 143
    of a command the removal stopped. Stopped by a signal meanwhile (a Ctrl-C on the
    terminal reaches the gate's process too), or by one gpuctl was sent once the gate
    opened (``told``) that ended the gate's process before its exec: exit 130, as before
    any command starts. Otherwise a :class:`CliError` (JSON under ``--json``) with the
    status of the gate's process, which ended before it became the command."""
    if never.removed:
        raise CliError(
            f"job {job} was removed (gpuctl jobs rm --force) as its command started: "
            "nothing was started",
            EXIT_NOT_FOUND,
        )
    if stop.is_set() or told is not None:
        return _stopped(job, stop.signum if stop.is_set() else told)
    code = never.returncode if never.returncode is not None else EXIT_GATE_CLOSED
    how = f"killed by {_signame(-code)}" if code < 0 else f"exit {code}"
    raise CliError(
        f"the command of job {job} did not start: its first process ended ({how}) "
        "before it became the command",
        exit_status(code),
        status=_STATUS_BY_GATE_EXIT[EXIT_GATE_CLOSED],
    )


def release_run(
    ctx: Context,
    job: str,
    reservation: str,
    returncode: int | None,
    told: int | None = None,
    *,
    after: Stop | None = None,
) -> None:
    """Release ``reservation``, telling gpud how the command ended. A gpud that is away
    (stopped, restarting) is asked again (:func:`release_retried`) while the command's exit
    status is there to tell, unless gpuctl itself was told to stop (signal ``told``, which
    it passed on to the command: whoever sent it waits for gpuctl to end, as systemd or a
    batch system's grace period does; or one since the command ended, which sets
    ``after``); failing that, gpud releases the reservation by itself once this process is
    gone, with no exit status in the history."""
    request = release_request(reservation, returncode)
    first = time.monotonic()
    try:
        try:
            released = ctx.call(ctx.stub(pb_grpc.JobsStub).Release, request)
        except CliError as err:
            if err.exit_code != EXIT_NOT_RUNNING or returncode is None:
                raise
            retried = release_retried(ctx, request, job, first, told=told, why=err, stop=after)
            if retried is None:
                return
            released = retried
        if released.removed:
            # the history keeps the exit status beside that cause; without one, only the end
            kept = (
                "how it ended"
                if returncode is not None
                else "when it ended, but not how (gpuctl saw no exit status)"
            )
            print(
                f"gpuctl: job {job} was removed (gpuctl jobs rm --force) while its "
                f"command ran; gpuctl jobs history keeps {kept}",
                file=sys.stderr,
            )
    except CliError as err:
        # released already: `gpuctl jobs rm --force` with a gpud that keeps no late end,
        # or one that had this run's end already (a release whose answer a restart lost)
        if err.exit_code == EXIT_NOT_FOUND:
            print(f"gpuctl: reservation {reservation} was released already", file=sys.stderr)
        else:  # gpud releases it by itself once this process is gone
            print(
                f"gpuctl: could not release reservation {reservation}: {err}",
                file=sys.stderr,
            )


def release_retried(
    ctx: Context,
    request: pb.ReleaseRequest,
    job: str,
    first: float,
    *,
    wait_s: float = RELEASE_WAIT_S,
    told: int | None = None,
    why: CliError | None = None,
    stop: Stop | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> pb.ReleaseResponse | None:
    """``request`` sent again while gpud is away (stopped, restarting), every
    RELEASE_RETRY_S, then less often (up to RELEASE_RETRY_MAX_S), for up to ``wait_s``
    after the first try (at ``first``, monotonic): long enough for systemd to start gpud
    again (``RestartSec=2s`` in gpud.service, then its start) or for ``systemctl restart
    gpud``. Each try says how long ago the first was (``since_end_s``): the history ends the
    run then. None when it gave up, or a signal (Ctrl-C, SIGTERM, SIGHUP, SIGQUIT) stopped
    it, or one had stopped the run already (``told``: no try again): said on stderr.
    Another error (NOT_FOUND: released already) raises. ``why``: the first try's failure; one gpud
    answered (its state database cannot be written: disk full) is said as it is, not as a
    gpud that does not answer. ``stop``: set by the signals gpuctl gets (else it sets its
    own handlers while it waits); set already, it is taken as ``told``. ``clock``: what
    ``first`` was read from, and the wait and ``since_end_s`` are measured by."""
    if told is None and stop is not None and stop.signum is not None:
        told = stop.signum
    answered = why is not None and bool(why.error)
    if answered:
        away = f"gpud on {ctx.socket_path} cannot take how job {job} ended now: {why}"
    else:
        away = f"gpud on {ctx.socket_path} is not answering"
    if told is not None:
        _not_told(
            request,
            f"{away}, and gpuctl was sent {_signame(told)}: not waiting to tell it how job"
            f" {job} ended",
            answered=answered,
        )
        return None
    signals = contextlib.nullcontext(stop) if stop is not None else _signals_stop()
    with signals as stopping:
        if not answered:
            away += " (stopped or restarting?)"
        print(
            f"gpuctl: {away}: telling it how job {job} ended ({_ending(request)}) again for"
            f" up to {wait_s:g} s (Ctrl-C stops)",
            file=sys.stderr,
            flush=True,
        )
        interval = RELEASE_RETRY_S
        while True:
            left = first + wait_s - clock()
            if left <= 0 or stopping.wait(min(interval, left)):
                break
            interval = min(RELEASE_RETRY_MAX_S, interval * 2)
            ctx.close()  # a fresh channel once gpud is back
            request.since_end_s = clock() - first
            try:
                released: pb.ReleaseResponse = ctx.call(ctx.stub(pb_grpc.JobsStub).Release, request)
            except CliError as err:
                if err.exit_code != EXIT_NOT_RUNNING:
                    raise
                why = err
                continue
            print(f"gpuctl: gpud took job {job}'s end ({_ending(request)})", file=sys.stderr)
            return released
    told_what = f"telling gpud on {ctx.socket_path} how job {job} ended ({_ending(request)})"
    answered = why is not None and bool(why.error)  # as the last try found it
    if stopping.is_set():
        what = f"stopped {told_what}"
    elif answered:
        what = f"gave up {told_what} after {seconds(clock() - first)}"
    else:
        what = f"gave up {told_what}: it did not answer for {seconds(clock() - first)}"
    if answered:
        what += f" (it said: {why})"
    _not_told(request, what, answered=answered)
    return None


def _not_told(request: pb.ReleaseRequest, what: str, *, answered: bool) -> None:
    """``what`` kept gpud from learning how the run ended, and what gpud does about it: a
    gpud that is away reaps the reservation when it is back, one that answered (its state
    database cannot be written) at its first loop pass that can write it."""
    released = f"gpud releases reservation {request.reservation_id} by itself (holder gone)"
    if answered:
        released += " at its first loop pass once it can write its state database again"
    else:
        released = f"once it is back, {released}"
    print(
        f"gpuctl: {what}: {released}, and gpuctl jobs history has no exit status for the run",
        file=sys.stderr,
        flush=True,
    )


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _ending(request: pb.ReleaseRequest) -> str:
    """How the command ended, as ``request`` tells it: ``exit 7``, ``signal 9``."""
    if request.HasField("exit_signal"):
        return f"signal {request.exit_signal}"
    return f"exit {request.exit_code}"


def exit_status(returncode: int) -> int:
    """gpuctl's exit status for a command's ``returncode`` (``-N``: killed by signal N), as a
    shell gives it: 128 + N for a signal."""
    return 128 - returncode if returncode < 0 else returncode


def release_request(reservation: str, returncode: int | None) -> pb.ReleaseRequest:
    """The release of ``reservation``, with how its command ended when known: the exit
    status apart from the signal (an ``exit 143`` is not a SIGTERM). A gpud older than
    these fields ignores them and releases all the same."""
    request = pb.ReleaseRequest(reservation_id=reservation)
    if returncode is not None and returncode < 0:
        request.exit_signal = -returncode
    elif returncode is not None:
        request.exit_code = returncode
    return request


class TakenOut(CliError):
    """gpud took a waiting run's entry out of the queue, saying why (the queue was turned
    off): said as it is, not taken for a refusal to queue."""


def wait_in_queue(
    ctx: Context,
    request: pb.ReserveRequest,
    stop: Stop,
    *,
    why: str = "",
    notes: list[str] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> queue_pb2.QueueEntry | None:
    """Queue ``request`` and poll until it starts (its entry, with reservation and env);
    None when Ctrl-C (or SIGTERM, SIGHUP, SIGQUIT: ``stop``) took it out of the queue, or
    gave back the reservation of an entry that started as the signal came. An entry taken out
    otherwise raises: exit 4 when ``gpuctl jobs rm --force`` removed the job, as a run
    waiting for co-location is told, exit 7 when gpud took it out saying why (the queue was
    turned off: as a run is refused with it off), else 1 (``gpuctl queue --leave``, its
    holder judged gone). ``why``: why it could not start at once, said once when it joins the queue,
    after ``notes`` (why co-location's advice was not followed). ``clock``: what the pace of
    the questions (POLL_S apart at least) is measured by."""
    entry = enqueued_once(ctx, request, stop)
    if not stop.is_set():  # else it leaves at once: why it was placed so matters no more
        _say(notes or [])
    if why and entry.state == queue_pb2.ENTRY_STATE_QUEUED and not stop.is_set():
        print(f"gpuctl: cannot start now: {why}", file=sys.stderr, flush=True)
    shown = ""
    away = False
    while entry.state == queue_pb2.ENTRY_STATE_QUEUED and not stop.is_set():
        line = queued_line(entry)
        if line != shown:
            print(f"gpuctl: {line}", file=sys.stderr, flush=True)
            shown = line
        asked = clock()
        try:
            answer = _ask_entry(ctx, entry.id, stop)
            away = False
            if answer is None:  # a signal stopped it
                break
            moved = answer.state != entry.state or answer.position != entry.position
            entry = answer
            # gpud answers a change at once, and an older one answers everything at once:
            # an unchanged answer is asked again no sooner than POLL_S after the last
            if not moved and stop.wait_until(asked + POLL_S, clock):
                break
        except CliError as err:
            if err.exit_code != EXIT_NOT_RUNNING:
                raise
            if not away:
                _say_away(ctx, err, f"job {entry.job} is still queued ({entry.id})")
                away = True
            ctx.close()  # a fresh channel once gpud is back
            if stop.wait_until(asked + POLL_S, clock):
                break
    if stop.is_set():
        _leave(ctx, entry, stop)
        return None
    if entry.state != queue_pb2.ENTRY_STATE_STARTED:
        if _registered(ctx, entry.job) is None:  # a queued job is registered until removed
            raise CliError(
                f"job {entry.job} was removed (gpuctl jobs rm --force) while it waited in the "
                f"queue ({entry.id}): nothing was started",
                EXIT_NOT_FOUND,
            )
        if entry.waiting_on:  # gpud took it out, and says why (the queue was turned off)
            raise TakenOut(
                f"job {entry.job} left the queue ({entry.id}): {entry.waiting_on}; nothing was"
                " started",
                EXIT_TAKEN,
            )
        raise CliError(f"job {entry.job} left the queue ({entry.id})", 1)
    print(f"gpuctl: {queued_line(entry)}", file=sys.stderr, flush=True)
    return entry


def _ask_entry(ctx: Context, entry_id: str, stop: Stop) -> queue_pb2.QueueEntry | None:
    """The queued entry, once gpud says it started, left or moved up, or after up to
    ENTRY_WAIT_S (half of --timeout at most; the call's deadline is --timeout); None when
    a signal stopped the wait (the call is cancelled, and gpud stops waiting with it)."""
    import grpc

    request = queue_pb2.GetEntryRequest(id=entry_id, wait_s=min(ENTRY_WAIT_S, ctx.timeout / 2))
    call = ctx.stub(queue_pb2_grpc.QueueStub).GetEntry.future(request, timeout=ctx.timeout)
    call.add_done_callback(lambda _: stop.wake())
    while not call.done():
        if stop.wait(ctx.timeout):
            call.cancel()
            return None
    try:
        answer: queue_pb2.QueueEntry = call.result()
    except grpc.RpcError as err:
        raise ctx.translate(err) from None
    return answer


def _leave(ctx: Context, entry: queue_pb2.QueueEntry, stop: Stop) -> None:
    """Out of the queue, saying the signal that stopped the run; a job that started
    meanwhile gives its reservation back."""
    asked = f"the withdrawal of entry {entry.id} from the queue"
    try:
        left: queue_pb2.QueueEntry = ctx.call(
            ctx.stub(queue_pb2_grpc.QueueStub).Leave,
            queue_pb2.LeaveRequest(id=entry.id, stopped_by=_stop_name(stop)),
            timeout=LEAVE_TIMEOUT_S,
        )
        if left.state == queue_pb2.ENTRY_STATE_STARTED and left.reservation.id:
            asked = f"the release of reservation {left.reservation.id} (started as it left)"
            ctx.call(
                ctx.stub(pb_grpc.JobsStub).Release,
                pb.ReleaseRequest(reservation_id=left.reservation.id),
                timeout=LEAVE_TIMEOUT_S,
            )
        print(
            f"gpuctl: job {entry.job} left the queue{_by(stop.signum)}, nothing started",
            file=sys.stderr,
        )
    except CliError as err:
        why = (
            f"gpud did not answer {asked} within {err.deadline_s:g} s"
            if err.deadline_s is not None
            else f"could not leave the queue: {err}"
        )
        print(
            f"gpuctl: {why}; gpud drops it (and any reservation) once it notices this run is gone",
            file=sys.stderr,
        )


def _stop_leftovers(
    job: str,
    run: str,
    grace_s: float,
    hurry: Stop,
    *,
    proc_root: Path = Path("/proc"),
    send: Callable[[int, int], None] = os.kill,
) -> None:
    """End what the command left running (its environment carries ``GPUD_RUN``): the
    reservation is released next, and nothing may go on using what nothing reserves. Once
    ``hurry`` is set (a signal since the command ended), SIGKILL without waiting more.
    ``proc_root``, ``send``: see :func:`gpud.jobs.leftovers.stop`."""
    from gpud.jobs import leftovers

    def reap() -> None:
        # as PID 1 (a container's init) the orphans are gpuctl's own children
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass

    # listed to be said only: saying it may block (a full pipe, a stopped terminal), and a
    # PID listed here may meanwhile be another process's, so ``stop`` lists them again
    left = leftovers.processes(run, proc_root, skip=os.getpid())
    if not left:
        return
    print(
        f"gpuctl: {len(left)} process(es) of job {job} outlived its command "
        f"(pid {', '.join(map(str, left[:8]))}{', ...' if len(left) > 8 else ''}): "
        f"SIGTERM, and SIGKILL {'at once' if hurry.is_set() else f'after {grace_s:g} s'}",
        file=sys.stderr,
    )
    _, killed = leftovers.stop(
        run,
        grace_s,
        proc_root,
        send=send,
        reap=reap if os.getpid() == 1 else None,
        hurry=hurry.is_set,
        sleep=hurry.wait,
    )
    if killed:
        print(f"gpuctl: killed {len(killed)} process(es) of job {job}", file=sys.stderr)


def _terminal_sent_it(pid: int) -> bool:
    """Whether a SIGINT or SIGQUIT gpuctl got came from its terminal (Ctrl-C, Ctrl-\\), which
    sends it to the whole foreground process group: gpuctl's, and the command's while it
    shares it. Forwarded as well, the command would see it twice (for many programs a second
    Ctrl-C is a forced stop)."""
    try:
        tty = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False  # no controlling terminal
    try:
        return os.tcgetpgrp(tty) == os.getpgrp() == os.getpgid(pid)
    except OSError:
        return False
    finally:
        os.close(tty)


class NotStarted(Exception):
    """The command of a held run never ran: ``place`` kept the gate shut (``removed``: the
    job is gone), or the gate's process ended before it was let through. ``returncode``:
    that process's, once :func:`_launch` has waited for it (125 for a gate kept shut)."""

    def __init__(self, returncode: int | None = None, *, removed: bool = False) -> None:
        super().__init__("the command never started")
        self.returncode = returncode
        self.removed = removed


def _launch(
    command: list[str],
    env: dict[str, str],
    place: Callable[[int], None] | None = None,
    told: Callable[[int], None] | None = None,
    stop: Stop | None = None,
    *,
    after: Stop | None = None,
    json_errors: bool = False,
    popen: Callable[..., subprocess.Popen[bytes]] | None = None,
    term_timeout: float | None = None,
) -> int:
    """Run ``command`` as a process that the kernel kills when gpuctl dies (see _GATE);
    with ``place``, hold it at the gate, call ``place(pid)``, then let it run (it runs
    even when placing fails, with a warning, unless ``place`` raises :class:`NotStarted`,
    which keeps the gate shut; NotStarted too when the gate's process ended before the gate
    opened, as the SIGTERM of ``gpuctl jobs rm --force`` ends it). ``told`` hears each
    signal gpuctl gets meanwhile (SIGINT, SIGTERM, SIGHUP, SIGQUIT); ``stop``'s handlers
    take them until the command has started (one they took while it was held keeps the gate
    shut: NotStarted; one as the gate opened is forwarded once it has), and the handlers they
    replaced are put back at its end, or, with ``after``, those that set it (each signal
    once the command has ended: the caller puts the handlers back when it is done). Its
    return code: the exit status, or -N when signal N killed it (:func:`exit_status` makes
    gpuctl's of it). A command that cannot
    be run is said on stderr as a ``gpuctl:`` line, or with ``json_errors`` as the JSON
    document of gpuctl's errors; one that cannot even be started (no fork: EAGAIN, ENOMEM)
    exits 127 as well, the signals then going to ``after`` at once, unless ``stop`` took
    one before the fork failed: that signal stopped the run (NotStarted). ``popen``: what
    starts it (``subprocess.Popen``). ``term_timeout``: a command still running this many
    seconds after a SIGTERM was passed on to it gets SIGKILL, said on stderr, and ``after``
    is set, so that what it left gets SIGKILL without a grace of its own (None: never; it
    handles the SIGTERM for as long as it takes, whoever stopped gpuctl waiting for it)."""
    # imported here: only `gpuctl run` pays for them
    import subprocess
    import threading

    # Signal handlers can only be set from the main thread (gpuctl's own); elsewhere
    # (embedded use) the child shares the terminal's process group anyway.
    main = threading.current_thread() is threading.main_thread()
    # those ``stop`` took (the same, unless not in the main thread), else all not ignored
    taken = list(stop.previous) if stop is not None else _not_ignored() if main else []

    gate_r = gate_w = ready_r = ready_w = -1
    if place is not None:
        gate_r, gate_w = os.pipe()
        ready_r, ready_w = os.pipe()
    # the first process is the gate; a command it cannot run is said there, exiting 127 or 126
    # with the name its error shows: escaped and clipped, so that the error stays one line
    gate = (
        str(os.getpid()),
        str(gate_r),
        str(ready_w),
        "json" if json_errors else "text",
        shown_word(command[0]),
    )
    argv = [sys.executable, "-I", "-S", "-c", _GATE, *gate, *command]
    try:
        child = (popen or subprocess.Popen)(
            argv, env=env, pass_fds=(gate_r, ready_w) if place is not None else ()
        )
    except OSError as err:
        for fd in (gate_w, ready_r):
            if fd >= 0:
                os.close(fd)
        if after is not None:  # nothing to wait for: ``after`` takes them, as at an end
            _hand_to(after, taken)
        if stop is not None and stop.is_set():
            # the signal came first: the run stopped by it before its command started (exit
            # 130, as a signal while it is held), not a command that could not be run (127)
            if after is not None:
                after.set(stop.signum)
            raise NotStarted() from None
        said = CliError(f"cannot run {shown_word(command[0])}: {err.strerror}", EXIT_CANNOT_EXEC)
        said.status = _STATUS_BY_GATE_EXIT[EXIT_CANNOT_EXEC]
        print(json.dumps(said.to_json()) if json_errors else f"gpuctl: {said}", file=sys.stderr)
        return EXIT_CANNOT_EXEC
    finally:
        for fd in (gate_r, ready_w):
            if fd >= 0:
                os.close(fd)
    if place is not None:
        try:
            os.read(ready_r, 1)  # empty when the gate died: placing then fails, harmlessly
            os.close(ready_r)
            place(child.pid)
        except CliError as err:
            print(f"gpuctl: the job's traffic is not marked by cgroup: {err}", file=sys.stderr)
        except BaseException as err:
            os.close(gate_w)  # shut: the gate reads end of file and exits 125, nothing runs
            if isinstance(err, NotStarted):
                err.returncode = child.wait()
            raise
        if stop is not None and stop.is_set():
            # a signal while it was held (Popen, the ready read, placing): the run stops
            # with nothing started, as one before its reservation does
            os.close(gate_w)  # shut: the gate reads end of file and exits 125
            raise NotStarted(child.wait())
        try:
            os.write(gate_w, b"g")
        except BrokenPipeError:
            # the gate's process ended first (`gpuctl jobs rm --force` SIGTERMs it)
            raise NotStarted(child.wait()) from None
        finally:
            os.close(gate_w)

    ended = False  # the command ended: its PID, not reaped yet, is still its own
    # SIGKILL for a command that outlives a SIGTERM passed on by term_timeout: a stop
    # request (systemd's, a batch system's) with a bound of its own
    killer: threading.Timer | None = None
    # held from the timer's check to its kill and its line, and by the main thread from the
    # command's end to its reaping: never a kill of a PID reused since, nor a line after the
    # release's
    reaping = threading.Lock()

    def kill_if_running() -> None:
        with reaping:
            if ended:
                return
            try:
                # an exit the main thread has not taken yet: nothing to kill, nothing to say
                if os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
                    return
                os.kill(child.pid, signal.SIGKILL)
            except (ChildProcessError, ProcessLookupError):
                return
            if after is not None:  # spent the patience of whoever stopped gpuctl
                after.set(signal.SIGTERM)
            with contextlib.suppress(OSError):  # a stderr gone loses the line, not the kill
                print(
                    f"gpuctl: the command (pid {child.pid}) did not end "
                    f"{seconds(term_timeout or 0)} after SIGTERM: SIGKILL (--term-timeout)",
                    file=sys.stderr,
                    flush=True,
                )

    def pass_on(signum: int) -> None:
        nonlocal killer
        # os.kill, not Popen.send_signal: that reaps a command the same signal just ended
        # (a process group's SIGTERM, a terminal's SIGHUP), and the wait below then finds
        # no child
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signum)
        if signum == signal.SIGTERM and term_timeout is not None and killer is None:
            killer = threading.Timer(term_timeout, kill_if_running)
            killer.daemon = True
            killer.start()

    def forward(signum: int, frame: FrameType | None) -> None:
        if ended:
            if after is not None:
                after.set(signum)
            return
        if told is not None:
            told(signum)
        if signum in _FROM_THE_KEYBOARD and _terminal_sent_it(child.pid):
            return  # Ctrl-C, Ctrl-\: the terminal sent it to the command as well
        pass_on(signum)

    previous = {sig: signal.signal(sig, forward) for sig in taken}
    if stop is not None:
        previous = {sig: stop.previous.get(sig, handler) for sig, handler in previous.items()}
        if stop.signum is not None:  # sent as it started the command: the command has it
            if told is not None:
                told(stop.signum)
            pass_on(stop.signum)
    held = False  # whether it ended as the gate, never the command
    try:
        # waited for, not reaped: a process killed after the gate opened (the SIGTERM of
        # `gpuctl jobs rm --force`) may have died before it became the command
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        with reaping:
            ended = True
        held = place is not None and still_the_gate(child.pid)
        code = child.wait()
    finally:
        if killer is not None:
            killer.cancel()
            killer.join()  # one that fired has said so before anything after the end
        if after is None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        else:
            # ``after`` takes them from here: a signal once the command has ended (the
            # shell's SIGHUP after the terminal's, a second SIGTERM) must not kill gpuctl
            # before it has stopped what the command left and released the reservation
            _hand_to(after, previous)
    if held and code < 0:
        raise NotStarted(code)
    return code


def still_the_gate(pid: int, proc_root: Path = Path("/proc")) -> bool:
    """Whether process ``pid`` (a child not reaped yet) never became the command: it still
    bears the gate's name (``/proc/PID/comm``), which exec replaces by the command's. False
    when that cannot be read (no /proc): taken for a command that ran."""
    try:
        return (proc_root / str(pid) / "comm").read_text().rstrip("\n") == GATE_NAME
    except OSError:
        return False
