"""Stable DSCP tags: one per job, kept for the job's lifetime.

Every job's packets carry its own DSCP codepoint; what changes when priorities change is
the tag -> level mapping (HTB u32 filters on the DSCP field for TCP, the NIC's
DSCP -> priority map for RDMA), never the tag itself, so a running NCCL communicator does
not have to be rebuilt.

RDMA jobs get the tag through ``NCCL_IB_TC``, the RoCE traffic-class byte: DSCP in the six
high bits, ECN in the two low bits, so ``NCCL_IB_TC = DSCP * 4`` (106 = DSCP 26 | ECN 2 is
a common hand-written value; we leave ECN to the NIC). ``ip`` / ``tc`` show the same byte
as ``tos``.

Reserved codepoints are never handed out: 0 (best effort, the default class), 46 (EF,
voice), 48 and 56 (CS6/CS7, network control), and the 8 class selectors generally, which
switch configurations tend to map to their own queues. A job's preferred tag is a CRC of
its id, so the same job gets the same tag on every node and across daemon restarts as
long as no collision pushes it further (linear probing).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping

DSCP_MAX = 63
CLASS_SELECTORS = frozenset(range(0, DSCP_MAX + 1, 8))  # CS0..CS7
DEFAULT_RESERVED = CLASS_SELECTORS | {46}  # plus EF


class TagsExhausted(Exception):
    """No free codepoint is left for ``job_id``."""

    def __init__(self, job_id: str, pool_size: int) -> None:
        super().__init__(f"{job_id}: all {pool_size} DSCP tags are in use")
        self.job_id = job_id
        self.pool_size = pool_size


def nccl_ib_tc(dscp: int) -> int:
    """The ``NCCL_IB_TC`` value (RoCE traffic class) that carries ``dscp``."""
    _check_dscp(dscp)
    return dscp << 2


def tos(dscp: int) -> int:
    """The IP TOS / traffic-class byte for ``dscp`` (ECN bits zero)."""
    return nccl_ib_tc(dscp)


def _check_dscp(dscp: int) -> None:
    if not 0 <= dscp <= DSCP_MAX:
        raise ValueError(f"DSCP must be in [0, {DSCP_MAX}], got {dscp}")


class TagAllocator:
    """Hands out one stable DSCP codepoint per job id.

    ``existing`` restores allocations persisted by a previous run (they win over the
    hash-preferred slot, so a restart changes no tag).
    """

    def __init__(
        self,
        *,
        reserved: Iterable[int] = DEFAULT_RESERVED,
        existing: Mapping[str, int] | None = None,
    ) -> None:
        reserved_set = frozenset(reserved)
        for d in reserved_set:
            _check_dscp(d)
        self._pool: tuple[int, ...] = tuple(d for d in range(DSCP_MAX + 1) if d not in reserved_set)
        if not self._pool:
            raise ValueError("every DSCP codepoint is reserved")
        self._by_job: dict[str, int] = {}
        self._by_tag: dict[int, str] = {}
        for job_id, dscp in sorted((existing or {}).items()):
            if dscp not in self._pool:
                raise ValueError(f"{job_id}: DSCP {dscp} is reserved or out of range")
            if dscp in self._by_tag:
                raise ValueError(f"{job_id}: DSCP {dscp} is already held by {self._by_tag[dscp]}")
            self._by_job[job_id] = dscp
            self._by_tag[dscp] = job_id

    @property
    def pool(self) -> tuple[int, ...]:
        """The codepoints this allocator may hand out, ascending."""
        return self._pool

    def tag(self, job_id: str) -> int:
        """The job's tag, allocating one on first use."""
        dscp = self._by_job.get(job_id)
        if dscp is not None:
            return dscp
        n = len(self._pool)
        start = zlib.crc32(job_id.encode()) % n
        for i in range(n):
            candidate = self._pool[(start + i) % n]
            if candidate not in self._by_tag:
                self._by_job[job_id] = candidate
                self._by_tag[candidate] = job_id
                return candidate
        raise TagsExhausted(job_id, n)

    def claim(self, job_id: str, dscp: int) -> bool:
        """Give ``job_id`` the tag ``dscp`` if it has none and ``dscp`` is free and in the
        pool (a tag a node already marks with, adopted by the cluster); else False."""
        if job_id in self._by_job or dscp not in self._pool or dscp in self._by_tag:
            return False
        self._by_job[job_id] = dscp
        self._by_tag[dscp] = job_id
        return True

    def release(self, job_id: str) -> None:
        """Free the job's tag (unknown ids are ignored)."""
        dscp = self._by_job.pop(job_id, None)
        if dscp is not None:
            del self._by_tag[dscp]

    def allocations(self) -> dict[str, int]:
        """job id -> DSCP, sorted by job id (what the daemon persists)."""
        return dict(sorted(self._by_job.items()))

    def owner(self, dscp: int) -> str | None:
        return self._by_tag.get(dscp)

    def get(self, job_id: str) -> int | None:
        """The job's tag, None when it holds none (nothing is allocated)."""
        return self._by_job.get(job_id)
