"""The environment a job's processes start with.

What the CUDA driver and gpud's client read::

    CUDA_VISIBLE_DEVICES=MIG-5c6e...              the reserved GPU / MIG UUIDs, in order
    CUDA_MPS_PIPE_DIRECTORY=/run/gpud/mps/MIG-5c6e.../pipe   that device's control daemon
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40          cap on the client's SMs (percent)
    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20G        per device ordinal, as CUDA numbers them: the
                                                  run's --memory, else the daemon's default
                                                  when it reserved (what it is counted at)
    CUDA_MPS_CLIENT_PRIORITY=1                    0 normal, 1 below normal
    GPUD_JOB=train-a                              how gpud attributes the processes
    GPUD_SOCKET=/run/gpud/gpud.sock               where gpud.client reports progress
    GPUD_RESERVATION=3f9c2a1b7e04                 the reservation the process runs under
    GPUD_REPORT_TOKEN=Zq3...                      the run's secret: gpud.client sends it with
                                                  the job's reports (gpud.api.access)
    GPUD_DSCP=26                                  the job's DSCP tag (traffic enforcement on)
    NCCL_IB_TC=104                                RoCE traffic class: DSCP x 4

``gpuctl run`` adds ``GPUD_RUN`` (the same reservation id) for its command alone, so that
the processes it leaves behind can be found (:mod:`gpud.jobs.leftovers`).

A CUDA client connects to one MPS control daemon, and gpud runs one per device, so the MPS
variables are set only for a job on a single device whose daemon runs. A job spread over
several GPUs runs as an ordinary (non-MPS) CUDA client there.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from gpud.jobs.placement import Reservation
from gpud.mps import protocol

JOB_VAR = "GPUD_JOB"
SOCKET_VAR = "GPUD_SOCKET"
RESERVATION_VAR = "GPUD_RESERVATION"
DSCP_VAR = "GPUD_DSCP"
REPORT_TOKEN_VAR = "GPUD_REPORT_TOKEN"


def build_env(
    reservation: Reservation,
    *,
    socket_path: Path,
    pipe_dirs: Mapping[str, Path | None],
    dscp: int | None = None,
) -> dict[str, str]:
    """The variables for ``reservation``; ``pipe_dirs`` maps a device UUID to its running
    MPS daemon's pipe directory (None or absent: no MPS there); ``dscp`` is the job's tag
    (None: traffic enforcement is off)."""
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(reservation.devices),
        JOB_VAR: reservation.job,
        SOCKET_VAR: str(socket_path),
    }
    if dscp is not None:
        env[DSCP_VAR] = str(dscp)
        env["NCCL_IB_TC"] = str(dscp << 2)
    if reservation.id:  # a preview (`gpuctl env` for a job holding nothing) has none yet
        env[RESERVATION_VAR] = reservation.id
    if reservation.report_token:
        env[REPORT_TOKEN_VAR] = reservation.report_token
    if len(reservation.devices) == 1:
        pipe = pipe_dirs.get(reservation.devices[0])
        if pipe is not None:
            env["CUDA_MPS_PIPE_DIRECTORY"] = str(pipe)
            if reservation.threads_percent is not None:
                env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(reservation.threads_percent)
            # Without a limit of its own, the default it reserved under: a client started
            # after `gpuctl mps set --memory` raised it keeps to what the run is counted at
            # (a client's limit only narrows the daemon's, so a lower default still holds).
            limit = reservation.memory_on(reservation.devices[0], lambda _: None)
            if limit is not None:
                env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = protocol.client_memory_limit_env(
                    {0: limit}
                )
            env["CUDA_MPS_CLIENT_PRIORITY"] = str(reservation.client_priority)
    return env


def without_token(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less the run's report token: what a caller who may not report for the job
    (over TCP, :mod:`gpud.api.access`) is shown."""
    return {k: v for k, v in env.items() if k != REPORT_TOKEN_VAR}
