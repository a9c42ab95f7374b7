"""Who may touch the streams beside the bucket, against a real nats-server with the generated
per-identity users (verify_and_map): routers add to the limit and usage counters and append
to the audit trail, and may erase none of it; a node may write none of it, read no counter
nor the trail, and no identity but the operator may write a key or a team."""

from __future__ import annotations

import json

import anyio
import pytest
from test_tls import connect, mapped_server, pki  # noqa: F401 - fixtures

from llmgw.bus import classify, keys, records
from llmgw.bus.client import Bus
from llmgw.bus.counters import AuditTrail, Counters, ensure_streams

pytestmark = pytest.mark.anyio


async def _can(do) -> bool:
    try:
        with anyio.fail_after(3):
            await do()
        return True
    except Exception:  # noqa: BLE001 - a refused publish only ever times out, or is refused
        return False


def _attempts(bus: Bus) -> dict[str, object]:
    counters = Counters(bus)
    js = bus.js
    record = records.AuditRecord(time=1.0, key="alice", model="m", status=200)
    return {
        "claim a limit": lambda: counters.add(f"{keys.LIMITS_ROOT}.key.alice.rpm.1", 5),
        "count usage": lambda: counters.add(f"{keys.USAGE_ROOT}.2026010100._.alice.m.prompt", 5),
        "append to the audit trail": lambda: AuditTrail(bus).append([("id-x", [record])]),
        "read a counter": lambda: counters.total(f"{keys.LIMITS_ROOT}.key.alice.rpm.1"),
        "read the audit trail": lambda: _read_audit(bus),
        "purge the audit trail": lambda: classify.answer(
            js.purge_stream(keys.AUDIT_STREAM), "purge"
        ),
        "delete an audit record": lambda: classify.answer(
            js.delete_msg(keys.AUDIT_STREAM, 1), "delete"
        ),
        "purge the limits": lambda: classify.answer(js.purge_stream(keys.LIMITS_STREAM), "purge"),
        "delete the usage stream": lambda: classify.answer(
            js.delete_stream(keys.USAGE_STREAM), "delete"
        ),
        "edit the audit stream": lambda: _edit_audit(bus),
        "write a key": lambda: bus.put(
            keys.apikey("alice"), json.dumps({"name": "alice"}).encode()
        ),
        "write a team": lambda: bus.put(keys.team("ml"), json.dumps({"team": "ml"}).encode()),
    }


async def _read_audit(bus: Bus) -> None:
    found = [r async for r in AuditTrail(bus).read(since=0)]
    assert found


async def _edit_audit(bus: Bus) -> None:
    info = await bus.js.stream_info(keys.AUDIT_STREAM)
    info.config.max_age = 1.0
    await classify.answer(bus.js.update_stream(info.config), "edit")


ROUTER_MAY = {"claim a limit", "count usage", "append to the audit trail", "read a counter"}


async def test_routers_add_to_counters_and_trail_and_erase_nothing_and_nodes_touch_none(
    mapped_server,  # noqa: F811 - the fixture
    pki,  # noqa: F811
) -> None:
    operator = await connect(mapped_server, pki, "operator")
    await ensure_streams(operator)
    await AuditTrail(operator).append([("seed", [records.AuditRecord(time=1.0, status=200)])])
    router = await connect(mapped_server, pki, "router")
    node = await connect(mapped_server, pki, "node05", inbox_prefix="_INBOX.node05")
    outcome: dict[tuple[str, str], bool] = {}
    try:

        async def attempt(who: str, bus: Bus, what: str, do) -> None:
            outcome[who, what] = await _can(do)

        async with anyio.create_task_group() as tg:
            for who, bus in (("router", router), ("node05", node)):
                for what, do in _attempts(bus).items():
                    tg.start_soon(attempt, who, bus, what, do)
        # the operator may do all of it (last: some of it erases what the others need)
        for what in ("write a key", "read the audit trail", "claim a limit"):
            outcome["operator", what] = await _can(_attempts(operator)[what])
        # nothing the others tried erased or changed the trail
        assert [r.status async for r in AuditTrail(operator).read(since=0)][0] == 200
        info = await operator.js.stream_info(keys.AUDIT_STREAM)
        assert info.config.max_age > 86_400
    finally:
        for bus in (node, router, operator):
            await bus.close()
    wrong = sorted(
        f"{who} {'could' if ok else 'could not'} {what}"
        for (who, what), ok in outcome.items()
        if ok != (who == "operator" or (who == "router" and what in ROUTER_MAY))
    )
    assert not wrong
