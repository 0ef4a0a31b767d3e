"""GPUs as last seen: each GPU's model, UUID, PCI address and product key kept in the state
database, so that a GPU gpud cannot read after a restart (lost, hung) is still named in its
reason, and an operator knows which board to look at (``nvidia-smi -L`` cannot say either).
The product key (``H100-SXM5-80GB``: from the name and the memory size, which cannot be read
either) names it in ``gpuctl gpus`` and the metrics as it named it while it answered."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from gpud.backend.port import GpuIdentity
from gpud.store import StateStore
from gpud.telemetry.snapshot import SeenIdentity

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS gpu_seen (
        gpu_index INTEGER PRIMARY KEY,
        description TEXT NOT NULL,
        seen_at REAL NOT NULL,
        product TEXT
    )""",
)
# Columns added since the first version of the table: an older state.db gets them at start,
# NULL in the rows it kept (the product then is not known until the GPU answers again).
ADDED = {"gpu_seen": ("product",)}


class Seen(NamedTuple):
    """One GPU as kept: its :func:`describe` text and product key ("" where not kept)."""

    description: str
    product: str = ""


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


def identity(seen: Seen) -> SeenIdentity | None:
    """The identity ``seen`` keeps (None when its description is not of gpud's making)."""
    parsed = parse(seen.description)
    return None if parsed is None else parsed._replace(product=seen.product)


def _seen(identity: GpuIdentity) -> Seen:
    return Seen(describe(identity), identity.product)


class SeenGpus:
    """How each GPU index was last read, in table ``gpu_seen``."""

    def __init__(self, store: StateStore) -> None:
        store.ensure_schema(SCHEMA, added=ADDED)
        self._store = store
        with store.transaction() as conn:
            rows = conn.execute("SELECT gpu_index, description, product FROM gpu_seen").fetchall()
        self.known: dict[int, Seen] = {int(i): Seen(str(d), str(p or "")) for i, d, p in rows}

    def changes(self, identities: Iterable[GpuIdentity]) -> dict[int, Seen]:
        """The identities that were read (a placeholder has no UUID) and differ from what is
        kept (a row an older gpud kept without the product included); no I/O."""
        return {
            i.index: _seen(i) for i in identities if i.uuid and self.known.get(i.index) != _seen(i)
        }

    def remember(self, changes: dict[int, Seen], now: float) -> None:
        """Keep ``changes`` (from :meth:`changes`)."""
        with self._store.transaction() as conn:
            conn.executemany(
                "INSERT INTO gpu_seen (gpu_index, description, seen_at, product)"
                " VALUES (?, ?, ?, ?)"
                " ON CONFLICT(gpu_index) DO UPDATE SET description = excluded.description,"
                " seen_at = excluded.seen_at, product = excluded.product",
                [(index, seen.description, now, seen.product) for index, seen in changes.items()],
            )
        self.known.update(changes)
