"""Xid events from NVML: the GPU faults that leave no counter behind.

The fault counters `gpus.py` reads (uncorrected ECC, pages or rows pending retirement or
remapping) stay set until a reset and are read at every probe. Some faults that make a GPU
unfit leave none: an NVLink error (Xid 74), a GPU fallen off the bus (79), a GSP timeout
(119, 120), a micro-controller halt (62). NVML reports those only as events, to a session
that registered for them and waits, and an event nobody waited for is gone. So a thread of
the agent holds an NVML session open for its whole life and waits on it (`watch_xids`); what
it heard is kept in an `XidLog` and merged into each GPU probe (`with_xids`), which makes the
GPU unschedulable (controller/placement/nodes.py) until the agent restarts, which an operator
does after resetting the GPU. Faults that happened while no agent ran are not known; the
counters still cover the memory faults among them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from llmgw.bus.records import Gpus
from llmgw.xids import UNFIT_XIDS, describe_xid

log = logging.getLogger(__name__)

# pynvml.nvmlEventTypeXidCriticalError: every Xid NVML calls critical, application faults too
XID_CRITICAL_ERROR = 0x8


class XidLog:
    """The Xid that made each GPU unfit (by UUID), and when: the first one stays, since
    nothing but a reset clears a GPU, and the agent is restarted after that. Written by the
    watching thread, read by the probes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unfit: dict[str, tuple[int, float]] = {}

    def record(self, uuid: str, xid: int, at: float) -> bool:
        """Remember an Xid delivered for `uuid`; True when it made that GPU unfit just now."""
        if xid not in UNFIT_XIDS:
            return False
        with self._lock:
            if uuid in self._unfit:
                return False
            self._unfit[uuid] = (xid, at)
            return True

    def unfit(self) -> dict[str, tuple[int, float]]:
        with self._lock:
            return dict(self._unfit)


def with_xids(gpus: Gpus, unfit: Mapping[str, tuple[int, float]]) -> Gpus:
    """`gpus` with the Xid each unfit GPU had in its error fields."""
    # an Xid names the card: every MIG device made of it is unfit with it
    if not unfit or not any(g.uuid in unfit or g.parent_uuid in unfit for g in gpus.devices):
        return gpus
    devices = []
    for g in gpus.devices:
        card = g.uuid if g.uuid in unfit else g.parent_uuid
        if card in unfit:
            xid, at = unfit[card]
            g = msgspec.structs.replace(
                g, errors=msgspec.structs.replace(g.errors, xid=xid, xid_at=at)
            )
        devices.append(g)
    return msgspec.structs.replace(gpus, devices=devices)


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def watch_xids(
    nvml: Any,
    xids: XidLog,
    stop: threading.Event,
    on_unfit: Callable[[], None] = lambda: None,
    wait_ms: int = 1000,
) -> str:
    """Wait for Xid events on every GPU until `stop` is set, recording each in `xids` and
    calling `on_unfit` when one made a GPU unfit. Blocking: run it in a thread of its own
    (it returns within `wait_ms` of `stop`). Returns why it ended, for the log; never raises
    for NVML's answers (a GPU that cannot deliver events is skipped, an NVML without event
    support ends the watch, and the probes' counters still cover the memory faults)."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        return f"no Xid watch: NVML did not initialise ({e})"
    try:
        try:
            events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as e:
            return f"no Xid watch: NVML has no event sets here ({e})"
        try:
            watched = _register(nvml, events)
            if not watched:
                return "no Xid watch: no GPU here delivers Xid events"
            log.info("watching Xid events on GPU %s", ", ".join(map(str, watched)))
            while not stop.is_set():
                try:
                    data = nvml.nvmlEventSetWait_v2(events, wait_ms)
                except nvml.NVMLError_Timeout:
                    continue
                except nvml.NVMLError as e:
                    return f"Xid watch ended: {e}"
                _heard(nvml, xids, data, on_unfit)
            return "Xid watch stopped"
        finally:
            try:
                nvml.nvmlEventSetFree(events)
            except nvml.NVMLError:
                pass
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def _register(nvml: Any, events: Any) -> list[int]:
    watched = []
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except nvml.NVMLError:
        return []
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            nvml.nvmlDeviceRegisterEvents(handle, XID_CRITICAL_ERROR, events)
        except nvml.NVMLError as e:  # NotSupported on some GPUs (and all before Fermi)
            log.info("GPU %d delivers no Xid events: %s", index, e)
            continue
        watched.append(index)
    return watched


def _heard(nvml: Any, xids: XidLog, data: Any, on_unfit: Callable[[], None]) -> None:
    xid = int(data.eventData)
    try:
        uuid = _text(nvml.nvmlDeviceGetUUID(data.device))
    except nvml.NVMLError as e:  # a GPU fallen off the bus may not say who it is any more
        log.error("%s on a GPU that cannot be named (%s)", describe_xid(xid), e)
        return
    if xids.record(uuid, xid, time.time()):
        log.error("GPU %s: %s; out of service until it is reset", uuid, describe_xid(xid))
        on_unfit()
    elif xid not in UNFIT_XIDS:
        log.warning("GPU %s: Xid %d (an application fault; the GPU stays in service)", uuid, xid)
