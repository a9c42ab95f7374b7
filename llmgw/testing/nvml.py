"""Answers like the pynvml module, recorded from an 8x H100 80GB HBM3 node (DGX-H100
layout: PCI order 18, 2a, 3a, 5d, 9a, ab, ba, db), driver 550.54.15.

Errors are pynvml's own exception classes, raised the way pynvml raises them
(`NVMLError(code)` maps the code to its subclass), so `except NVMLError_DriverNotLoaded`
in the code under test is exercised exactly as on a real node.
"""

from __future__ import annotations

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


@dataclass
class _MemoryInfo:
    total: int
    free: int
    used: int


@dataclass
class _PciInfo:
    busId: bytes  # a ctypes char array: bytes, in every pynvml version
    busIdLegacy: bytes
    pciDeviceId: int


class RecordedNvml:
    """Answers like `pynvml` for a recorded node.

    init_error / failing_devices take NVML error codes (pynvml.NVML_ERROR_*), raised as
    pynvml does. old_bytes=True answers strings as bytes, like pynvml before 11.5."""

    def __init__(
        self,
        *,
        count: int = 8,
        init_error: int | None = None,
        count_error: int | None = None,
        failing_devices: dict[int, int] | None = None,
        old_bytes: bool = False,
        node: str | None = None,
    ) -> None:
        if not 0 <= count <= len(H100_UUIDS):
            raise ValueError(f"a recorded node has 0 to {len(H100_UUIDS)} GPUs, not {count}")
        self.count = count
        # several simulated nodes on one machine need GPU UUIDs of their own
        self.uuids = [f"GPU-{node}-{i}" for i in range(count)] if node else H100_UUIDS
        self.init_error = init_error
        self.count_error = count_error
        self.failing_devices = failing_devices or {}
        self.old_bytes = old_bytes
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

    def nvmlDeviceGetName(self, handle: int) -> str | bytes:
        return self._str(H100_NAME)

    def nvmlDeviceGetUUID(self, handle: int) -> str | bytes:
        return self._str(self.uuids[handle])

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> _MemoryInfo:
        used = 555_745_280  # what an idle H100 reports used (reserved by the driver)
        return _MemoryInfo(total=H100_MEMORY_TOTAL, free=H100_MEMORY_TOTAL - used, used=used)

    def nvmlDeviceGetPciInfo(self, handle: int) -> _PciInfo:
        bus = H100_BUS_IDS[handle]
        return _PciInfo(busId=bus.encode(), busIdLegacy=bus[4:].encode(), pciDeviceId=0x233010DE)

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        return (9, 0)


def from_spec(spec: str) -> RecordedNvml:
    """`count=2,node=gpu-a`: the recording a simulated agent answers GPU discovery with
    (`python -m llmgw.testing.agent --recorded-nvml count=2,node=gpu-a`). Recognised keys:
    count (GPUs, default 8), node (makes the UUIDs unique to it)."""
    options: dict[str, str] = {}
    for part in filter(None, spec.split(",")):
        key, sep, val = part.partition("=")
        if not sep or key not in ("count", "node"):
            raise ValueError(f"recorded NVML {spec!r}: expected count=N,node=NAME")
        options[key] = val
    return RecordedNvml(count=int(options.get("count", "8")), node=options.get("node"))
