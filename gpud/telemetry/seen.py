"""GPUs as last seen: each GPU's model, UUID and PCI address kept in the state database, so
that a GPU gpud cannot read after a restart (lost, hung) is still named in its reason, and
an operator knows which board to look at (``nvidia-smi -L`` cannot say either)."""

from __future__ import annotations

from collections.abc import Iterable

from gpud.backend.port import GpuIdentity
from gpud.store import StateStore
from gpud.telemetry.snapshot import SeenIdentity

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS gpu_seen (
        gpu_index INTEGER PRIMARY KEY,
        description TEXT NOT NULL,
        seen_at REAL NOT NULL
    )""",
)


def describe(identity: GpuIdentity) -> str:
    """``NVIDIA H100 80GB HBM3 GPU-5c6e... at 00000000:18:00.0``."""
    return f"{identity.name} {identity.uuid} at {identity.pci_bus_id}"


def parse(description: str) -> SeenIdentity | None:
    """What :func:`describe` wrote, read back (None for text it did not write). The
    description is the one record kept, by every gpud version: reading it back needs no
    second copy that could disagree with it. A UUID and a PCI address have no spaces, a
    name may: the name is what lies before the last two words."""
    head, at, pci_bus_id = description.rpartition(" at ")
    name, _, uuid = head.rpartition(" ")
    if not (at and name and uuid.startswith("GPU-")) or " " in pci_bus_id:
        return None
    return SeenIdentity(uuid, name, pci_bus_id)


class SeenGpus:
    """The description of each GPU index as last read, in table ``gpu_seen``."""

    def __init__(self, store: StateStore) -> None:
        store.ensure_schema(SCHEMA)
        self._store = store
        with store.transaction() as conn:
            rows = conn.execute("SELECT gpu_index, description FROM gpu_seen").fetchall()
        self.known: dict[int, str] = {int(i): str(d) for i, d in rows}

    def changes(self, identities: Iterable[GpuIdentity]) -> dict[int, str]:
        """The identities that were read (a placeholder has no UUID) and differ from what is
        kept, described; no I/O."""
        return {
            i.index: describe(i)
            for i in identities
            if i.uuid and self.known.get(i.index) != describe(i)
        }

    def remember(self, changes: dict[int, str], now: float) -> None:
        """Keep ``changes`` (from :meth:`changes`)."""
        with self._store.transaction() as conn:
            conn.executemany(
                "INSERT INTO gpu_seen (gpu_index, description, seen_at) VALUES (?, ?, ?)"
                " ON CONFLICT(gpu_index) DO UPDATE SET description = excluded.description,"
                " seen_at = excluded.seen_at",
                [(index, text, now) for index, text in changes.items()],
            )
        self.known.update(changes)
