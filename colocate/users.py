"""One user per MPS server: the rule both placements keep.

An MPS control daemon starts its server as the user of its first client; a client of
another user waits in its CUDA initialisation until every client of that server has ended.
So a run of one user may not share a server that serves another
user's jobs: the jobs service refuses such a device (``gpud.jobs.placement``), the
co-location planner offers no share of such a GPU, only a free MIG instance there (a
server of its own). A run, or a holder, of no known user (None: unknown, or MPS off)
bars no one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence


def other_users(
    holders: Iterable[tuple[int | None, str]], uid: int | None
) -> dict[int, tuple[str, ...]]:
    """The users among ``holders`` ((UID, job) of the runs one MPS server serves) other
    than ``uid``, each with its jobs (sorted, each once): a run of ``uid`` may not share
    that server with them. {} for no ``uid``."""
    if uid is None:
        return {}
    jobs: dict[int, set[str]] = {}
    for u, job in holders:
        if u is not None and u != uid:
            jobs.setdefault(u, set()).add(job)
    return {u: tuple(sorted(jobs[u])) for u in sorted(jobs)}


def shared_under_mps(others: Mapping[int, Sequence[str]], name_of: Callable[[int], str]) -> str:
    """Why :func:`other_users` bars a server: "shared under MPS by jobs of user alice (a,
    b), and an MPS control daemon serves one user at a time"."""
    whose = ", ".join(f"{name_of(u)} ({', '.join(jobs)})" for u, jobs in others.items())
    return (
        f"shared under MPS by jobs of user{'s' if len(others) > 1 else ''} {whose}, and an"
        " MPS control daemon serves one user at a time"
    )
