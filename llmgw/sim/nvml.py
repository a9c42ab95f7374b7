"""Answers like the pynvml module, recorded from an 8x H100 80GB HBM3 node (DGX-H100
layout: PCI order 18, 2a, 3a, 5d, 9a, ab, ba, db), driver 550.54.15.

Idle, each GPU reports 555,745,280 bytes used (the driver's own) and no process; what runs
on it is given per GPU (`processes`, `graphics`: pid and usedGpuMemory, None as pynvml
gives for NVML_VALUE_NOT_AVAILABLE) and adds to its used memory. Fault counters as a
Hopper GPU answers them: uncorrected volatile ECC errors (0 unless given), remapped rows
(none pending unless given), and page retirement NOT_SUPPORTED (replaced by row remapping
from Ampere on).

Errors are pynvml's own exception classes, raised the way pynvml raises them
(`NVMLError(code)` maps the code to its subclass), so `except NVMLError_DriverNotLoaded`
in the code under test is exercised exactly as on a real node.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pynvml

H100_NAME = "NVIDIA H100 80GB HBM3"
H100_MEMORY_TOTAL = 85_520_809_984  # 81559 MiB, as nvmlDeviceGetMemoryInfo reports it
DRIVER_VERSION = "550.54.15"

H100_UUIDS = [
    "GPU-5f0b3c2e-8a1d-4c7e-9b2a-1e3d4f5a6b7c",
    "GPU-a1c9e8d2-3b4f-5a6e-7d8c-9f0e1a2b3c4d",
    "GPU-0d7e6f5a-4b3c-2d1e-0f9a-8b7c6d5e4f3a",
    "GPU-c3b2a190-8f7e-6d5c-4b3a-29180f7e6d5c",
    "GPU-7a8b9c0d-1e2f-3a4b-5c6d-7e8f9a0b1c2d",
    "GPU-e4d3c2b1-a0f9-e8d7-c6b5-a4938271605f",
    "GPU-2b3c4d5e-6f7a-8b9c-0d1e-2f3a4b5c6d7e",
    "GPU-9e8d7c6b-5a4f-3e2d-1c0b-a9f8e7d6c5b4",
]
H100_BUS_IDS = [
    "00000000:18:00.0",
    "00000000:2A:00.0",
    "00000000:3A:00.0",
    "00000000:5D:00.0",
    "00000000:9A:00.0",
    "00000000:AB:00.0",
    "00000000:BA:00.0",
    "00000000:DB:00.0",
]


# An H200 (141 GB) and the MIG profiles its driver offers, with the memory each MIG device
# reports and its slices of 7. The sizes are approximate (the driver's, within a few
# percent): what the tests read is that they differ and add up below the card's.
H200_NAME = "NVIDIA H200"
H200_MEMORY_TOTAL = 150_754_820_096  # 143,771 MiB, as measured on a real H200
_MIB = 1024 * 1024
H200_MIG = {
    "1g.18gb": (16_640 * _MIB, 1),
    "1g.35gb": (33_280 * _MIB, 1),
    "2g.35gb": (33_280 * _MIB, 2),
    "3g.71gb": (67_072 * _MIB, 3),
    "4g.71gb": (67_072 * _MIB, 4),
    "7g.141gb": (140_800 * _MIB, 7),
}
MIG_RESERVED = 12_582_912  # what an idle MIG device reports used


@dataclass(frozen=True)
class _MigHandle:  # a MIG device: its parent's index and its slot there
    gpu: int
    slot: int


@dataclass
class _Attributes:  # pynvml's c_nvmlDeviceAttributes_t, the fields the agent reads
    gpuInstanceSliceCount: int
    computeInstanceSliceCount: int
    memorySizeMB: int


@dataclass
class _MemoryInfo:
    total: int
    free: int
    used: int


@dataclass
class _ProcessInfo:  # pynvml's friendly object of c_nvmlProcessInfo_v3_t
    pid: int
    usedGpuMemory: int | None
    gpuInstanceId: int = 0xFFFFFFFF  # no MIG
    computeInstanceId: int = 0xFFFFFFFF


DRIVER_RESERVED = 555_745_280  # what an idle H100 reports used (reserved by the driver)

Held = list[tuple[int, int | None]]  # (pid, usedGpuMemory) on one GPU


@dataclass
class _EventData:  # pynvml's c_nvmlEventData_t, the fields the agent reads
    device: int
    eventType: int
    eventData: int


@dataclass
class _PciInfo:
    busId: bytes  # a ctypes char array: bytes, in every pynvml version
    busIdLegacy: bytes
    pciDeviceId: int


class RecordedNvml:
    """Answers like `pynvml` for a recorded node.

    init_error / failing_devices take NVML error codes (pynvml.NVML_ERROR_*), raised as
    pynvml does. old_bytes=True answers strings as bytes, like pynvml before 11.5.
    processes / graphics: per GPU index, the compute / graphics processes NVML lists.
    ecc_uncorrected: per GPU index, volatile uncorrected ECC errors; remapped_rows: per GPU
    index, nvmlDeviceGetRemappedRows' (corrected, uncorrected, pending, failure);
    process_error: an NVML error code the process lists answer with; unlisted_used: per GPU
    index, memory used that no process listed accounts for (NVML could not attribute it).
    name / memory_total: another model's answers in the same layout (simulated fleets).
    mig: per GPU index, MIG mode on with these MIG devices (H200_MIG profiles, in slot
    order); mig_processes: per (GPU index, slot), the processes of that MIG device."""

    def __init__(
        self,
        *,
        count: int = 8,
        init_error: int | None = None,
        count_error: int | None = None,
        failing_devices: dict[int, int] | None = None,
        old_bytes: bool = False,
        node: str | None = None,
        processes: dict[int, Held] | None = None,
        graphics: dict[int, Held] | None = None,
        ecc_uncorrected: dict[int, int] | None = None,
        remapped_rows: dict[int, tuple[int, int, int, int]] | None = None,
        process_error: int | None = None,
        unlisted_used: dict[int, int] | None = None,
        name: str = H100_NAME,
        memory_total: int = H100_MEMORY_TOTAL,
        xids: list[tuple[int, int]] | None = None,
        events_unsupported: set[int] | None = None,
        mig: dict[int, list[str]] | None = None,
        mig_processes: dict[tuple[int, int], Held] | None = None,
    ) -> None:
        if not 0 <= count <= len(H100_UUIDS):
            raise ValueError(f"a recorded node has 0 to {len(H100_UUIDS)} GPUs, not {count}")
        self.count = count
        # several simulated nodes on one machine need GPU UUIDs of their own
        self.node = node
        self.uuids = [f"GPU-{node}-{i}" for i in range(count)] if node else H100_UUIDS
        self.init_error = init_error
        self.count_error = count_error
        self.failing_devices = failing_devices or {}
        self.old_bytes = old_bytes
        self.processes = processes or {}
        self.graphics = graphics or {}
        self.ecc_uncorrected = ecc_uncorrected or {}
        self.remapped_rows = remapped_rows or {}
        self.process_error = process_error
        self.unlisted_used = unlisted_used or {}
        self.name = name
        self.memory_total = memory_total
        # Xid events (GPU index, Xid) delivered in this order, each once, to a session
        # waiting on an event set the GPU is registered with; GPUs that cannot register
        self.xids = list(xids or [])
        self.events_unsupported = events_unsupported or set()
        # per GPU index whose MIG mode is on, its MIG devices' profiles (H200_MIG) by slot,
        # and per (GPU, slot) the compute processes of that MIG device
        self.mig = mig or {}
        self.mig_processes = mig_processes or {}
        self.registered: set[int] = set()
        self.event_sets = 0  # created minus freed
        self.initialised = 0  # nvmlInit calls minus nvmlShutdown calls
        self.shutdowns = 0

    def __getattr__(self, name: str) -> Any:
        # the exception classes and constants are pynvml's own
        if name.startswith(("NVMLError", "NVML_")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    def _str(self, value: str) -> str | bytes:
        return value.encode() if self.old_bytes else value

    def _check_init(self) -> None:
        if self.initialised <= 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._check_init()
        self.initialised -= 1
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        self._check_init()
        return self._str(DRIVER_VERSION)

    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        if self.count_error is not None:
            raise pynvml.NVMLError(self.count_error)
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._check_init()
        if not 0 <= index < self.count:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if index in self.failing_devices:
            raise pynvml.NVMLError(self.failing_devices[index])
        return index  # a real handle is an opaque pointer; the index serves here

    def nvmlDeviceGetName(self, handle: int | _MigHandle) -> str | bytes:
        if isinstance(handle, _MigHandle):
            return self._str(f"{self.name} MIG {self._profile(handle)}")
        return self._str(self.name)

    def nvmlDeviceGetUUID(self, handle: int | _MigHandle) -> str | bytes:
        if isinstance(handle, _MigHandle) and self.node:
            return self._str(f"MIG-{self.node}-{handle.gpu}-{handle.slot}")
        if isinstance(handle, _MigHandle):
            # MIG UUIDs are of their own, not derived from the parent's
            return self._str(
                f"MIG-{handle.gpu:02d}{handle.slot:02d}0000-aaaa-5bbb-8ccc-{handle.gpu:012d}"
            )
        return self._str(self.uuids[handle])

    # --- MIG: what the operator configured (`nvidia-smi mig -cgi ... -C`) -----------------

    def _profile(self, handle: _MigHandle) -> str:
        return self.mig[handle.gpu][handle.slot]

    def devices(self) -> dict[str, tuple[int, int | None, int]]:
        """Every GPU CUDA could be given, by UUID: (index, MIG slot or None, memory)."""
        out: dict[str, tuple[int, int | None, int]] = {}
        for i in range(self.count):
            if i not in self.mig:
                out[self.uuids[i]] = (i, None, self.memory_total)
            for slot, profile in enumerate(self.mig.get(i, [])):
                uuid = self.nvmlDeviceGetUUID(_MigHandle(i, slot))
                out[uuid.decode() if isinstance(uuid, bytes) else uuid] = (
                    i,
                    slot,
                    H200_MIG[profile][0],
                )
        return out

    def nvmlDeviceGetMigMode(self, handle: int) -> tuple[int, int]:
        on = pynvml.NVML_DEVICE_MIG_ENABLE if handle in self.mig else pynvml.NVML_DEVICE_MIG_DISABLE
        return (on, on)  # (current, pending)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: int) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: int, slot: int) -> _MigHandle:
        if slot >= len(self.mig.get(handle, [])):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return _MigHandle(handle, slot)

    def nvmlDeviceGetAttributes(self, handle: _MigHandle) -> _Attributes:
        if not isinstance(handle, _MigHandle):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        total, slices = H200_MIG[self._profile(handle)]
        return _Attributes(slices, slices, total // _MIB)

    def nvmlDeviceGetMemoryInfo(self, handle: int | _MigHandle) -> _MemoryInfo:
        if isinstance(handle, _MigHandle):
            held = self.mig_processes.get((handle.gpu, handle.slot), [])
            total = H200_MIG[self._profile(handle)][0]
            used = MIG_RESERVED + sum(n or 0 for _, n in held)
            return _MemoryInfo(total=total, free=total - used, used=used)
        held = self.processes.get(handle, []) + self.graphics.get(handle, [])
        used = DRIVER_RESERVED + sum(n or 0 for _, n in held) + self.unlisted_used.get(handle, 0)
        total = self.memory_total
        return _MemoryInfo(total=total, free=total - used, used=used)

    def _listed(self, held: Held) -> list[_ProcessInfo]:
        if self.process_error is not None:
            raise pynvml.NVMLError(self.process_error)
        return [_ProcessInfo(pid=pid, usedGpuMemory=n) for pid, n in held]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int | _MigHandle) -> list[_ProcessInfo]:
        if isinstance(handle, _MigHandle):
            return self._listed(self.mig_processes.get((handle.gpu, handle.slot), []))
        return self._listed(self.processes.get(handle, []))

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int | _MigHandle) -> list[_ProcessInfo]:
        if isinstance(handle, _MigHandle):
            return []  # no graphics on a MIG device
        return self._listed(self.graphics.get(handle, []))

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter: int) -> int:
        if (error_type, counter) != (
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            pynvml.NVML_VOLATILE_ECC,
        ):
            return 0
        return self.ecc_uncorrected.get(handle, 0)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # Hopper remaps rows instead

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, int, int]:
        return self.remapped_rows.get(handle, (0, 0, 0, 0))

    def nvmlDeviceGetPciInfo(self, handle: int) -> _PciInfo:
        bus = H100_BUS_IDS[handle]
        return _PciInfo(busId=bus.encode(), busIdLegacy=bus[4:].encode(), pciDeviceId=0x233010DE)

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        return (9, 0)

    # --- events: what a session waiting for Xid errors is told ---------------------------

    def nvmlEventSetCreate(self) -> object:
        self._check_init()
        self.event_sets += 1
        return object()

    def nvmlEventSetFree(self, event_set: object) -> None:
        self.event_sets -= 1

    def nvmlDeviceRegisterEvents(self, handle: int, event_types: int, event_set: object) -> None:
        self._check_init()
        if handle in self.events_unsupported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if event_types & pynvml.nvmlEventTypeXidCriticalError:
            self.registered.add(handle)

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> _EventData:
        self._check_init()
        while self.xids:
            gpu, xid = self.xids.pop(0)
            if gpu in self.registered:
                return _EventData(
                    device=gpu, eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid
                )
        time.sleep(min(timeout_ms, 50) / 1000)  # nothing more to tell: a (short) timeout
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)


FOREIGN_PID = 4242  # the pid of the process `held=` puts on a GPU (plus the GPU's index)


def from_spec(spec: str) -> RecordedNvml:
    """`count=2,node=gpu-a`: the recording a simulated agent answers GPU discovery with
    (`python -m llmgw.sim.agent --recorded-nvml count=2,node=gpu-a`). Recognised keys:
    count (GPUs, default 8), node (makes the UUIDs unique to it), held=GPU:GB[+GPU:GB...]
    (a process, pid FOREIGN_PID + GPU index, holding that much memory there),
    ecc=GPU:N[+...] (N uncorrected volatile ECC errors on that GPU), and xid=GPU:XID[+...]
    (Xid events delivered, in that order, to the agent's watch)."""
    options: dict[str, str] = {}
    for part in filter(None, spec.split(",")):
        key, sep, val = part.partition("=")
        if not sep or key not in ("count", "node", "held", "ecc", "xid"):
            raise ValueError(
                f"recorded NVML {spec!r}: expected "
                "count=N,node=NAME,held=GPU:GB,ecc=GPU:N,xid=GPU:XID"
            )
        options[key] = val
    held = _per_gpu(options.get("held", ""), spec)
    return RecordedNvml(
        count=int(options.get("count", "8")),
        node=options.get("node"),
        processes={gpu: [(FOREIGN_PID + gpu, int(gb * 1e9))] for gpu, gb in held.items()},
        ecc_uncorrected={gpu: int(n) for gpu, n in _per_gpu(options.get("ecc", ""), spec).items()},
        xids=_events(options.get("xid", ""), spec),
    )


def _events(value: str, spec: str) -> list[tuple[int, int]]:
    return [(gpu, int(xid)) for gpu, xid in _pairs(value, spec)]


def _per_gpu(value: str, spec: str) -> dict[int, float]:
    return dict(_pairs(value, spec))


def _pairs(value: str, spec: str) -> list[tuple[int, float]]:
    out: list[tuple[int, float]] = []
    for item in filter(None, value.split("+")):
        gpu, sep, amount = item.partition(":")
        if not sep:
            raise ValueError(f"recorded NVML {spec!r}: {item!r} is not GPU:AMOUNT")
        out.append((int(gpu), float(amount)))
    return out
