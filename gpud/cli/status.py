"""``gpuctl status``: is the daemon up, on what, and how fresh is its telemetry."""

from __future__ import annotations

import argparse

from gpud.cli.context import Context, Subparsers
from gpud.cli.output import NA, seconds
from gpud.v1 import node_pb2 as pb
from gpud.v1 import node_pb2_grpc as pb_grpc


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser("status", help="daemon and node summary")
    parser.set_defaults(run=run)


def run(ctx: Context, args: argparse.Namespace) -> int:
    resp: pb.GetStatusResponse = ctx.call(
        ctx.stub(pb_grpc.NodeStub).GetStatus, pb.GetStatusRequest()
    )
    if ctx.out.json:
        ctx.out.print_json(resp)
        return 0
    age = (
        f"{seconds(resp.last_sample_age_seconds)} ago"
        if resp.HasField("last_sample_age_seconds")
        else "none yet"
    )
    if resp.HasField("last_tick_seconds"):
        age += f" (tick took {seconds(resp.last_tick_seconds)})"
    rows = [
        (
            "gpud",
            f"{resp.version} on {resp.hostname}" + (" (simulated node)" if resp.simulated else ""),
        ),
        ("backend", f"{resp.backend}, driver {resp.driver_version or NA}"),
        ("uptime", seconds(resp.uptime_seconds)),
        ("gpus", f"{resp.gpu_count} ({resp.healthy_gpu_count} healthy)"),
        ("last sample", age),
    ]
    if resp.HasField("traffic"):  # absent from an older gpud
        rows.append(("traffic", _traffic(resp.traffic)))
    if resp.HasField("config"):  # absent from an older gpud
        rows.append(("config", _config(resp.config)))
    if resp.HasField("state_files"):  # absent from an older gpud
        rows.append(("state files", _state_files(resp.state_files)))
    width = max(len(k) for k, _ in rows) + 1
    for key, value in rows:
        ctx.out.print(f"{key + ':':<{width}} {value}")
    for line in resp.unhealthy_gpus:
        gpu, _, why = line.partition(": ")
        ctx.out.print(f"{gpu} unhealthy: {why}")
    for line in _traffic_problems(resp.traffic):
        ctx.out.print(line)
    for line in _config_problems(resp.config):
        ctx.out.print(line)
    if resp.watchdog_warning:  # "" from an older gpud, and while the gap fits
        ctx.out.print(f"config: WARNING: {resp.watchdog_warning}")
    for line in _state_files_problems(resp.state_files):
        ctx.out.print(line)
    return 0


# a write under way this long is said: a hung disk fails no write, it only holds one up
HELD_UP_S = 1.0


def _held_up(files: pb.StateFilesStatus) -> list[tuple[str, str]]:
    """The state files whose write under way has run :data:`HELD_UP_S` or more: each one's
    name, and a line saying for how long and what it means."""
    held = []
    running = files.state_db_write_seconds
    if files.HasField("state_db_write_seconds") and running >= HELD_UP_S:
        held.append(
            (
                "state database",
                f"state database {files.state_db_path}: a write has run for {seconds(running)}"
                " (its disk hangs, or another process holds its lock? the change is kept"
                " once it ends)",
            )
        )
    running = files.event_log_write_seconds
    if files.HasField("event_log_write_seconds") and running >= HELD_UP_S:
        queued = files.event_log_lines_queued
        held.append(
            (
                "event log",
                f"event log {files.event_log_path}: {queued} {'line' if queued == 1 else 'lines'}"
                f" queued for {seconds(running)} (its disk hangs? the journal has them)",
            )
        )
    return held


def _state_files(files: pb.StateFilesStatus) -> str:
    """Whether the state database and the event log take gpud's writes, in a few words."""
    failing = [
        name
        for name, error in (
            ("state database", files.state_db_error),
            ("event log", files.event_log_error),
        )
        if error
    ]
    if failing:
        return f"NOT written: {' and '.join(failing)}"
    held = [name for name, _ in _held_up(files)]
    return f"no failed write; held up: {' and '.join(held)}" if held else "no failed write"


def _state_files_problems(files: pb.StateFilesStatus) -> list[str]:
    """A line for the database's latest refused change and one for the event log's failing
    writes: the file, the reason, and what it means."""
    lines = []
    if files.state_db_error:
        since = (
            f"since {seconds(files.state_db_error_age_seconds)} ago; "
            if files.HasField("state_db_error_age_seconds")
            else ""
        )
        lines.append(
            f"state database {files.state_db_path} cannot be written: {files.state_db_error}"
            f" ({since}a refused change is not kept)"
        )
    if files.event_log_error:  # the count of lines it lacks comes only with its reason
        missing = files.event_log_lines_missing
        lines.append(
            f"event log {files.event_log_path} cannot be written: {files.event_log_error}; it lacks"
            f" {missing} {'event' if missing == 1 else 'events'} since (the journal and"
            " gpuctl events have them)"
        )
    lines.extend(line for _, line in _held_up(files))
    return lines


def _config(config: pb.ConfigStatus) -> str:
    """The config file's reloads in a few words, and whether the file changed since."""
    said = _last_read(config)
    return f"{said}; the file changed since" if config.file_changed else said


def _last_read(config: pb.ConfigStatus) -> str:
    if not config.HasField("last_reload_age_seconds"):
        return "as loaded at start (no reload since)"
    when = f"{seconds(config.last_reload_age_seconds)} ago"
    if config.reload_error:
        return f"reload FAILED {when}: running the config loaded before, not the file's"
    if config.restart_needed:
        return f"reloaded {when}; some keys wait for a restart"
    if config.overridden:
        return f"reloaded {when}; flags override some of its changes"
    return f"reloaded {when}"


def _config_problems(config: pb.ConfigStatus) -> list[str]:
    """A line for a failed reload's error, one for the keys that wait for a restart, one
    for each key the file changed that a flag overrides, and one for a file changed since
    it was read."""
    lines = []
    if config.reload_error:
        lines.append(f"config reload failed: {config.reload_error}")
    if config.restart_needed:
        keys = ", ".join(config.restart_needed)
        lines.append(f"config: needs a restart to change: {keys} (running the values before)")
    for said in config.overridden:
        lines.append(f"config: {said} (running the flag's value)")
    if config.file_changed:
        lines.append(
            "config: the file changed since it was read: systemctl reload gpud to take it"
            " (gpud --check-config to check it first)"
        )
    return lines


def _traffic(traffic: pb.TrafficStatus) -> str:
    """Traffic enforcement in a few words: off, or how many interfaces are enforced."""
    if not traffic.enabled:
        return "off"
    total = len(traffic.interfaces)
    if not total:
        only = "tags only" if traffic.marking_off else "tags and marking only"
        return f"on, no interfaces (traffic.interfaces is empty): {only}"
    ok = sum(1 for i in traffic.interfaces if i.enforced)
    noun = "interface" if total == 1 else "interfaces"
    return f"on, {total} {noun} ok" if ok == total else f"on, {ok} of {total} {noun} ok"


def _traffic_problems(traffic: pb.TrafficStatus) -> list[str]:
    """A line for each interface not enforced, and for the marking and the RDMA DSCP map
    (as ``gpuctl net show`` names it) if not in force."""
    if not traffic.enabled:
        return []
    lines = []
    for i in traffic.interfaces:
        if not i.enforced:
            why = i.error.removeprefix(f"{i.name}: ") or "not yet (no traffic pass since start)"
            lines.append(f"{i.name} not enforced: {why}")
    if traffic.marking_error:
        lines.append(f"marking by cgroup (nftables) not in force: {traffic.marking_error}")
    if traffic.rdma_error:
        lines.append(f"RDMA DSCP map ({traffic.rdma_backend}) not in force: {traffic.rdma_error}")
    return lines
