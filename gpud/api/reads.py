"""Short reads of the state store, answered on the event loop.

A read of a few rows takes well under a millisecond; a hop to a worker thread and back
costs more than that once a dozen clients call at once (the threads queue for the GIL:
``tools/bench_api``, ``ListJobs`` at 3.3 x a bare gRPC server's p99 under 16 clients
through a thread). On the loop the read uses the store's reading connection
(:meth:`gpud.store.StateStore.reading`), so it never waits for a writer's commit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from gpud.store import StateStore

T = TypeVar("T")


def read(store: StateStore, fn: Callable[[], T]) -> T:
    """``fn()``, whose transactions on ``store`` are one read-only snapshot. ``fn`` reads
    the store and in-memory state only (nothing else that blocks)."""
    with store.reading():
        return fn()
