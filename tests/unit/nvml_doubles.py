"""pynvml doubles for the days NVML refuses: the simulated node's module, with chosen calls
raising the ``NVMLError`` pynvml raises for a code (NVML_ERROR_NO_PERMISSION, ...)."""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any

from gpud.backend.sim import fakenvml


class Refusing:
    """``nv`` (a FakeNvml) whose ``calls`` raise ``NVMLError(code)``: on the GPUs in ``gpus``
    (by the handle's or the index argument's GPU), or on every call when ``gpus`` is None.
    Set ``code`` to 0 to let the calls through again."""

    def __init__(
        self, nv: Any, code: int, calls: Collection[str], gpus: Collection[int] | None = None
    ) -> None:
        self._nv = nv
        self.code = code
        self._calls = set(calls)
        self._gpus = None if gpus is None else set(gpus)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._nv, name)
        if name not in self._calls:
            return attr

        def refused(*args: Any) -> Any:
            first = args[0] if args else None
            gpu = first if isinstance(first, int) else getattr(first, "index", None)
            if self.code and (self._gpus is None or gpu in self._gpus):
                raise fakenvml.NVMLError(self.code)
            return attr(*args)

        refused.__name__ = name
        return refused


class NoNvml:
    """A module whose ``nvmlInit`` fails with ``code``, as pynvml's does on a node without
    the driver (DRIVER_NOT_LOADED), without libnvidia-ml.so.1 (LIBRARY_NOT_FOUND) or where
    gpud's user may not open /dev/nvidiactl (NO_PERMISSION)."""

    NVMLError = fakenvml.NVMLError

    def __init__(self, code: int) -> None:
        self.code = code

    def nvmlInit(self) -> None:
        raise fakenvml.NVMLError(self.code)


def answering() -> Any:
    """A module that initialises: the simulated node's (one H100), for a ``gpud
    --check-config`` that is to find nothing to say about the GPUs."""
    from gpud.backend.sim import SimNode

    return SimNode([("H100-SXM5-80GB", 1)]).nvml


class Sleeps:
    """The simulated driver's sleep for a slow call (``SimNode(sleep=...)``): each call's
    seconds recorded in ``calls``, none waited out."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


class HeldSleep:
    """The simulated driver's sleep for a slow call: each hangs until :meth:`release`, as a
    driver call that does not answer. ``entered`` and ``returned`` count the calls that went
    in and came back; ``first`` is set once one went in."""

    HANG_GUARD_S = 30.0  # only so that a caller that waits for the call fails, not hangs

    def __init__(self) -> None:
        self._released = threading.Event()
        self._lock = threading.Lock()
        self.first = threading.Event()
        self.entered = 0
        self.returned = 0

    def __call__(self, seconds: float) -> None:
        with self._lock:
            self.entered += 1
        self.first.set()
        if not self._released.wait(self.HANG_GUARD_S):
            self._released.set()  # the rest return at once: the test fails on ``returned``
        with self._lock:
            self.returned += 1

    def release(self) -> None:
        self._released.set()
