"""The MIG manager: validate, plan and apply layouts safely; reconcile; show; export.

One :class:`MigManager` per daemon. Every mutating driver call goes through it, serialised
by a lock, in this order for an apply:

1. resolve the named config for each GPU and validate it against the GPU's own tables
   (nothing is touched when any GPU's layout is impossible);
2. plan every GPU (:mod:`gpud.mig.plan`);
3. check that no instance to be destroyed runs processes (``nvidia-smi`` "Processes" table,
   per MIG device); refuse with :class:`~gpud.errors.Busy` naming pids and jobs, or wait for
   them to leave (``drain``), or go ahead (``force``);
4. persist the desired layouts and the plan in one transaction, then run the steps, each
   step re-planned from what the driver has, so that a crash at any point is finished by
   :meth:`MigManager.reconcile` at the next start without orphaned or duplicated instances.

A MIG mode change the driver can only make at the next GPU reset (``nvidia-smi -mig 1``
answering "pending") is reported as ``reset_pending``; the instances are created by the first
reconcile after the reset.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Literal

from gpud.backend.port import GpuBackend, GpuIdentity, GpuInstanceInfo, ProcessInfo
from gpud.errors import Busy, GpudError, InvalidArgument, NotFound, NotSupported
from gpud.events import EventLog
from gpud.mig.layout import DeviceLayout, MigConfigFile, export_config, resolve
from gpud.mig.plan import (
    CreateComputeInstance,
    CreateGpuInstance,
    DestroyComputeInstance,
    DestroyGpuInstance,
    GpuActual,
    GpuPlan,
    SetMigMode,
    Step,
    actual_layout,
    describe_difference,
    plan_gpu,
)
from gpud.mig.results import ApplyResult, ApplyStats, GpuOutcome
from gpud.mig.store import ApplyOptions, DesiredRecord, MigStore
from gpud.mig.validate import ProfileTable, load_table, reference_table
from gpud.mig.view import GpuView, JobResolver, gpu_view, read_actual
from gpud.store import StateStore

log = logging.getLogger(__name__)

ReconcileMode = Literal["reconcile", "report"]


class MigManager:
    """MIG partitions of one node. Build once at the composition root::

    manager = MigManager(backend, state_store, event_log, job_resolver=jobs.job_of_pid)
    manager.reconcile("reconcile")  # at start, then on every tick
    """

    def __init__(
        self,
        backend: GpuBackend,
        store: StateStore,
        events: EventLog,
        *,
        job_resolver: JobResolver | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        drain_poll_s: float = 1.0,
        on_change: Callable[[int], None] | None = None,
    ) -> None:
        """``on_change(gpu)`` is called after each driver change on a GPU (the sampler then
        re-reads its MIG devices at once)."""
        self._backend = backend
        self._on_change = on_change
        self._store = MigStore(store)
        self._events = events
        self._jobs = job_resolver
        self._monotonic = monotonic
        self._wall = wall
        self._sleep = sleep
        self._drain_poll_s = drain_poll_s
        self._lock = threading.RLock()
        self._last_report: dict[str, str] = {}
        self._tables: dict[str, ProfileTable] = {}
        self._view: list[GpuView] | None = None
        self._view_at = float("-inf")
        self._outcomes: list[GpuOutcome] = []
        self.stats = ApplyStats()

    # ---------------------------------------------------------------- reading the driver

    def _identities(self) -> list[GpuIdentity]:
        return [self._backend.identity(i) for i in range(self._backend.gpu_count())]

    def _actual(self, gpu: GpuIdentity) -> GpuActual:
        return read_actual(self._backend, gpu)

    def _table(self, gpu: GpuIdentity) -> ProfileTable | None:
        """The GPU's own MIG tables (read once, they do not change while it is present), or
        the product's published table while MIG mode is off and the driver lists none."""
        if not gpu.mig_capable:
            return None
        cached = self._tables.get(gpu.uuid)
        if cached is not None:
            return cached
        try:
            table = load_table(self._backend, gpu.index)
        except NotSupported:
            return reference_table(gpu)
        if table.from_device:
            self._tables[gpu.uuid] = table
        return table

    def _plan(
        self, gpu: GpuIdentity, layout: DeviceLayout, table: ProfileTable | None
    ) -> tuple[GpuActual, GpuPlan]:
        actual = self._actual(gpu)
        if layout.mig_enabled and table is None:
            if not gpu.mig_capable:
                raise InvalidArgument(
                    f"GPU {gpu.index} ({gpu.product}): does not support MIG", field="mig-enabled"
                )
            steps: tuple[Step, ...] = () if actual.mode.pending else (SetMigMode(gpu.index, True),)
            return actual, GpuPlan(gpu.index, steps, reset_pending=True)
        return actual, plan_gpu(actual, layout, table)

    # ---------------------------------------------------------------- busy checks

    def _busy(
        self, gpu: GpuIdentity, actual: GpuActual, plan: GpuPlan
    ) -> list[tuple[str, ProcessInfo]]:
        """Processes on what ``plan`` destroys (``nvidia-smi`` "Processes" per MIG device),
        each with what it runs on. A MIG mode change disturbs every process on the GPU."""
        gis = plan.destroyed_gpu_instances()
        cis = plan.destroyed_compute_instances()
        mode_change = any(
            isinstance(s, SetMigMode) and s.enabled != actual.mode.current for s in plan.steps
        )
        found: dict[int, tuple[str, ProcessInfo]] = {}
        if actual.mode.current and (gis or cis or mode_change):
            for md in self._backend.mig_devices(gpu.index):
                key = (md.gpu_instance_id, md.compute_instance_id)
                if mode_change or md.gpu_instance_id in gis or key in cis:
                    where = f"{md.profile_name} GPU instance {md.gpu_instance_id} ({md.uuid})"
                    for p in self._backend.processes(gpu.index, md.mig):
                        found.setdefault(p.pid, (where, p))
        if mode_change:
            for p in self._backend.processes(gpu.index):
                found.setdefault(p.pid, ("the whole GPU", p))
        return [found[pid] for pid in sorted(found)]

    def _busy_error(
        self,
        busy: dict[int, list[tuple[str, ProcessInfo]]],
        ids: dict[int, GpuIdentity],
        waited_s: float | None,
    ) -> Busy:
        pids: list[int] = []
        jobs: list[str] = []
        parts = []
        for gpu, entries in sorted(busy.items()):
            for where, p in entries:
                job = self._jobs(p.pid) if self._jobs is not None else None
                pids.append(p.pid)
                if job is not None and job not in jobs:
                    jobs.append(job)
                who = f"pid {p.pid}" + (f" (job {job})" if job else "")
                parts.append(f"GPU {gpu} ({ids[gpu].product}) {where}: {who}")
        head = (
            f"processes still running after draining for {waited_s:.0f}s"
            if waited_s is not None
            else "refusing to destroy instances with running processes"
        )
        return Busy(
            f"{head}: {'; '.join(parts)} (use drain or force)", pids=tuple(pids), jobs=tuple(jobs)
        )

    # ---------------------------------------------------------------- apply

    def validate(self, config: MigConfigFile, name: str) -> dict[int, DeviceLayout]:
        """The layout per GPU index, checked against each GPU's tables; raises
        :class:`InvalidArgument` with GPU, product and reason. Touches nothing."""
        ids = self._identities()
        layouts = resolve(config.config(name), ids)
        for index, layout in layouts.items():
            self._plan(ids[index], layout, self._table(ids[index]))
        return layouts

    def apply(
        self,
        config: MigConfigFile,
        name: str,
        *,
        options: ApplyOptions | None = None,
        dry_run: bool = False,
    ) -> ApplyResult:
        """Apply config ``name`` of ``config`` to this node's GPUs. See the module docstring."""
        opts = options or ApplyOptions()
        start = self._monotonic()
        with self._lock:
            try:
                result = self._apply(config, name, opts, dry_run, start)
            except InvalidArgument as err:
                self._finish(name, "invalid", start, str(err))
                raise
            except Busy as err:
                self._finish(name, "busy", start, str(err))
                raise
            except GpudError as err:
                self._finish(name, "failed", start, str(err))
                raise
        return result

    def _finish(self, name: str, result: str, start: float, detail: str, **fields: object) -> float:
        duration = self._monotonic() - start
        self.stats.record(result, duration)
        self._events.emit(
            "mig.apply",
            f"apply {name}: {result}{': ' + detail if detail else ''}",
            config=name,
            result=result,
            duration_s=round(duration, 3),
            **fields,
        )
        return duration

    def _apply(
        self, config: MigConfigFile, name: str, opts: ApplyOptions, dry_run: bool, start: float
    ) -> ApplyResult:
        ids = self._identities()
        by_index = {g.index: g for g in ids}
        layouts = resolve(config.config(name), ids)
        tables = {i: self._table(by_index[i]) for i in layouts}
        plans: dict[int, tuple[GpuActual, GpuPlan]] = {
            i: self._plan(by_index[i], layout, tables[i]) for i, layout in layouts.items()
        }
        if dry_run:
            preview = tuple(
                GpuOutcome(
                    i,
                    by_index[i].uuid,
                    tuple(s.describe() for s in p.steps),
                    p.reset_pending,
                    "ok" if p.empty else "differs",
                )
                for i, (_, p) in sorted(plans.items())
            )
            return ApplyResult(
                name,
                "noop" if all(o.status == "ok" for o in preview) else "success",
                preview,
                0.0,
                dry_run=True,
            )

        if not opts.force:
            self._wait_idle(plans, by_index, opts)

        all_steps = [s for _, (_, p) in sorted(plans.items()) for s in p.steps]
        self._store.begin_apply(
            name,
            {by_index[i].uuid: (i, layout) for i, layout in layouts.items()},
            all_steps,
            opts,
            self._wall(),
        )
        outcomes: list[GpuOutcome] = []
        failed = False
        for i in sorted(layouts):
            outcome = self._converge(by_index[i], layouts[i], force=True)
            failed |= outcome.status == "failed"
            outcomes.append(outcome)
        if not failed:
            self._store.finish_apply()
        if failed:
            result = "failed"
        elif any(o.reset_pending for o in outcomes):
            result = "reset_pending"
        elif any(o.steps for o in outcomes):
            result = "success"
        else:
            result = "noop"
        detail = "; ".join(o.detail for o in outcomes if o.detail)
        duration = self._finish(
            name,
            result,
            start,
            detail,
            gpus={o.gpu: o.status for o in outcomes},
            steps=sum(len(o.steps) for o in outcomes),
        )
        return ApplyResult(name, result, tuple(outcomes), duration)

    def _wait_idle(
        self,
        plans: dict[int, tuple[GpuActual, GpuPlan]],
        by_index: dict[int, GpuIdentity],
        opts: ApplyOptions,
    ) -> None:
        deadline = self._monotonic() + opts.timeout_s
        started = self._monotonic()
        while True:
            busy = {
                i: b
                for i, (actual, plan) in plans.items()
                if (b := self._busy(by_index[i], actual, plan))
            }
            if not busy:
                return
            if not opts.drain:
                raise self._busy_error(busy, by_index, None)
            if self._monotonic() >= deadline:
                raise self._busy_error(busy, by_index, self._monotonic() - started)
            log.info("draining MIG instances on GPUs %s", sorted(busy))
            self._sleep(min(self._drain_poll_s, max(0.0, deadline - self._monotonic())))

    def _converge(self, gpu: GpuIdentity, layout: DeviceLayout, *, force: bool) -> GpuOutcome:
        """Run the plan for one GPU, re-planning after a MIG mode change took effect.

        Each round reads the driver first, so a step that already took effect (before a
        crash, say) is never repeated.
        """
        done: list[str] = []
        for _ in range(3):
            table = self._table(gpu)
            try:
                actual, plan = self._plan(gpu, layout, table)
            except InvalidArgument as err:
                return GpuOutcome(gpu.index, gpu.uuid, tuple(done), False, "failed", str(err))
            if not plan.steps:
                status = "reset_pending" if plan.reset_pending else ("changed" if done else "ok")
                return GpuOutcome(gpu.index, gpu.uuid, tuple(done), plan.reset_pending, status)
            if not force and (busy := self._busy(gpu, actual, plan)):
                refusal = self._busy_error({gpu.index: busy}, {gpu.index: gpu}, None)
                return GpuOutcome(gpu.index, gpu.uuid, tuple(done), False, "busy", str(refusal))
            try:
                pending = self._run(gpu, plan, done, actual.mode.current)
            except GpudError as err:
                log.warning("MIG step failed on GPU %d: %s", gpu.index, err)
                return GpuOutcome(
                    gpu.index,
                    gpu.uuid,
                    tuple(done),
                    False,
                    "failed",
                    f"GPU {gpu.index} ({gpu.product}): {err}",
                )
            if pending:
                return GpuOutcome(
                    gpu.index,
                    gpu.uuid,
                    tuple(done),
                    True,
                    "reset_pending",
                    f"GPU {gpu.index} ({gpu.product}): MIG mode change pending a GPU reset",
                )
        return GpuOutcome(
            gpu.index, gpu.uuid, tuple(done), False, "failed", f"GPU {gpu.index}: did not converge"
        )

    def _run(self, gpu: GpuIdentity, plan: GpuPlan, done: list[str], mig_on: bool) -> bool:
        """Run steps until the plan ends or a MIG mode change waits for a reset (returns True)."""
        for step in plan.steps:
            if isinstance(step, CreateGpuInstance | CreateComputeInstance) and not mig_on:
                return True  # instances wait for the MIG mode change to take effect
            if isinstance(step, SetMigMode):
                mode = self._backend.set_mig_mode(step.gpu, step.enabled)
                done.append(step.describe())
                self._mark(len(done))
                self._changed(gpu.index)
                # Pending until a reset, or taken effect: then re-plan from what the driver has.
                return mode.current != step.enabled
            self._do(step)
            done.append(step.describe())
            self._mark(len(done))
            self._changed(gpu.index)
        return False

    def _changed(self, gpu: int) -> None:
        self.refresh_view()
        if self._on_change is not None:
            self._on_change(gpu)

    def _mark(self, count: int) -> None:
        if self._store.inflight() is not None:
            self._store.step_done(count)

    def _do(self, step: Step) -> None:
        b = self._backend
        if isinstance(step, DestroyComputeInstance):
            b.destroy_compute_instance(step.gpu, step.gpu_instance_id, step.compute_instance_id)
        elif isinstance(step, DestroyGpuInstance):
            b.destroy_gpu_instance(step.gpu, step.gpu_instance_id)
        elif isinstance(step, CreateGpuInstance):
            b.create_gpu_instance(step.gpu, step.profile_id, step.placement)
        elif isinstance(step, CreateComputeInstance):
            gi = self._gi_at(step)
            b.create_compute_instance(step.gpu, gi.id, step.profile_id)
        else:  # SetMigMode is handled by _run
            raise AssertionError(step)

    def _gi_at(self, step: CreateComputeInstance) -> GpuInstanceInfo:
        for gi in self._backend.gpu_instances(step.gpu):
            if (
                gi.profile_id == step.gpu_instance_profile_id
                and gi.placement == step.gpu_instance_placement
            ):
                return gi
        raise NotFound(
            f"GPU {step.gpu}: no GPU instance at placement {step.gpu_instance_placement}"
        )

    # ---------------------------------------------------------------- assert / reconcile

    def assert_config(self, config: MigConfigFile, name: str) -> list[str]:
        """Differences between the GPUs and config ``name`` (empty: they match)."""
        ids = self._identities()
        layouts = resolve(config.config(name), ids)
        return self._differences({ids[i]: layout for i, layout in layouts.items()})

    def _differences(self, layouts: dict[GpuIdentity, DeviceLayout]) -> list[str]:
        out = []
        for gpu, layout in sorted(layouts.items(), key=lambda kv: kv[0].index):
            table = self._table(gpu)
            actual, plan = self._plan(gpu, layout, table)
            if not plan.empty:
                out.append(f"{describe_difference(actual, layout, table, plan)} [{gpu.product}]")
        return out

    # How often reconcile re-reads every GPU's instances for `latest_view` (metrics) when
    # nothing changed: a full `show` is dozens of driver calls per GPU, too many for every
    # tick. Live per-device memory is in the telemetry metrics (gpud_mig_device_*).
    VIEW_REFRESH_S = 10.0

    def refresh_view(self) -> None:
        """Have the next :meth:`reconcile` re-read every GPU's instances for the view."""
        self._view_at = float("-inf")

    def reconcile(
        self, mode: ReconcileMode = "reconcile", *, skip: Collection[str] = ()
    ) -> list[GpuOutcome]:
        """Bring every managed GPU to its desired layout (``"reconcile"``), or only report how
        it differs (``"report"``). Call at start and on every tick; cheap when nothing differs.

        GPUs whose UUID is in ``skip`` (unhealthy in the last telemetry sample: lost, or
        hung in the driver) are not touched; they are reported ``failed`` until they answer.

        Instances with running processes are not destroyed, unless an interrupted apply was
        started with ``force``; such a GPU is reported ``busy`` and retried next time.
        """
        with self._lock:
            inflight = self._store.inflight()
            desired = self._store.desired()
            ids = {g.uuid: g for g in self._identities()}
            force = inflight is not None and inflight.options.force
            if inflight is not None and mode == "reconcile" and "inflight" not in self._last_report:
                self._events.emit(
                    "mig.resume",
                    f"resuming the interrupted apply of {inflight.config_name} "
                    f"({inflight.steps_done}/{len(inflight.steps)} steps were done)",
                    config=inflight.config_name,
                )
                self._last_report["inflight"] = inflight.config_name
            outcomes: list[GpuOutcome] = []
            for uuid, record in sorted(desired.items(), key=lambda kv: kv[1].gpu_index):
                gpu = ids.get(uuid)
                if gpu is None:
                    outcomes.append(
                        GpuOutcome(
                            record.gpu_index,
                            uuid,
                            (),
                            False,
                            "missing",
                            f"GPU {uuid} is not present",
                        )
                    )
                    continue
                if uuid in skip:
                    outcomes.append(
                        GpuOutcome(
                            gpu.index,
                            uuid,
                            (),
                            False,
                            "failed",
                            f"GPU {gpu.index} ({gpu.product}) is unhealthy: not reconciled"
                            " until it answers again",
                        )
                    )
                    continue
                outcomes.append(self._reconcile_gpu(gpu, record, mode, force))
            for o in outcomes:
                self._report(o)
            converged = all(
                o.status in ("ok", "changed", "reset_pending", "missing") for o in outcomes
            )
            if inflight is not None and mode == "reconcile" and converged:
                self._store.finish_apply()
                self._last_report.pop("inflight", None)
                self._events.emit(
                    "mig.apply",
                    f"apply {inflight.config_name}: finished after a restart",
                    config=inflight.config_name,
                    result="resumed",
                )
            self._outcomes = outcomes
            now = self._monotonic()
            if self._view is None or now - self._view_at >= self.VIEW_REFRESH_S:
                try:
                    self._view = self.show(skip=skip)
                    self._view_at = now
                except GpudError as err:
                    log.warning("cannot read MIG instances: %s", err)
                    self._view_at = now  # retried at the next refresh, not every tick
            return outcomes

    def latest_view(self) -> list[GpuView]:
        """What the last reconcile saw (read now if there was none): for metrics."""
        view = self._view
        return view if view is not None else self.show()

    def last_outcomes(self) -> list[GpuOutcome]:
        """The managed GPUs' statuses from the last reconcile."""
        return list(self._outcomes)

    def _reconcile_gpu(
        self, gpu: GpuIdentity, record: DesiredRecord, mode: ReconcileMode, force: bool
    ) -> GpuOutcome:
        try:
            if mode == "report":
                diff = self._differences({gpu: record.layout})
                if diff:
                    return GpuOutcome(gpu.index, gpu.uuid, (), False, "differs", diff[0])
                return GpuOutcome(gpu.index, gpu.uuid, (), False, "ok")
            return self._converge(gpu, record.layout, force=force)
        except GpudError as err:
            return GpuOutcome(
                gpu.index, gpu.uuid, (), False, "failed", f"GPU {gpu.index} ({gpu.product}): {err}"
            )

    def _report(self, o: GpuOutcome) -> None:
        """One event per change of a GPU's reconcile status (not one per tick)."""
        key = f"{o.uuid}:{o.status}:{o.detail}"
        if o.status == "changed":
            self._events.emit(
                "mig.reconcile",
                f"GPU {o.gpu}: reconciled to its desired layout",
                gpu=o.gpu,
                uuid=o.uuid,
                steps=list(o.steps),
            )
        elif o.status != "ok" and self._last_report.get(o.uuid) != key:
            self._events.emit(
                "mig.drift",
                f"GPU {o.gpu}: {o.status}: {o.detail}",
                gpu=o.gpu,
                uuid=o.uuid,
                status=o.status,
            )
        self._last_report[o.uuid] = key

    # ---------------------------------------------------------------- show / export

    def desired(self) -> dict[str, DesiredRecord]:
        return self._store.desired()

    def layouts(self) -> dict[int, DeviceLayout]:
        """The current layout of every GPU, in mig-parted's terms."""
        out = {}
        for gpu in self._identities():
            out[gpu.index] = actual_layout(
                self._actual(gpu), self._table(gpu) if gpu.mig_capable else None
            )
        return out

    def export(self, name: str = "current") -> str:
        """The current layout as a mig-parted config named ``name``."""
        layouts = self.layouts()
        return export_config(name, layouts, gpu_count=len(layouts))

    def show(self, *, skip: Collection[str] = ()) -> list[GpuView]:
        """Every GPU (but those whose UUID is in ``skip``): MIG mode, instances with MIG UUIDs
        and processes, profiles and placements."""
        desired = self._store.desired()
        return [
            gpu_view(self._backend, gpu, self._table(gpu), desired.get(gpu.uuid), self._jobs)
            for gpu in self._identities()
            if gpu.uuid not in skip
        ]
