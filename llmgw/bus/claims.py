"""The limits stream (`LLMGW_LIMITS`): what each router holds claimed of a limit in a window,
one subject per router, so that no router can change what another holds.

    llmgw.limits.<scope...>.<dimension>.<window>.<router>.<instance>   value: units held, "12"

A window's total is the sum over its holders, each read as at least 0: a router (a
certificate's CN, `<router>`; `<instance>` tells its processes apart) may write only its
own subjects (llmgw/bus/permissions.py), so its arithmetic, whatever it writes, can take
nothing from what the others hold, nor lift a limit beyond its own claims.

A claim is optimistic: read every holder's value and the window's last sequence (one batch
direct get), then write this router's new value on the condition that no subject of the
window has changed since (`Nats-Expected-Last-Subject-Sequence` over the window's wildcard,
nats-server >= 2.11); when another router was quicker, read again. So the holders together
never pass the limit, as one atomic counter would keep it, and no holder can subtract.
Writing a lower value of its own (places handed back) or a higher one (tokens used past a
reservation) needs no condition: only the router itself writes its subject.
"""

from __future__ import annotations

import json

import nats.errors
import nats.js.errors

from . import classify, keys
from .client import Bus
from .errors import BusError, BusUnavailable, StreamMissing, Unanswered

_TIMEOUT = 2.0
MAX_HOLDERS = 1000  # router processes holding one window of one limit: more is refused
MAX_VALUE = 32  # bytes of a holder's value: a decimal number; longer reads as 0
_TRIES = 20  # conditional writes lost to other routers in a row before giving up (busy)


class ClaimContended(BusError):
    """Other routers won every try: the claim is given up (the caller treats it as an
    unanswered claim, and asks again later)."""


def read_held(data: bytes) -> int:
    """A holder's value as counted: a decimal number of units, at least 0; anything else
    (garbage written by hand, a router's bug) counts 0: it is that holder's own loss."""
    if len(data) > MAX_VALUE:
        return 0
    try:
        value = json.loads(data)
    except ValueError:
        return 0
    if not isinstance(value, int) or isinstance(value, bool):
        return 0
    return max(0, value)


async def holders(bus: Bus, window_subject: str) -> tuple[dict[str, int], int]:
    """Every holder of the window (`<router>.<instance>`) and its value, and the last
    sequence stored on any of them (0: none)."""
    stream = keys.LIMITS_STREAM
    if not bus.connected:
        raise BusUnavailable(f"read {window_subject}", Unanswered.NOT_CONNECTED)
    nc = bus.nc
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, max_msgs=MAX_HOLDERS + 1)
    found: dict[str, int] = {}
    last = 0
    try:
        request = {"multi_last": [f"{window_subject}.*.*"], "batch": MAX_HOLDERS}
        await nc.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=inbox)
        prefix = len(window_subject) + 1
        while True:
            try:
                msg = await sub.next_msg(timeout=_TIMEOUT)
            except nats.errors.TimeoutError:
                raise BusUnavailable(f"read {window_subject}", Unanswered.TIMEOUT) from None
            headers = msg.headers or {}
            status = headers.get("Status")
            if status == "503":  # no responders: no stream takes the subject
                raise StreamMissing(f"read {window_subject}", stream)
            if status is not None:  # 204: the end of the batch; 404: nothing stored
                if status == "204" and headers.get("Nats-Num-Pending", "0") != "0":
                    raise BusError(
                        f"{window_subject} has more than {MAX_HOLDERS} holders: that many "
                        "router processes on one limit is not supported"
                    )
                if status not in ("204", "404"):
                    raise BusError(
                        f"read {window_subject}: {status} {headers.get('Description', '')}"
                    )
                return found, last
            found[headers.get("Nats-Subject", "")[prefix:]] = read_held(msg.data)
            last = max(last, int(headers.get("Nats-Sequence", "0")))
    finally:
        try:
            await sub.unsubscribe()
        except nats.errors.ConnectionClosedError:
            pass


async def claim(
    bus: Bus, window_subject: str, holder: str, mine: int, asked: int, limit: int
) -> tuple[int, int]:
    """`holder` (`<router>.<instance>`) holds `mine` of the window and asks `asked` more
    under `limit`: what it got (0 when the limit is taken whole) and the window's total
    after it."""
    for _ in range(_TRIES):
        found, last = await holders(bus, window_subject)
        others = sum(v for h, v in found.items() if h != holder)
        got = max(0, min(asked, limit - others - mine))
        if not got:
            return 0, others + mine
        condition = {
            "Nats-Expected-Last-Subject-Sequence": str(last),
            "Nats-Expected-Last-Subject-Sequence-Subject": f"{window_subject}.*.*",
        }
        try:
            await _write(bus, f"{window_subject}.{holder}", mine + got, condition)
        except nats.js.errors.APIError as e:
            if e.err_code in (classify.WRONG_LAST_SEQUENCE, classify.WRONG_LAST_SEQUENCE_BUSY):
                continue  # another router wrote first: read again
            raise BusError(f"claim on {window_subject}: {e}") from e
        return got, others + mine + got
    raise ClaimContended(
        f"claim on {window_subject}: other routers' claims came first {_TRIES} times"
    )


async def hold(bus: Bus, window_subject: str, holder: str, units: int) -> None:
    """Write what `holder` holds of the window (places handed back, tokens used past a
    reservation): its own subject, so no condition is needed."""
    try:
        await _write(bus, f"{window_subject}.{holder}", units, {})
    except nats.js.errors.APIError as e:
        raise BusError(f"write {window_subject}.{holder}: {e}") from e


async def _write(bus: Bus, subject: str, units: int, headers: dict[str, str]) -> None:
    if not bus.connected:
        # nats-py would hold it while it reconnects and send it after, out of turn
        raise BusUnavailable(f"write {subject}", Unanswered.NOT_CONNECTED)
    try:
        msg = await classify.answer(
            bus.nc.request(subject, str(units).encode(), timeout=_TIMEOUT, headers=headers or None),
            f"write {subject}",
        )
    except BusUnavailable as e:
        if e.why is Unanswered.NO_RESPONDERS:
            raise StreamMissing(f"write {subject}", keys.LIMITS_STREAM) from None
        raise
    answer = json.loads(msg.data)
    if isinstance(answer, dict) and answer.get("error"):
        raise nats.js.errors.APIError.from_error(answer["error"])


async def total(bus: Bus, window_subject: str) -> int:
    """What every router holds of a limit's window."""
    found, _ = await holders(bus, window_subject)
    return sum(found.values())
