"""PCIe and NVLink throughput of a GPU as fractions of its links, for the interference
predictor's ``pcie`` and ``nvlink`` features.

PCIe: ``nvmlDeviceGetPcieThroughput`` (``nvidia-smi dmon -s t``) gives bytes/s each way
over the driver's last 20 ms; the busier direction over the link's capacity per direction
is the fraction (PCIe is full duplex: a link saturates one direction at a time). The
capacity is the link NVML reports (``nvidia-smi -q`` "GPU Link Info", max generation and
width, :attr:`GpuIdentity.pcie_link_gen`), else the product's link
(:mod:`gpud.backend.products`), else Gen4 x16.

NVLink: the data counters (``nvidia-smi nvlink -gt d``, summed over the links) grow by what
was sent and received; their growth between two samples over the time between them, the
busier direction again, over the product's NVLink bandwidth per direction. A GPU of an
unknown product has no known NVLink bandwidth and reads 0.

Nothing here raises: a reading that is missing or not supported is 0.
"""

from __future__ import annotations

from gpud.backend import products
from gpud.backend.port import GpuIdentity, PcieThroughput
from gpud.telemetry.snapshot import GpuSample


def pcie_capacity(identity: GpuIdentity) -> float:
    """Bytes/s per direction of the GPU's PCIe link."""
    if identity.pcie_link_gen is not None and identity.pcie_link_width is not None:
        cap = products.pcie_bytes_per_second(identity.pcie_link_gen, identity.pcie_link_width)
        if cap is not None:
            return cap
    spec = products.PRODUCTS.get(identity.product)
    if spec is not None:
        cap = products.pcie_bytes_per_second(spec.pcie_gen, spec.pcie_lanes)
        if cap is not None:
            return cap
    default = products.pcie_bytes_per_second(products.DEFAULT_PCIE_GEN, products.DEFAULT_PCIE_LANES)
    assert default is not None
    return default


def nvlink_capacity(identity: GpuIdentity) -> float | None:
    """Bytes/s per direction over all the GPU's NVLinks; None for a product gpud does not
    know (or one without NVLink)."""
    spec = products.PRODUCTS.get(identity.product)
    if spec is None or spec.nvlink_gbps <= 0:
        return None
    return spec.nvlink_gbps * 1e9


def pcie_ratio(pcie: PcieThroughput | None, capacity: float) -> float:
    """The busier direction of ``pcie`` over ``capacity``, within 0..1; 0 without a reading."""
    if pcie is None or capacity <= 0:
        return 0.0
    busier = max(pcie.tx_bytes_per_second, pcie.rx_bytes_per_second)
    return min(1.0, max(0.0, busier / capacity))


class NvlinkRates:
    """Each GPU's NVLink throughput over its capacity, from the growth of its counters
    between the samples it is given (one per GPU and tick)."""

    def __init__(self) -> None:
        # GPU -> (sampled_at, tx, rx) of its last counters, and the ratio they gave
        self._last: dict[int, tuple[float, int, int]] = {}
        self._ratio: dict[int, float] = {}

    def ratio(self, sample: GpuSample) -> float | None:
        """The GPU's NVLink throughput since its previous sample, over its capacity (0..1);
        None until two samples of its counters were seen. 0 where the counters are not
        read or the capacity is unknown."""
        index = sample.identity.index
        counters = sample.nvlink_bytes
        cap = nvlink_capacity(sample.identity)
        if counters is None or cap is None:
            self._last.pop(index, None)
            self._ratio.pop(index, None)
            return 0.0
        last = self._last.get(index)
        if last is not None and last[0] == sample.sampled_at:
            return self._ratio.get(index)  # the same sample again
        self._last[index] = (sample.sampled_at, counters[0], counters[1])
        if last is None:
            return None
        dt = sample.sampled_at - last[0]
        dtx, drx = counters[0] - last[1], counters[1] - last[2]
        if dt <= 0 or dtx < 0 or drx < 0:
            # counters restarted (a driver reload, a reset): measure afresh from here
            self._ratio.pop(index, None)
            return None
        ratio = min(1.0, max(dtx, drx) / dt / cap)
        self._ratio[index] = ratio
        return ratio
