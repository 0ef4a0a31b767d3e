"""Pure translation from telemetry values to ``gpud.v1`` messages (no I/O, no clock).

A reading that is ``None`` in the snapshot (not supported, or not read) stays absent in the
message: ``optional`` scalars are left unset and sub-messages are not created.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from google.protobuf import struct_pb2

from gpud.backend.port import MemoryInfo, ProcessInfo
from gpud.events import Event
from gpud.telemetry.snapshot import GpuSample, MigSample
from gpud.v1 import node_pb2 as pb


def memory(value: MemoryInfo, out: pb.Memory) -> None:
    out.total_bytes = value.total_bytes
    out.used_bytes = value.used_bytes
    out.free_bytes = value.free_bytes


def processes(values: Iterable[ProcessInfo]) -> list[pb.Process]:
    out = []
    for p in values:
        msg = pb.Process(pid=p.pid)
        if p.used_memory_bytes is not None:
            msg.used_memory_bytes = p.used_memory_bytes
        if p.gpu_instance_id is not None:
            msg.gpu_instance_id = p.gpu_instance_id
        if p.compute_instance_id is not None:
            msg.compute_instance_id = p.compute_instance_id
        out.append(msg)
    return out


def mig_device(sample: MigSample) -> pb.MigDevice:
    ident = sample.identity
    msg = pb.MigDevice(
        gpu=ident.gpu,
        mig=ident.mig,
        uuid=ident.uuid,
        gpu_instance_id=ident.gpu_instance_id,
        compute_instance_id=ident.compute_instance_id,
        gpu_instance_profile_id=ident.gpu_instance_profile_id,
        profile_name=ident.profile_name,
        memory_total_bytes=ident.memory_total_bytes,
        multiprocessor_count=ident.multiprocessor_count,
        processes=processes(sample.processes),
    )
    if sample.memory is not None:
        memory(sample.memory, msg.memory)
    msg.memory_unknown = sample.memory_error
    if not sample.processes_read:
        msg.processes_unknown = sample.processes_error or "the device could not be read"
    return msg


def gpu(sample: GpuSample, *, now_monotonic: float) -> pb.Gpu:
    """One GPU; ``now_monotonic`` (same clock as ``sampled_at``) gives its sample's age."""
    ident = sample.identity
    known = sample.known()
    msg = pb.Gpu(
        index=ident.index,
        healthy=sample.healthy,
        reason=sample.reason,
        sample_age_seconds=max(0.0, now_monotonic - sample.sampled_at),
        processes=processes(sample.processes),
        mig_devices=[mig_device(m) for m in sample.mig_devices],
        xid_events_total=sample.xid_events_total,
    )
    # unset, not "", where never known: --json shows null, as for a reading not known
    for field, value in (
        ("uuid", known.uuid),
        ("name", known.name),
        ("product", known.product),
        ("pci_bus_id", known.pci_bus_id),
    ):
        if value:
            setattr(msg, field, value)
    # a GPU never read has only placeholder zeros: unset, not a device of 0 bytes without MIG
    if ident.read:
        msg.pci_device_id = ident.pci_device_id
        msg.memory_total_bytes = ident.memory_total_bytes
        msg.mig_capable = ident.mig_capable
    if sample.memory is not None:
        memory(sample.memory, msg.memory)
    if not sample.processes_read:
        msg.processes_unknown = sample.processes_error or sample.reason or "not read"
    if sample.utilization is not None:
        msg.utilization.gpu_ratio = sample.utilization.gpu_ratio
        msg.utilization.memory_ratio = sample.utilization.memory_ratio
    if sample.power_watts is not None:
        msg.power_watts = sample.power_watts
    if sample.temperature_celsius is not None:
        msg.temperature_celsius = sample.temperature_celsius
    if sample.clocks is not None:
        msg.clocks.sm_mhz = sample.clocks.sm_mhz
        msg.clocks.memory_mhz = sample.clocks.memory_mhz
    if sample.ecc is not None:
        msg.ecc.corrected = sample.ecc.corrected
        msg.ecc.uncorrected = sample.ecc.uncorrected
    if sample.pcie is not None:
        msg.pcie.tx_bytes_per_second = sample.pcie.tx_bytes_per_second
        msg.pcie.rx_bytes_per_second = sample.pcie.rx_bytes_per_second
    if sample.mig_mode is not None:
        msg.mig_mode.current = sample.mig_mode.current
        msg.mig_mode.pending = sample.mig_mode.pending
    if sample.last_xid is not None:
        msg.last_xid = sample.last_xid
    for c in sample.critical_xids:
        msg.critical_xids.add(
            xid=c.xid,
            count=c.count,
            first_seen_unix_seconds=c.first_seen,
            last_seen_unix_seconds=c.last_seen,
            uuid=ident.uuid or c.uuid or known.uuid,
        )
    return msg


def _jsonable(fields: dict[str, Any]) -> dict[str, Any]:
    """Event fields as JSON values: anything else (a Path, an enum) becomes its string."""
    loaded: dict[str, Any] = json.loads(json.dumps(fields, default=str))
    return loaded


def event(value: Event) -> pb.Event:
    msg = pb.Event(
        time_unix_seconds=value.time, kind=value.kind, message=value.message, seq=value.seq
    )
    fields = struct_pb2.Struct()
    fields.update(_jsonable(value.fields))
    msg.fields.CopyFrom(fields)
    return msg
