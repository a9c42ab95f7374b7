"""Writes of every kind the fleet makes to the store, under load, and what of them a cluster
still holds afterwards: the workload of tests/test_durability.py and bench/durability.py.

Kinds: a bucket put (a lease, a shard, a desired count), a limits holder's write (what a
router holds claimed, llmgw/bus/claims.py), a usage counter add with its message id, an
audit message. `Writes` keeps what was acknowledged; `lost` says what of it is gone.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio

from llmgw.bus import claims, keys, records
from llmgw.bus.client import Bus, BusError
from llmgw.bus.counters import AuditTrail, Counters

LIMITS_WINDOW = f"{keys.LIMITS_ROOT}.key.bench.rpm.1"


def _audit_record(i: int) -> records.AuditRecord:
    # `client` tells the records apart
    return records.AuditRecord(
        time=time.time(),
        key="bench",
        model="m",
        router="bench",
        status=200,
        prompt_tokens=10,
        completion_tokens=20,
        duration_s=0.1,
        client=f"req-{i}",
    )


@dataclass
class Writes:
    """What was acknowledged, by kind: the last value per bucket key and limits holder, the
    sum per usage subject, the ids of audit messages."""

    bucket: dict[str, int] = field(default_factory=dict)
    holders: dict[str, int] = field(default_factory=dict)
    usage: dict[str, int] = field(default_factory=dict)
    audit: set[str] = field(default_factory=set)
    n: int = 0


def kinds(bus: Bus, acked: Writes) -> dict[str, Callable[[int], Awaitable[None]]]:
    counters, trail = Counters(bus), AuditTrail(bus)

    # Write `i` comes from writer i % in_flight (`drive`), and a key or holder is written by
    # one writer only (i % 16, with in_flight dividing 16): its last acknowledged value is
    # the one it must hold.
    async def bucket(i: int) -> None:
        model = f"m{i % 16}-{i // 16 % 12}"
        await bus.put(keys.desired(model), records.Desired(model=model, replicas=i, updated_at=1))
        acked.bucket[keys.desired(model)] = i

    async def holder(i: int) -> None:
        # each holder writes only its own subject, as a router does (llmgw/bus/claims.py)
        h = f"r{i % 16}.x"
        await counters.hold(LIMITS_WINDOW, h, i)
        acked.holders[h] = i

    async def usage(i: int) -> None:
        subject = f"{keys.USAGE_ROOT}.1.t.k{i % 50}.m.requests.bench"
        await counters.add(subject, 1, msg_id=f"u-{i}")
        acked.usage[subject] = acked.usage.get(subject, 0) + 1

    async def audit(i: int) -> None:
        await trail.append([(f"a-{i}", [_audit_record(i)])])
        acked.audit.add(f"req-{i}")

    return {"bucket put": bucket, "limits holder": holder, "usage add": usage, "audit": audit}


async def drive(
    write: Callable[[int], Awaitable[None]], seconds: float, acked: Writes, in_flight: int = 16
) -> int:
    """`in_flight` writers for `seconds` (or until cancelled): the writes acknowledged."""
    done = 0
    end = time.monotonic() + seconds

    async def writer(w: int) -> None:
        nonlocal done
        i = w
        while time.monotonic() < end:
            i += in_flight
            try:
                await write(i)
            except Exception:  # noqa: BLE001 - unacknowledged: not counted
                await anyio.sleep(0.01)
                continue
            done += 1
            acked.n += 1

    async with anyio.create_task_group() as tg:
        for w in range(in_flight):
            tg.start_soon(writer, w)
    return done


async def lost(bus: Bus, acked: Writes) -> dict[str, int]:
    """What of `acked` the store no longer holds, by kind (and how many were acknowledged):
    bucket keys older than their last acknowledged write, limit units a holder holds less
    of than it was acknowledged at (what the limits could over-admit), usage adds, audit
    records."""
    bucket = await bus.list("desired.*", lambda b: records.decode(b, records.Desired).replicas)
    holders, _ = await claims.holders(bus, LIMITS_WINDOW)
    usage = await Counters(bus).totals(f"{keys.USAGE_ROOT}.>")
    stored_audit = {r.client async for r in AuditTrail(bus).read(since=0)}
    return {
        "bucket keys behind": sum(
            1 for k, v in acked.bucket.items() if k not in bucket or bucket[k].value < v
        ),
        "limit units under-counted": sum(
            max(0, v - holders.get(h, 0)) for h, v in acked.holders.items()
        ),
        "usage adds lost": sum(max(0, v - usage.get(s, 0)) for s, v in acked.usage.items()),
        "audit records lost": len(acked.audit - stored_audit),
        "writes": acked.n,
    }


async def lost_after_restart(bus: Bus, acked: Writes, within: float = 120.0) -> dict[str, int]:
    """`lost`, asked again until every stream answers: each elects its leader anew after the
    whole cluster restarted."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await lost(bus, acked)
        except BusError:
            if time.monotonic() > deadline:
                raise
            await anyio.sleep(0.5)
