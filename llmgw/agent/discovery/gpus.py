"""NVIDIA GPUs, through NVML (the `pynvml` module of nvidia-ml-py).

A node without the NVML library, or with the library but no driver, is a node without
NVIDIA GPUs, not a failed discovery: the seed agent treated a missing nvidia-smi as an
error, and that cut discovery short before InfiniBand on every CPU node. So nothing NVML
does makes this raise; the outcome is in `Gpus.status`.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from llmgw.bus.records import Gpu, Gpus

log = logging.getLogger(__name__)


def _text(value: str | bytes) -> str:
    # pynvml before 11.5 returned bytes for every string
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _load_pynvml() -> ModuleType:
    import pynvml  # lazily: the agent imports this module on nodes that have no GPUs

    return pynvml


def _error_name(exc: BaseException) -> str:
    return type(exc).__name__


def _device(nvml: Any, index: int) -> Gpu:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    return Gpu(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(handle)),
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        memory_total_bytes=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
        pci_bus_id=_text(nvml.nvmlDeviceGetPciInfo(handle).busId),
        compute_capability=f"{major}.{minor}",
    )


def discover_gpus(nvml: Any = None) -> Gpus:
    """Every GPU NVML sees, in NVML order (PCI bus order, regardless of CUDA_VISIBLE_DEVICES).

    `nvml` is the pynvml module (imported here when None) or anything answering like it,
    which is how tests feed recorded answers. Blocking (NVML can take seconds to
    initialise on a node with many GPUs): the caller runs it in a worker thread
    (anyio.to_thread.run_sync).

    Status: "ok"; "no_library" (libnvidia-ml.so not found: no NVIDIA driver installed);
    "no_driver" (library present, kernel module not loaded); "error" (any other NVML
    failure, or one device that would not answer: `devices` keeps those that did and
    `detail` names the rest). Never raises for NVML problems.
    """
    if nvml is None:
        try:
            nvml = _load_pynvml()
        except ImportError as exc:
            return Gpus(status="no_library", detail=f"pynvml is not installed: {exc}")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError_LibraryNotFound as exc:
        return Gpus(status="no_library", detail=f"NVML library not found ({exc})")
    except nvml.NVMLError_DriverNotLoaded as exc:
        return Gpus(status="no_driver", detail=f"NVIDIA driver not loaded ({exc})")
    except nvml.NVMLError as exc:
        log.warning("NVML failed to initialise: %s (%s)", exc, _error_name(exc))
        return Gpus(status="error", detail=f"nvmlInit: {exc} ({_error_name(exc)})")
    try:
        return _inventory(nvml)
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as exc:
            log.warning("nvmlShutdown failed: %s", exc)


def _inventory(nvml: Any) -> Gpus:
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        count = int(nvml.nvmlDeviceGetCount())
    except nvml.NVMLError as exc:
        log.warning("NVML could not list GPUs: %s (%s)", exc, _error_name(exc))
        return Gpus(status="error", detail=f"{exc} ({_error_name(exc)})")
    devices: list[Gpu] = []
    failures: list[str] = []
    for index in range(count):
        try:
            devices.append(_device(nvml, index))
        except nvml.NVMLError as exc:
            # one lost GPU must not hide the seven that work; the status says not all is well
            failures.append(f"GPU {index}: {exc} ({_error_name(exc)})")
    if failures:
        detail = f"{len(failures)} of {count} GPUs did not answer NVML: " + "; ".join(failures)
        log.warning("%s", detail)
        return Gpus(status="error", detail=detail, driver_version=driver, devices=devices)
    return Gpus(status="ok", driver_version=driver, devices=devices)
