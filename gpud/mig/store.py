"""Desired MIG layouts and the in-flight plan, in the daemon's state database.

Tables (``sqlite3 /var/lib/gpud/state.db '.schema mig_desired'``):

- ``mig_desired``: one row per managed GPU, keyed by GPU UUID so that a GPU keeps its layout
  when the NVML index order changes; GPUs without a row are not managed.
- ``mig_inflight``: at most one row, written in the same transaction as the desired layouts
  before the first driver call of an apply and deleted after the last. A row found at start
  means the daemon died mid-apply; reconcile finishes the job (it re-plans from what the
  driver has, so nothing is replayed blindly), or in "report" mode reports it unfinished.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpud.mig.layout import DeviceLayout, layout_from_json, layout_to_json
from gpud.mig.plan import Step, step_from_dict, step_to_dict
from gpud.store import StateStore

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS mig_desired (
        gpu_uuid TEXT PRIMARY KEY,
        gpu_index INTEGER NOT NULL,
        config_name TEXT NOT NULL,
        layout TEXT NOT NULL,
        updated_at REAL NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS mig_inflight (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        config_name TEXT NOT NULL,
        steps TEXT NOT NULL,
        options TEXT NOT NULL,
        started_at REAL NOT NULL,
        steps_done INTEGER NOT NULL DEFAULT 0
    )""",
)


@dataclass(frozen=True, slots=True)
class DesiredRecord:
    gpu_uuid: str
    gpu_index: int  # index when the layout was set; the UUID is what counts
    config_name: str
    layout: DeviceLayout
    updated_at: float


@dataclass(frozen=True, slots=True)
class ApplyOptions:
    """How an apply may treat busy instances and a MIG mode change pending a GPU reset; kept
    with the in-flight plan so a resumed apply honours what the operator asked for.
    ``skip_reset``: leave a pending MIG mode change for the next reset or reboot
    (``nvidia-mig-parted apply --skip-reset``) instead of resetting the GPU."""

    drain: bool = False
    force: bool = False
    timeout_s: float = 0.0
    skip_reset: bool = False

    def to_json(self) -> str:
        return json.dumps(
            {
                "drain": self.drain,
                "force": self.force,
                "timeout_s": self.timeout_s,
                "skip_reset": self.skip_reset,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> ApplyOptions:
        raw: dict[str, Any] = json.loads(text)
        return cls(
            bool(raw.get("drain")),
            bool(raw.get("force")),
            float(raw.get("timeout_s", 0)),
            # Plans persisted before resets existed never reset: they were made without.
            bool(raw.get("skip_reset", True)),
        )


@dataclass(frozen=True, slots=True)
class InflightRecord:
    config_name: str
    steps: tuple[Step, ...]
    options: ApplyOptions
    started_at: float
    steps_done: int


class MigStore:
    def __init__(self, store: StateStore) -> None:
        self._store = store
        store.ensure_schema(SCHEMA)

    def desired(self) -> dict[str, DesiredRecord]:
        with self._store.read() as conn:
            rows = conn.execute(
                "SELECT gpu_uuid, gpu_index, config_name, layout, updated_at FROM mig_desired"
            ).fetchall()
        return {
            r["gpu_uuid"]: DesiredRecord(
                r["gpu_uuid"],
                r["gpu_index"],
                r["config_name"],
                layout_from_json(r["layout"]),
                r["updated_at"],
            )
            for r in rows
        }

    def begin_apply(
        self,
        config_name: str,
        layouts: Mapping[str, tuple[int, DeviceLayout]],
        steps: Sequence[Step],
        options: ApplyOptions,
        now: float,
        *,
        inflight: bool = True,
    ) -> None:
        """Record the new desired layouts (uuid -> (index, layout)) and the plan, atomically.
        Without ``inflight`` (an apply with nothing to do) no plan is recorded, and an earlier
        one is dropped: this apply replaces it."""
        with self._store.transaction() as conn:
            for uuid, (index, layout) in layouts.items():
                conn.execute(
                    "INSERT INTO mig_desired (gpu_uuid, gpu_index, config_name, layout, updated_at) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT(gpu_uuid) DO UPDATE SET "
                    "gpu_index=excluded.gpu_index, config_name=excluded.config_name, "
                    "layout=excluded.layout, updated_at=excluded.updated_at",
                    (uuid, index, config_name, layout_to_json(layout), now),
                )
            conn.execute("DELETE FROM mig_inflight")
            if not inflight:
                return
            conn.execute(
                "INSERT INTO mig_inflight (id, config_name, steps, options, started_at, steps_done) "
                "VALUES (1, ?, ?, ?, ?, 0)",
                (config_name, json.dumps([step_to_dict(s) for s in steps]), options.to_json(), now),
            )

    def step_done(self) -> None:
        """One more step of the in-flight apply took effect (on any of its GPUs); nothing
        when none is in flight."""
        with self._store.transaction() as conn:
            conn.execute("UPDATE mig_inflight SET steps_done = steps_done + 1 WHERE id = 1")

    def inflight(self) -> InflightRecord | None:
        with self._store.read() as conn:
            row = conn.execute(
                "SELECT config_name, steps, options, started_at, steps_done FROM mig_inflight WHERE id = 1"
            ).fetchone()
        if row is None:
            return None
        steps = tuple(step_from_dict(s) for s in json.loads(row["steps"]))
        return InflightRecord(
            row["config_name"],
            steps,
            ApplyOptions.from_json(row["options"]),
            row["started_at"],
            row["steps_done"],
        )

    def finish_apply(self) -> None:
        with self._store.transaction() as conn:
            conn.execute("DELETE FROM mig_inflight")

    def forget(self, gpu_uuids: Sequence[str]) -> None:
        """Stop managing these GPUs (their instances stay as they are)."""
        with self._store.transaction() as conn:
            conn.executemany(
                "DELETE FROM mig_desired WHERE gpu_uuid = ?", [(u,) for u in gpu_uuids]
            )
