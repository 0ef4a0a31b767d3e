"""The GPU products gpud knows by name, with their published MIG tables.

The simulated node models these boards; the NVML adapter derives its product keys from
them, and MIG validation uses their tables while a GPU's MIG mode is still off.

Each product is what ``nvidia-smi -q`` and ``nvidia-smi mig -lgip / -lgipp / -lcip`` show on
that board: the NVML name and PCI device id, memory, SM count, clocks and power limit, and
the MIG GPU-instance profiles with the profile ids NVML returns, their memory in MiB (as
``memorySizeMB`` reports it), SM / engine counts, instance counts and placements.

Sources: NVIDIA's MIG user guide ("Supported MIG Profiles": fractions, engine counts,
instance counts and the placement diagram) and ``nvidia-smi mig -lgip`` / ``-lgipp`` output
from A100 and H100 boards for the exact ids and MiB figures. Placements are in *memory
slices*: a GPU has 8 memory slices and 7 compute slices, so ``nvidia-smi mig -lgipp`` prints
``{0,1,2,3,4,5,6}:1`` for 1g profiles, ``{0,2,4,6}:2`` for the 1g profile with two memory
slices, ``{0,2,4}:2`` for 2g, ``{0,4}:4`` for 3g, ``{0}:4`` for 4g and ``{0}:8`` for 7g.

H200 figures follow the guide's H200 table; its per-profile MiB values, SM and engine counts
and placements are the ones NVML 580.159.04 reports on an H200 (its profile tables answer
with MIG mode off too).
"""

from __future__ import annotations

from dataclasses import dataclass

# NVML_GPU_INSTANCE_PROFILE_* constants (nvml.h); the simulated module re-exports them.
GI_1_SLICE = 0x0
GI_2_SLICE = 0x1
GI_3_SLICE = 0x2
GI_4_SLICE = 0x3
GI_7_SLICE = 0x4
GI_1_SLICE_REV1 = 0x7  # 1g with media extensions ("+me")
GI_1_SLICE_REV2 = 0x9  # 1g with two memory slices (1g.10gb on A100-40GB, 1g.20gb on H100)

# NVML_COMPUTE_INSTANCE_PROFILE_* constants. NVML returns the constant as the CI profile id.
CI_1_SLICE = 0x0
CI_2_SLICE = 0x1
CI_3_SLICE = 0x2
CI_4_SLICE = 0x3
CI_7_SLICE = 0x4

MEMORY_SLICES = 8
COMPUTE_SLICES = 7

# Valid start offsets (in a GPU instance's compute slices) of a compute instance of each
# size: the same buddy layout as GPU instances on the whole GPU (-lcipp).
CI_STARTS: dict[int, tuple[int, ...]] = {
    1: (0, 1, 2, 3, 4, 5, 6),
    2: (0, 2, 4),
    3: (0, 4),
    4: (0,),
    7: (0,),
}
CI_CONSTANT_BY_SLICES: dict[int, int] = {
    1: CI_1_SLICE,
    2: CI_2_SLICE,
    3: CI_3_SLICE,
    4: CI_4_SLICE,
    7: CI_7_SLICE,
}


# Usable bytes per second of one PCIe lane in each direction, by generation: the transfer
# rate times its line code (8b/10b to Gen2, 128b/130b from Gen3; Gen6 runs 64 GT/s in
# 256-byte FLITs of which 242 carry data), over 8 bits. A Gen5 x16 link: 63 GB/s each way.
PCIE_LANE_BYTES_PER_SECOND: dict[int, float] = {
    1: 2.5e9 * 8 / 10 / 8,
    2: 5e9 * 8 / 10 / 8,
    3: 8e9 * 128 / 130 / 8,
    4: 16e9 * 128 / 130 / 8,
    5: 32e9 * 128 / 130 / 8,
    6: 64e9 * 242 / 256 / 8,
}
PCIE_WIDTHS: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 32)
# The link of a GPU that NVML cannot tell about and gpud does not know by name: Gen4 x16,
# the slot of most data-centre GPUs in service (A100, A10, L4, L40S).
DEFAULT_PCIE_GEN = 4
DEFAULT_PCIE_LANES = 16


def pcie_bytes_per_second(gen: int, lanes: int) -> float | None:
    """A PCIe link's capacity per direction in bytes/s (``nvidia-smi -q``'s "GPU Link Info":
    generation and width); None for a generation or width no PCIe link has."""
    per_lane = PCIE_LANE_BYTES_PER_SECOND.get(gen)
    if per_lane is None or lanes not in PCIE_WIDTHS:
        return None
    return per_lane * lanes


@dataclass(frozen=True, slots=True)
class GiProfileSpec:
    """One row of ``nvidia-smi mig -lgip`` plus its ``-lgipp`` placements."""

    constant: int  # NVML_GPU_INSTANCE_PROFILE_*
    id: int  # the profile id NVML returns (and nvidia-smi prints)
    name: str  # "1g.10gb", "1g.10gb+me", ...
    slices: int  # compute slices
    memory_mib: int
    memory_slices: int
    instance_count: int
    sm: int
    copy_engines: int
    decoders: int
    encoders: int
    jpegs: int
    ofas: int
    starts: tuple[int, ...]  # valid placement starts, in memory slices

    @property
    def placements(self) -> tuple[tuple[int, int], ...]:
        return tuple((s, self.memory_slices) for s in self.starts)


@dataclass(frozen=True, slots=True)
class CiProfileSpec:
    """One row of ``nvidia-smi mig -lcip`` for a GPU instance profile."""

    constant: int  # NVML_COMPUTE_INSTANCE_PROFILE_*; NVML returns it as the id too
    name: str  # "1c.3g.40gb", or "3g.40gb" for the full-size compute instance
    slices: int
    instance_count: int
    sm: int


# 615 MiB of an H200's 143771 with no process running (driver 580.159.04, MIG mode off)
RESERVED_FRACTION = 615 / 143771


@dataclass(frozen=True, slots=True)
class ProductSpec:
    key: str  # gpud's product key, e.g. "H100-SXM5-80GB"
    nvml_name: str  # nvmlDeviceGetName
    pci_device_id: int  # nvmlDeviceGetPciInfo().pciDeviceId (device << 16 | 0x10DE)
    memory_mib: int  # nvmlDeviceGetMemoryInfo().total / MiB
    sm_count: int
    sm_clock_max_mhz: int
    sm_clock_idle_mhz: int
    mem_clock_mhz: int
    power_limit_w: int  # TDP
    power_idle_w: int
    nvlink_gbps: int  # per direction, whole GPU
    nvlink_links: int  # NVLink links (12 on A100, 18 on H100/H200)
    pcie_gen: int  # the host link's generation (nvmlDeviceGetMaxPcieLinkGeneration)
    pcie_lanes: int  # and width (nvmlDeviceGetMaxPcieLinkWidth)
    mig_profiles: tuple[GiProfileSpec, ...]
    # A MIG mode change waits for a GPU reset (A100); Hopper and later switch at once when
    # no process holds the GPU (NVML then reports the new current mode).
    mig_mode_needs_reset: bool

    @property
    def reserved_mib(self) -> int:
        """What the driver and firmware keep of the memory with no process running
        (``nvmlMemory_v2_t.reserved``, counted in ``used`` by both versions of
        nvmlDeviceGetMemoryInfo): 615 MiB on an H200 (driver 580.159.04), the same fraction
        of the others' memory."""
        return round(self.memory_mib * RESERVED_FRACTION)

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig_profiles)

    def gi_profile_by_constant(self, constant: int) -> GiProfileSpec | None:
        for p in self.mig_profiles:
            if p.constant == constant:
                return p
        return None

    def gi_profile_by_id(self, profile_id: int) -> GiProfileSpec | None:
        for p in self.mig_profiles:
            if p.id == profile_id:
                return p
        return None

    def ci_profiles(self, gi: GiProfileSpec) -> tuple[CiProfileSpec, ...]:
        """``nvidia-smi mig -lcip`` for a GPU instance of profile ``gi``."""
        # SMs of a c-slice compute instance: what the c-slice GPU instance profile has
        # (the 3-slice partition carries extra SMs on H100: 60, not 3 x 16).
        regular = (GI_1_SLICE, GI_2_SLICE, GI_3_SLICE, GI_4_SLICE, GI_7_SLICE)
        sm_by_slices = {p.slices: p.sm for p in self.mig_profiles if p.constant in regular}
        out = []
        for c, constant in CI_CONSTANT_BY_SLICES.items():
            if c > gi.slices:
                continue
            if c == gi.slices:
                out.append(CiProfileSpec(constant, gi.name, c, 1, gi.sm))
                continue
            count = sum(1 for s in CI_STARTS[c] if s + c <= gi.slices)
            out.append(
                CiProfileSpec(
                    constant,
                    f"{c}c.{gi.name}",
                    c,
                    count,
                    sm_by_slices.get(c, c * gi.sm // gi.slices),
                )
            )
        return tuple(out)


def _gi(  # noqa: PLR0917 - one positional row per `nvidia-smi mig -lgip` line
    constant: int,
    pid: int,
    name: str,
    slices: int,
    memory_mib: int,
    memory_slices: int,
    instances: int,
    sm: int,
    ce: int,
    dec: int,
    jpeg: int,
    ofa: int,
    starts: tuple[int, ...],
) -> GiProfileSpec:
    return GiProfileSpec(
        constant,
        pid,
        name,
        slices,
        memory_mib,
        memory_slices,
        instances,
        sm,
        ce,
        dec,
        0,
        jpeg,
        ofa,
        starts,
    )


_S1 = (0, 1, 2, 3, 4, 5, 6)
_S2M = (0, 2, 4, 6)
_S2 = (0, 2, 4)
_S3 = (0, 4)
_S0 = (0,)


def _a100(mem: tuple[int, int, int, int, int], names: tuple[str, ...]) -> tuple[GiProfileSpec, ...]:
    # A100: 14 SMs per slice (98 in 7g); JPEG/OFA only on +me and 7g (nvidia-smi mig -lgip).
    m1, m2, m4, m4b, m8 = mem
    return (
        _gi(GI_1_SLICE, 19, names[0], 1, m1, 1, 7, 14, 1, 0, 0, 0, _S1),
        _gi(GI_1_SLICE_REV1, 20, names[1], 1, m1, 1, 1, 14, 1, 1, 1, 1, _S1),
        _gi(GI_1_SLICE_REV2, 15, names[2], 1, m2, 2, 4, 14, 1, 1, 0, 0, _S2M),
        _gi(GI_2_SLICE, 14, names[3], 2, m2, 2, 3, 28, 2, 1, 0, 0, _S2),
        _gi(GI_3_SLICE, 9, names[4], 3, m4, 4, 2, 42, 3, 2, 0, 0, _S3),
        _gi(GI_4_SLICE, 5, names[5], 4, m4b, 4, 1, 56, 4, 2, 0, 0, _S0),
        _gi(GI_7_SLICE, 0, names[6], 7, m8, 8, 1, 98, 7, 5, 1, 1, _S0),
    )


def _hopper(mem: tuple[int, int, int, int], names: tuple[str, ...]) -> tuple[GiProfileSpec, ...]:
    # H100/H200 (132 SMs): 16 SMs per 1g, 26 in the two-memory-slice 1g, 60 in 3g;
    # one NVDEC and one NVJPG per slice, 8 copy engines and the OFA in 7g.
    m1, m2, m4, m8 = mem
    return (
        _gi(GI_1_SLICE, 19, names[0], 1, m1, 1, 7, 16, 1, 1, 1, 0, _S1),
        _gi(GI_1_SLICE_REV1, 20, names[1], 1, m1, 1, 1, 16, 1, 1, 1, 1, _S1),
        _gi(GI_1_SLICE_REV2, 15, names[2], 1, m2, 2, 4, 26, 1, 1, 1, 0, _S2M),
        _gi(GI_2_SLICE, 14, names[3], 2, m2, 2, 3, 32, 2, 2, 2, 0, _S2),
        _gi(GI_3_SLICE, 9, names[4], 3, m4, 4, 2, 60, 3, 3, 3, 0, _S3),
        _gi(GI_4_SLICE, 5, names[5], 4, m4, 4, 1, 64, 4, 4, 4, 0, _S0),
        _gi(GI_7_SLICE, 0, names[6], 7, m8, 8, 1, 132, 8, 7, 7, 1, _S0),
    )


PRODUCTS: dict[str, ProductSpec] = {
    p.key: p
    for p in (
        ProductSpec(
            key="A100-SXM4-40GB",
            nvml_name="NVIDIA A100-SXM4-40GB",
            pci_device_id=0x20B010DE,
            memory_mib=40960,
            sm_count=108,
            sm_clock_max_mhz=1410,
            sm_clock_idle_mhz=210,
            mem_clock_mhz=1215,
            power_limit_w=400,
            power_idle_w=55,
            nvlink_gbps=300,
            nvlink_links=12,
            pcie_gen=4,
            pcie_lanes=16,
            mig_profiles=_a100(
                (4864, 9856, 19968, 19968, 40192),
                ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
            ),
            mig_mode_needs_reset=True,
        ),
        ProductSpec(
            key="A100-SXM4-80GB",
            nvml_name="NVIDIA A100-SXM4-80GB",
            pci_device_id=0x20B210DE,
            memory_mib=81920,
            sm_count=108,
            sm_clock_max_mhz=1410,
            sm_clock_idle_mhz=210,
            mem_clock_mhz=1593,
            power_limit_w=400,
            power_idle_w=60,
            nvlink_gbps=300,
            nvlink_links=12,
            pcie_gen=4,
            pcie_lanes=16,
            mig_profiles=_a100(
                (9984, 19968, 40192, 40192, 80384),
                ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
            ),
            mig_mode_needs_reset=True,
        ),
        ProductSpec(
            key="H100-SXM5-80GB",
            nvml_name="NVIDIA H100 80GB HBM3",
            pci_device_id=0x233010DE,
            memory_mib=81559,
            sm_count=132,
            sm_clock_max_mhz=1980,
            sm_clock_idle_mhz=345,
            mem_clock_mhz=2619,
            power_limit_w=700,
            power_idle_w=70,
            nvlink_gbps=450,
            nvlink_links=18,
            pcie_gen=5,
            pcie_lanes=16,
            mig_profiles=_hopper(
                (9984, 20096, 40448, 81152),
                ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
            ),
            mig_mode_needs_reset=False,
        ),
        ProductSpec(
            key="H200-SXM-141GB",
            nvml_name="NVIDIA H200",
            pci_device_id=0x233510DE,
            memory_mib=143771,
            sm_count=132,
            sm_clock_max_mhz=1980,
            sm_clock_idle_mhz=345,
            mem_clock_mhz=3201,
            power_limit_w=700,
            power_idle_w=75,
            nvlink_gbps=450,
            nvlink_links=18,
            pcie_gen=5,
            pcie_lanes=16,
            mig_profiles=_hopper(
                (16384, 33280, 71424, 143360),
                ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
            ),
            mig_mode_needs_reset=False,
        ),
    )
}


def _norm(text: str) -> str:
    return "".join(ch for ch in text.upper() if ch.isalnum())


# NVML names (and a few spellings people use) -> product key, compared without
# punctuation or case: "NVIDIA H100 80GB HBM3", "h100-sxm5-80gb", "H200".
_ALIASES: dict[str, str] = {
    **{_norm(k): k for k in PRODUCTS},
    **{_norm(p.nvml_name): p.key for p in PRODUCTS.values()},
    _norm("H100-80GB"): "H100-SXM5-80GB",
    _norm("H200-141GB"): "H200-SXM-141GB",
    _norm("H200"): "H200-SXM-141GB",
    _norm("H200-SXM5-141GB"): "H200-SXM-141GB",
}


def lookup(name: str) -> ProductSpec | None:
    """The product called ``name`` (gpud key or NVML name, any case), or None."""
    key = _ALIASES.get(_norm(name))
    return PRODUCTS[key] if key else None


def product_key_for(nvml_name: str, memory_total_bytes: int) -> str | None:
    """gpud's product key for a device NVML names ``nvml_name`` with that much memory.

    NVML names do not always carry the memory size ("NVIDIA H200"), and some share a name
    across sizes, so the memory total breaks ties.
    """
    mib = memory_total_bytes // (1024 * 1024)
    target = _norm(nvml_name)
    best: ProductSpec | None = None
    for p in PRODUCTS.values():
        if _norm(p.nvml_name) != target:
            continue
        if best is None or abs(p.memory_mib - mib) < abs(best.memory_mib - mib):
            best = p
    return best.key if best else None


def mig_profile_names(product: ProductSpec) -> tuple[str, ...]:
    """The MIG profiles a job may name on ``product``: its GPU instance profiles
    (``nvidia-smi mig -lgip``), then their compute instance profiles (``-lcip``)."""
    names = [gi.name for gi in product.mig_profiles]
    names += [ci.name for gi in product.mig_profiles for ci in product.ci_profiles(gi)]
    return tuple(dict.fromkeys(names))


# Every MIG profile of a product gpud knows: a name outside it is no MIG device on any of them.
KNOWN_MIG_PROFILES: frozenset[str] = frozenset(
    name for p in PRODUCTS.values() for name in mig_profile_names(p)
)
