"""NVIDIA GPUs, through NVML (the `pynvml` module of nvidia-ml-py).

A node without the NVML library, or with the library but no driver, is a node without
NVIDIA GPUs, not a failed discovery: the seed agent treated a missing nvidia-smi as an
error, and that cut discovery short before InfiniBand on every CPU node. So nothing NVML
does makes this raise; the outcome is in `Gpus.status`.

Besides what a GPU is, what it is doing: memory used, the processes holding it (named and
told apart, own engine or not, by a `ProcessLookup` the caller gives), and NVML's memory
fault counters, which stay set until a reset (double-bit ECC, Xid 48; pages or rows waiting
to be retired or remapped, Xid 63/64): a level-triggered reader sees them at any probe. The
faults that leave no counter come as Xid events, waited for in `xid.py`.

A card whose MIG mode is on is listed as its MIG devices, each a GPU of its own (its own
UUID, memory, slices and processes; its parent named), because that is what CUDA runs on.
The layout is the operator's (`nvidia-smi mig`): llmgw reads it as it reads storage.
"""

from __future__ import annotations

import logging
import re
from types import ModuleType
from typing import Any, Protocol

from llmgw.bus.records import MAX_GPU_PROCESSES, Gpu, GpuErrors, GpuProcess, Gpus

log = logging.getLogger(__name__)


def _text(value: str | bytes) -> str:
    # pynvml before 11.5 returned bytes for every string
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _load_pynvml() -> ModuleType:
    import pynvml  # lazily: the agent imports this module on nodes that have no GPUs

    return pynvml


def _error_name(exc: BaseException) -> str:
    return type(exc).__name__


class ProcessLookup(Protocol):
    """What NVML does not say about a process: its name, and whether it is one of this
    agent's engines (llmgw.agent.discovery.processes.HostProcesses reads both)."""

    def name(self, pid: int) -> str: ...

    def own(self, pid: int) -> bool: ...

    def engine(self, pid: int) -> int | None:
        """The pid of the first process (its group) of the engine `pid` is proven part of,
        or None."""
        ...


class _Unknown:
    def name(self, pid: int) -> str:
        return ""

    def own(self, pid: int) -> bool:
        return False

    def engine(self, pid: int) -> int | None:
        return None


def _devices(nvml: Any, index: int, lookup: ProcessLookup) -> list[Gpu]:
    """The GPU at `index`, or, when its MIG mode is on, its MIG devices instead."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    gpu = _device(nvml, handle, index, lookup)
    if not _mig_enabled(nvml, handle):
        return [gpu]
    return _mig_devices(nvml, handle, gpu, lookup)


def _device(nvml: Any, handle: Any, index: int, lookup: ProcessLookup) -> Gpu:
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    listed, unlisted, unlisted_bytes = _processes(nvml, handle, index, lookup)
    return Gpu(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(handle)),
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        memory_total_bytes=int(memory.total),
        pci_bus_id=_text(nvml.nvmlDeviceGetPciInfo(handle).busId),
        compute_capability=f"{major}.{minor}",
        memory_used_bytes=int(memory.used),
        processes=listed,
        processes_unlisted=unlisted,
        unlisted_foreign_bytes=unlisted_bytes,
        errors=_errors(nvml, handle),
    )


def _mig_enabled(nvml: Any, handle: Any) -> bool:
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except (nvml.NVMLError, AttributeError):  # not a MIG GPU (NOT_SUPPORTED), or old pynvml
        return False
    # a pending change needs a GPU reset to apply: what runs now is the current mode
    return bool(current == nvml.NVML_DEVICE_MIG_ENABLE)


# "NVIDIA H200 MIG 1g.18gb", "NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb": the profile is the last word
_MIG_PROFILE = re.compile(r"(?:\d+c\.)?(\d+g\.\d+gb(?:\+\w+)?)$")


def _mig_devices(nvml: Any, parent_handle: Any, parent: Gpu, lookup: ProcessLookup) -> list[Gpu]:
    """The MIG devices the operator made of `parent`, each a GPU of its own: its UUID (what
    CUDA_VISIBLE_DEVICES takes), memory, slices and processes; the parent's fault counters,
    which are the card's. Empty slots answer NOT_FOUND and are skipped; a MIG GPU without
    any MIG device runs nothing at all, so nothing is listed for it."""
    out: list[Gpu] = []
    for slot in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(parent_handle))):
        try:
            handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent_handle, slot)
        except nvml.NVMLError_NotFound:
            continue
        name = _text(nvml.nvmlDeviceGetName(handle))
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        listed, unlisted, unlisted_bytes = _processes(nvml, handle, parent.index, lookup)
        attributes = _optional(nvml, nvml.nvmlDeviceGetAttributes, handle)
        profile = _MIG_PROFILE.search(name)
        out.append(
            Gpu(
                index=parent.index,
                name=name,
                uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                memory_total_bytes=int(memory.total),
                pci_bus_id=parent.pci_bus_id,
                compute_capability=parent.compute_capability,
                memory_used_bytes=int(memory.used),
                processes=listed,
                processes_unlisted=unlisted,
                unlisted_foreign_bytes=unlisted_bytes,
                errors=parent.errors,
                mig_profile=profile.group(1) if profile else name.rsplit(" ", 1)[-1],
                parent_uuid=parent.uuid,
                mig_slices=int(attributes.gpuInstanceSliceCount) if attributes else 0,
            )
        )
    if not out:
        log.info("GPU %d: MIG mode is on and no MIG device is configured", parent.index)
    return out


def _processes(
    nvml: Any, handle: Any, index: int, lookup: ProcessLookup
) -> tuple[list[GpuProcess], int, int]:
    """Compute and graphics processes, one entry per pid, foreign ones first and then the
    largest, at most MAX_GPU_PROCESSES; and how many more, and the memory of the foreign
    ones among them."""
    used: dict[int, int | None] = {}
    for call in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            found = getattr(nvml, call)(handle)
        except nvml.NVMLError as exc:
            # asked every probe: said at debug level, the GPU itself is still reported
            log.debug("GPU %d: %s failed: %s (%s)", index, call, exc, _error_name(exc))
            continue
        for proc in found:
            pid, nbytes = int(proc.pid), proc.usedGpuMemory
            before = used.get(pid)
            # a process with both kinds of context is listed in both, with the same memory
            used[pid] = nbytes if before is None else max(before, nbytes or 0)
    everyone = []
    for pid, nbytes in used.items():
        engine = lookup.engine(pid)
        everyone.append(
            GpuProcess(
                pid=pid,
                name=lookup.name(pid),
                used_bytes=None if nbytes is None else int(nbytes),
                own=engine is not None or lookup.own(pid),
                engine=engine,
            )
        )
    everyone.sort(key=lambda p: (p.own, -(p.used_bytes or 0), p.pid))
    rest = everyone[MAX_GPU_PROCESSES:]
    foreign_rest = sum(p.used_bytes or 0 for p in rest if not p.own)
    return everyone[:MAX_GPU_PROCESSES], len(rest), foreign_rest


def _optional(nvml: Any, read: Any, *args: Any) -> Any:
    # None where the GPU does not support the counter (row remapping before Ampere, page
    # retirement from Ampere on, ECC on GPUs without it) or NVML refuses it
    try:
        return read(*args)
    except nvml.NVMLError:
        return None


def _errors(nvml: Any, handle: Any) -> GpuErrors:
    ecc = _optional(
        nvml,
        nvml.nvmlDeviceGetTotalEccErrors,
        handle,
        nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        nvml.NVML_VOLATILE_ECC,
    )
    retired = _optional(nvml, nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    rows = _optional(nvml, nvml.nvmlDeviceGetRemappedRows, handle)
    return GpuErrors(
        ecc_uncorrected_volatile=None if ecc is None else int(ecc),
        retired_pages_pending=None if retired is None else retired == nvml.NVML_FEATURE_ENABLED,
        remapped_rows_pending=None if rows is None else bool(rows[2]),
        remapping_failed=None if rows is None else bool(rows[3]),
    )


def discover_gpus(nvml: Any = None, processes: ProcessLookup | None = None) -> Gpus:
    """Every GPU NVML sees, in NVML order (PCI bus order, regardless of CUDA_VISIBLE_DEVICES).

    `nvml` is the pynvml module (imported here when None) or anything answering like it,
    which is how tests feed recorded answers; `processes` names the processes holding GPU
    memory and tells the agent's own engines (None: unnamed, none own). Blocking (NVML can
    take seconds to initialise on a node with many GPUs): the caller runs it in a worker
    thread (anyio.to_thread.run_sync).

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
        return _inventory(nvml, processes or _Unknown())
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as exc:
            log.warning("nvmlShutdown failed: %s", exc)


def _inventory(nvml: Any, lookup: ProcessLookup) -> Gpus:
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
            devices.extend(_devices(nvml, index, lookup))
        except nvml.NVMLError as exc:
            # one lost GPU must not hide the seven that work; the status says not all is well
            failures.append(f"GPU {index}: {exc} ({_error_name(exc)})")
    if failures:
        detail = f"{len(failures)} of {count} GPUs did not answer NVML: " + "; ".join(failures)
        log.warning("%s", detail)
        return Gpus(status="error", detail=detail, driver_version=driver, devices=devices)
    return Gpus(status="ok", driver_version=driver, devices=devices)
