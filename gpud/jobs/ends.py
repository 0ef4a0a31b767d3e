"""How a run ended, as the job history keeps it: its command's exit status when its
``gpuctl run`` reported one on release, else what released its reservation instead."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class EndCause(StrEnum):
    EXITED = "exited"  # gpuctl run released it with its command's exit status
    # released with no status: an older gpuctl, another API client, or a gpuctl that left
    # the queue just as its run started
    RELEASED = "released"
    REMOVED = "removed"  # gpuctl jobs rm --force
    HOLDER_GONE = "holder-gone"  # its gpuctl run died (killed) without releasing
    # found gone at gpud's first tick: it ended while gpud was down (or could not reach it
    # to release), so the recorded end is when gpud found it, not when it ended
    GONE_AT_START = "holder-gone-at-start"
    # found at gpud's start with no reservation left: a gpud that kept no job history (an
    # earlier version, started on this state directory in between) released it, so the
    # recorded end is when gpud found it, not when it ended
    UNRECORDED = "unrecorded"


@dataclass(frozen=True, slots=True)
class RunEnd:
    cause: EndCause
    exit_code: int | None = None  # EXITED: the status it exited with
    exit_signal: int | None = None  # EXITED: the signal that killed it
    # how long before its release arrived the run ended: gpuctl run first tried to release
    # it then, and again until gpud was back from a restart (the history's end, never
    # before the run started)
    since_end_s: float = 0.0


NO_STATUS = RunEnd(EndCause.RELEASED)  # a release that says nothing of how the run ended
