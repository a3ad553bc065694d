"""What links a GPU to host memory: PCIe, or a coherent link (NVLink-C2C) where the GPU reads host
memory through the CPU's page tables.

Two witnesses, both asked once per device and cached:

- NVML (``nvidia-ml-py``): ``nvmlDeviceGetC2cModeInfoV`` says whether C2C is enabled; the PCIe
  generation and width describe a PCIe link.
- Device attributes (``cuda-bindings``): a coherent link gives both host-native atomics and
  pageable-memory access through the host's page tables.

NVML's answer wins where it has one; otherwise the attributes decide. With neither package the
link is reported as "unknown" and treated as not coherent.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

LinkKind = Literal["cpu", "pcie", "nvlink-c2c", "unknown"]


@dataclass(frozen=True, slots=True)
class LinkInfo:
    """The host link of one device. ``coherent`` is what the copy policy is given."""

    kind: LinkKind
    coherent: bool
    detail: str
    source: str

    @classmethod
    def cpu(cls) -> LinkInfo:
        return cls(kind="cpu", coherent=False, detail="no GPU: host memory only", source="device")


@functools.cache
def detect_link(device_index: int) -> LinkInfo:
    """The link between CUDA device ``device_index`` and host memory (cached per device)."""
    nvml = _link_from_nvml(device_index)
    if nvml is not None:
        return nvml
    attributes = _coherence_from_attributes(device_index)
    if attributes is None:
        return LinkInfo(kind="unknown", coherent=False, detail="neither NVML nor cuda-bindings answered", source="none")
    if attributes:
        return LinkInfo(
            kind="nvlink-c2c", coherent=True, detail="host page tables + native atomics", source="attributes"
        )
    return LinkInfo(kind="pcie", coherent=False, detail="no host page-table access", source="attributes")


def _cu_device(device_index: int) -> Any:
    from cuda.bindings import driver

    (err,) = driver.cuInit(0)
    if int(err):
        raise RuntimeError(f"cuInit failed with CUresult {int(err)}")
    err, device = driver.cuDeviceGet(device_index)
    if int(err):
        raise RuntimeError(f"cuDeviceGet({device_index}) failed with CUresult {int(err)}")
    return device


def _coherence_from_attributes(device_index: int) -> bool | None:
    """True when the device reaches pageable host memory coherently; None if it cannot be asked."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    device = _cu_device(device_index)
    names = (
        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED,
        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES,
    )
    values = []
    for name in names:
        err, value = driver.cuDeviceGetAttribute(name, device)
        if int(err):
            return None
        values.append(value)
    return all(values)


def _link_from_nvml(device_index: int) -> LinkInfo | None:
    """The link as NVML sees it, or None when NVML or cuda-bindings is missing or cannot tell."""
    try:
        import pynvml
        from cuda.bindings import driver
    except ImportError:
        return None
    err, bus_id = driver.cuDeviceGetPCIBusId(32, _cu_device(device_index))
    if int(err):
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        bus = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus.rstrip("\0"))
        try:
            c2c = bool(pynvml.nvmlDeviceGetC2cModeInfoV(handle).isC2cEnabled)
        except (pynvml.NVMLError, AttributeError):
            c2c = False
        if c2c:
            return LinkInfo(kind="nvlink-c2c", coherent=True, detail="C2C enabled", source="nvml")
        try:
            generation = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)
            width = pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)
            detail = f"PCIe gen{generation} x{width}"
        except pynvml.NVMLError:
            detail = "PCIe"
        return LinkInfo(kind="pcie", coherent=False, detail=detail, source="nvml")
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()
