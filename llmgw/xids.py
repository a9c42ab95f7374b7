"""Xid errors that make a GPU unfit until it is reset: what the agent acts on and what an
explanation says of each (NVIDIA's Xid catalogue, "XID Errors" in the driver docs).

NVML delivers every "critical" Xid through one event type, the faults of an application
(13 graphics engine exception, 31 memory page fault, 43 a stopped GPU context, 45
preemptive cleanup) among them: those end the process that hit them and leave the GPU
fit, so they take nothing out of service. Imported by the agent (which watches) and by
placement (which explains): nothing here does I/O.
"""

from __future__ import annotations

UNFIT_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping event",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "fallen off the bus",
    92: "high single-bit ECC error rate",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}


def describe_xid(xid: int) -> str:
    return f"Xid {xid} ({UNFIT_XIDS.get(xid, 'unknown')})"
