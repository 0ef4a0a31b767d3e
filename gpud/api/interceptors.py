"""Server interceptors: every gRPC method of every service gets the same error handling.

:class:`ErrorMappingInterceptor` wraps each handler so that

- a :class:`gpud.errors.GpudError` ends the call with the status ``classify()`` gives, its
  message as details, and trailing metadata ``gpud-error`` (the class name) and
  ``gpud-exit-code`` (what gpuctl exits with), so a client can tell a daemon-side
  ``UNAVAILABLE`` (a lost GPU) from a daemon it cannot reach; a ``NotLeader`` adds
  ``gpud-leader`` and ``gpud-leader-address`` (the leader the refusing node knows of);
- a request whose bytes do not decode ends with ``INVALID_ARGUMENT`` (field ``request``),
  and so does one with a string or repeated field over its bound
  (:func:`gpud.api.validate.request_bounds`), before the servicer runs;
- any other exception is logged with its traceback and ends the call with ``INTERNAL``;
  the daemon keeps serving;
- a call that changes the node (:func:`gpud.api.gate.call_kind`: a reservation, a queue
  entry, a job added, MPS limits, a pin, a fault, ...) whose caller goes away once its
  change began on a worker thread (its deadline passed, ``gpuctl`` cut off) runs to its end
  all the same, within the stop's drain: its change, the event that says so and the gate's
  count of it whole, only its answer unsent. gRPC cancels a handler at its next ``await``,
  which left the change made by the worker thread without its event (a simulated fault
  injected, no ``sim.fault`` line) and no longer counted by the gate a stop drains. One
  none of which ran yet, its one change still waiting for a free worker of the loop's pool
  (:class:`gpud.threads.StartTellingExecutor`, :class:`gpud.threads.WorkStart`), is dropped
  instead ("METHOD (its caller gone): dropped while queued for a worker: not made (gpu=1)"):
  its caller was told it failed, so it is never made. Once the stop gives up on the drain
  (:meth:`gpud.api.gate.CallGate.cut_held`), or the server's grace ends, what still runs of
  it is cancelled at its next ``await`` ("METHOD (its caller gone): cut at the stop
  (gpu=1)"; "METHOD: cut at the stop (...)" for a call whose caller still waited), and its
  worker threads are waited for, within that wait, before the event log, the store and the
  driver close. ``ApplyMig`` is not so held: it
  asks itself whether its caller still wants it between steps (its plan is kept for the
  next start).

Services registered on :class:`gpud.api.server.ApiServer` get this for free: they raise
``InvalidArgument(..., field=...)``, ``NotFound``, ... and never call ``context.abort``
themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from gpud.api import validate
from gpud.api.access import Guard
from gpud.api.gate import APPLY_MIG, CallGate, call_kind
from gpud.errors import (
    ERROR_KEY,
    EXIT_CODE_KEY,
    LEADER_ADDRESS_KEY,
    LEADER_KEY,
    GpudError,
    InvalidArgument,
    NotLeader,
    classify,
)
from gpud.threads import WORK_START, WorkStart

log = logging.getLogger(__name__)

_MAX_DETAIL = 2000  # keep status details (and the HTTP/2 trailer) small

Behavior = Callable[[Any, Any], Any]


class _Undecodable:
    """Stands in for a request whose bytes are not a valid message, so the call ends with
    INVALID_ARGUMENT instead of gRPC's own UNKNOWN and an error log per garbage request."""

    def __init__(self, err: Exception) -> None:
        self.err = err


def _safe_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as err:
            return _Undecodable(err)

    return decode


def _check_decoded(request: Any) -> None:
    if isinstance(request, _Undecodable):
        raise InvalidArgument(f"cannot decode the request: {request.err}", field="request")
    validate.request_bounds(request)


ONCE_KEEP = 256  # refusals _Once remembers: past them, the least recently refused leave
ONCE_SUMMARY_S = 60.0  # a method past them: one line at most this often for its unseen ones


class _Held:
    """A method whose remembered refusals were dropped: the unseen ones not logged since."""

    __slots__ = ("count", "since", "what")

    def __init__(self, since: float, what: str) -> None:
        self.count = 0
        self.since = since
        self.what = what


class _Once:
    """Which refusals were logged: each (method, message) once until the method succeeds
    again, for servers whose callers retry every tick (the cluster peer API). The messages
    name jobs and GPUs, so a method that keeps failing would add a pair per job it names:
    at most ``keep`` are remembered, the one refused longest ago forgotten first. A method
    that has had a pair forgotten since it last succeeded logs its further unseen refusals
    no more each but as one line at most every ``summary_s`` seconds of ``clock`` ("N more
    refusals of METHOD not logged since ..."): callers cycling through more pairs than are
    remembered would otherwise have each logged every time it comes back."""

    def __init__(
        self,
        keep: int = ONCE_KEEP,
        *,
        clock: Callable[[], float] = time.monotonic,
        summary_s: float = ONCE_SUMMARY_S,
    ) -> None:
        self._keep = keep
        self._clock = clock
        self._summary_s = summary_s
        # an ordered set: the refusal seen longest ago first
        self._logged: dict[tuple[str, str], None] = {}
        self._per_method: dict[str, int] = {}  # pairs remembered, by method
        self._held: dict[str, _Held] = {}  # the methods that had pairs forgotten

    def first(self, method: str, message: str) -> bool:
        """Whether to log this refusal itself (a summary line, when due, is logged here)."""
        key = (method, message)
        if key in self._logged:
            # refused again: the last to be forgotten, so a steady retry stays quiet
            del self._logged[key]
            self._logged[key] = None
            return False
        # looked up first: the refusal that makes the method forget its own is still logged
        held = self._held.get(method)
        self._logged[key] = None
        self._per_method[method] = self._per_method.get(method, 0) + 1
        if len(self._logged) > self._keep:
            self._forget(next(iter(self._logged)))
        if held is None:
            return True
        held.count += 1
        now = self._clock()
        if now - held.since >= self._summary_s:
            self._say(method, held, now)
            held.since, held.what = now, "the last such line"
        return False

    def _forget(self, key: tuple[str, str]) -> None:
        del self._logged[key]
        method = key[0]
        left = self._per_method[method] - 1
        if left:
            self._per_method[method] = left
        else:
            del self._per_method[method]
        if method not in self._held:
            what = f"its refusals outgrew the {self._keep} remembered"
            self._held[method] = _Held(self._clock(), what)

    def _say(self, method: str, held: _Held, now: float) -> None:
        log.info(
            "%d more refusals of %s not logged since %s, %.0f s ago",
            held.count,
            method,
            held.what,
            now - held.since,
        )
        held.count = 0

    def succeeded(self, method: str) -> None:
        held = self._held.pop(method, None)
        if held is not None and held.count:
            self._say(method, held, self._clock())
        if method in self._per_method:
            del self._per_method[method]
            self._logged = {k: None for k in self._logged if k[0] != method}

    def __len__(self) -> int:
        """The refusals remembered."""
        return len(self._logged)


async def _abort_for(
    err: BaseException, method: str, context: Any, once: _Once | None = None
) -> None:
    """End the call with the status that ``err`` maps to. Always raises (``AbortError``)."""
    metadata: tuple[tuple[str, str], ...]
    if isinstance(err, GpudError):
        code_name, exit_code = classify(err)
        if once is None or once.first(method, str(err)):
            log.info("%s: %s: %s", method, type(err).__name__, err)
        details = str(err) or type(err).__name__
        metadata = ((ERROR_KEY, type(err).__name__), (EXIT_CODE_KEY, str(exit_code)))
        if isinstance(err, NotLeader) and err.leader:
            hint = ((LEADER_KEY, err.leader), (LEADER_ADDRESS_KEY, err.address))
            # metadata values are printable ASCII (a node name is a DNS name; the address
            # host:port): anything else would fail the abort itself
            if all(v.isascii() and v.isprintable() for _, v in hint):
                metadata += hint
    else:
        code_name = "INTERNAL"
        log.error("%s: unexpected error", method, exc_info=err)
        details = f"internal error in {method}: {type(err).__name__}: {err}"
        metadata = ((ERROR_KEY, type(err).__name__),)
    _drop_frames(err)
    await context.abort(grpc.StatusCode[code_name], details[:_MAX_DETAIL], metadata)


def _drop_frames(err: BaseException) -> None:
    """The locals of the finished frames in the tracebacks of ``err`` and of the exceptions
    it chains or groups, logged by now; the tracebacks themselves stay whole.

    The ``AbortError`` that ends the call and gRPC's per-call state refer to each other, a
    cycle only the cyclic GC frees, and ``err`` becomes the AbortError's ``__context__``.
    Its traceback's frames hold the servicer's locals, the request among them: the C memory
    of a decoded request (protobuf's arena, up to the peer port's 16 MiB) is not counted by
    the GC's thresholds, and stayed until a full collection, thousands of calls later.

    ``err`` need not be this call's alone: calls sharing one read (``GetEntry``'s waiters)
    are each raised the same exception, and a later one logs it still. So no traceback is
    cut, which would leave that one without where its error came from; a frame cleared
    keeps its code and line, all that a logged traceback shows. A frame still running (the
    handler's own, which drops the request itself) or suspended (a task that caught the
    error, handed it on and went on) is left as it is: only one that ended is cleared."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [err]
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            if _finished(tb.tb_frame):
                with contextlib.suppress(RuntimeError):  # still executing, by another reading
                    tb.tb_frame.clear()
            tb = tb.tb_next
        pending += (exc.__context__, exc.__cause__)
        if isinstance(exc, BaseExceptionGroup):
            pending += exc.exceptions


def _finished(frame: types.FrameType) -> bool:
    """Whether ``frame`` ended (returned or raised), so that clearing its locals ends nothing.

    ``frame.clear()`` (and ``traceback.clear_frames``) on the frame of a suspended coroutine
    or generator closes it, throwing ``GeneratorExit`` into it: a loop task that handed its
    error to waiters and went on would die at the first refusal of one of them. Only a frame
    that ended owns its locals, and only then does the cyclic GC see them through it (so on
    CPython 3.11 and 3.12, where this matters; from 3.13 clearing a suspended frame raises
    RuntimeError, which the caller takes as "leave it")."""
    return frame.f_code in gc.get_referents(frame)


def _runs_whole(method: str, request: Any) -> bool:
    """Whether the call is run to its end when its caller goes away (the module docstring)."""
    return method != APPLY_MIG and call_kind(method, request) is not None


# the request fields a "cut at the stop" line names the call by (a nested message, AddJob's
# job or Enqueue's request, by its own)
_NAMED_BY = ("gpu", "gpu_uuid", "device", "job", "name", "reservation_id", "id", "pid", "request")


# how long a named value gets in those lines: a caller's string is theirs to make long
_NAMED_MAX = 64


def _shown(value: Any) -> str:
    """``value`` as a log line shows it: as it is if plain and short, else quoted with its
    line breaks and other unprintables escaped (never a second, forged line), clipped."""
    text = str(value)
    if len(text) <= _NAMED_MAX and text.isascii() and text.isprintable() and " " not in text:
        return text
    # clipped before it is escaped, so that no escape is cut in two; "..." keeps the line
    # plain ASCII
    shown = ascii(text)
    if len(shown) <= _NAMED_MAX:
        return shown
    clipped = text[: _NAMED_MAX - len("''...")]
    while len(ascii(clipped)) > _NAMED_MAX - len("..."):
        clipped = clipped[:-1]
    return ascii(clipped) + "..."


def _named(request: Any) -> str:
    """``gpu=1 job=train``: what the request names, for the log lines of a call held on."""
    fields = getattr(getattr(request, "DESCRIPTOR", None), "fields_by_name", {})
    parts: list[str] = []
    for name in _NAMED_BY:
        if name not in fields:
            continue
        value = getattr(request, name)
        if hasattr(value, "DESCRIPTOR"):
            parts.append(_named(value))
        elif value or (name == "gpu" and isinstance(value, int)):
            parts.append(f"{name}={_shown(value)}")
    return " ".join(part for part in parts if part)


async def _to_its_end(
    work: Awaitable[Any], method: str, gate: CallGate | None, request: Any = None
) -> Any:
    """``work``'s result; should the call be cancelled meanwhile, ``work`` still runs to its
    end (its error logged as a refusal would be), then the cancellation goes on, unless:

    - none of it ran yet (its one change queued behind busy workers, :class:`WorkStart`): it
      is dropped and never runs, as its caller was told it failed;
    - the stop gives up on it (``gate``'s :meth:`CallGate.cut_held`) or cancels the call again
      (the server's grace ended): it is cancelled at its next ``await``, "cut at the stop".
    """
    start = WorkStart()

    def named() -> str:  # only for the lines below: most calls end without one
        what = _named(request)
        return f" ({what})" if what else ""

    async def run() -> Any:
        WORK_START.set(start)  # this task's own context: its to_thread calls carry it
        start.own()
        # runs once this first step reached its first await, before its next step
        asyncio.get_running_loop().call_soon(start.first_step_over)
        return await work

    task = asyncio.ensure_future(run())
    if gate is not None:
        gate.hold(task, start.threads)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if task.done():
            if task.cancelled():
                log.warning("%s: cut at the stop%s", method, named())
            raise
        if start.drop():
            task.cancel()  # nothing of its change began: none of it is made
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({task})
            log.info(
                "%s (its caller gone): dropped while queued for a worker: not made%s",
                method,
                named(),
            )
            raise
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()  # cancelled again: the server's grace ended
        if task.cancelled() or not task.done():
            log.warning("%s (its caller gone): cut at the stop%s", method, named())
            raise
        err = task.exception()
        if isinstance(err, GpudError):
            log.info("%s (its caller gone): %s: %s", method, type(err).__name__, err)
        elif err is not None:
            log.error("%s (its caller gone): unexpected error", method, exc_info=err)
        raise


def _wrap_unary_response(
    behavior: Behavior,
    method: str,
    once: _Once | None,
    allowed: Guard | None,
    gate: CallGate | None = None,
) -> Behavior:
    async def handler(request: Any, context: Any) -> Any:
        try:
            if allowed is not None:
                allowed(method, context.peer())
            _check_decoded(request)
            with gate.call(method, request) if gate is not None else contextlib.nullcontext():
                result = behavior(request, context)
                if inspect.isawaitable(result):
                    whole = _runs_whole(method, request)
                    result = await (_to_its_end(result, method, gate, request) if whole else result)
        except grpc.aio.AbortError:
            raise  # the servicer ended the call itself
        except Exception as err:
            # this frame is in the AbortError's traceback (_drop_frames says why that waits
            # for the cyclic GC): it lets go of the request first
            request = result = None
            await _abort_for(err, method, context, once)
            raise  # not reached: abort raises
        if once is not None:
            once.succeeded(method)
        return result

    return handler


def _wrap_stream_response(
    behavior: Behavior,
    method: str,
    once: _Once | None,
    allowed: Guard | None,
    gate: CallGate | None = None,  # every streaming method is a read
) -> Behavior:
    async def handler(request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            if allowed is not None:
                allowed(method, context.peer())
            _check_decoded(request)
            result = behavior(request, context)
            if inspect.isasyncgen(result):
                async for item in result:
                    yield item
            elif inspect.isawaitable(result):
                # a coroutine that writes with context.write (grpc_health's Watch does)
                await result
            else:
                for item in result or ():
                    yield item
        except grpc.aio.AbortError:
            raise
        except Exception as err:
            request = result = item = None  # as the unary handler's
            await _abort_for(err, method, context, once)

    return handler


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Maps exceptions raised by any servicer to gRPC statuses (see the module docstring).

    Each refusal (a GpudError) is logged at INFO; with ``log_repeats=False``, each
    distinct one once per method until that method succeeds again (for callers that
    retry every tick and would repeat it every tick), of the last :data:`ONCE_KEEP`
    remembered: a method that has had one of its own forgotten since it last succeeded
    logs its further new refusals as one line a minute at most, "N more refusals of
    METHOD not logged since ...", and that count at its next success. ``allowed`` checks each call first
    (its method and ``context.peer()``, :func:`gpud.api.access.guard`), raising to refuse
    it). ``gate`` counts the calls that change the node and refuses them once gpud is
    stopping (:mod:`gpud.api.gate`)."""

    def __init__(
        self,
        *,
        log_repeats: bool = True,
        allowed: Guard | None = None,
        gate: CallGate | None = None,
    ) -> None:
        self._once = None if log_repeats else _Once()
        self._allowed = allowed
        self._gate = gate

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        handler_call_details: Any,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: gRPC answers UNIMPLEMENTED
        method: str = handler_call_details.method
        kinds = (
            ("unary_unary", grpc.unary_unary_rpc_method_handler, _wrap_unary_response),
            ("stream_unary", grpc.stream_unary_rpc_method_handler, _wrap_unary_response),
            ("unary_stream", grpc.unary_stream_rpc_method_handler, _wrap_stream_response),
            ("stream_stream", grpc.stream_stream_rpc_method_handler, _wrap_stream_response),
        )
        for attr, make, wrap in kinds:
            behavior = getattr(handler, attr)
            if behavior is not None:
                return make(
                    wrap(behavior, method, self._once, self._allowed, self._gate),
                    # unary requests only: a streaming request iterator decodes lazily, and
                    # gRPC's own handling (UNKNOWN) stands for a corrupt message there
                    request_deserializer=(
                        _safe_deserializer(handler.request_deserializer)
                        if attr.startswith("unary")
                        else handler.request_deserializer
                    ),
                    response_serializer=handler.response_serializer,
                )
        return handler
