"""Pure LEVELLER traffic policy: progress rates, priority levels, stable DSCP tags.

The policy modules (``progress``, ``leveller``, ``tags``) import nothing of the project and
do no I/O; the daemon feeds them reports and a clock reading and applies their decisions
through the kernel adapters.

Typical tick::

    tracker.report(job_id, iteration, at)            # whenever a job reports
    assignment = leveller.update(now, tracker.rates(now))
    for job_id, level in assignment.levels.items():  # tag -> level for tc / the NIC map
        apply(tags.tag(job_id), level, assignment.shares[level])
"""

from netshaper.leveller import (
    MAX_LEVELS,
    LevelAssignment,
    Leveller,
    LevellerConfig,
    rank_levels,
)
from netshaper.progress import JobProgress, ProgressConfig, ProgressTracker
from netshaper.tags import TagAllocator, TagsExhausted, nccl_ib_tc, tos

__all__ = [
    "MAX_LEVELS",
    "JobProgress",
    "LevelAssignment",
    "Leveller",
    "LevellerConfig",
    "ProgressConfig",
    "ProgressTracker",
    "TagAllocator",
    "TagsExhausted",
    "nccl_ib_tc",
    "rank_levels",
    "tos",
]
