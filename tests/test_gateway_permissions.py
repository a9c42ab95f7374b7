"""Who may touch the streams beside the bucket, against a real nats-server with the generated
per-identity users (verify_and_map): a router claims limits and counts usage on subjects of
its own and appends to the audit trail, and may change nothing another router holds or
counted, nor erase any of it; a node may write none of it, read no limit nor the trail, and
no identity but the operator may write a key or a team."""

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
    window = f"{keys.LIMITS_ROOT}.key.alice.rpm.1"
    usage = f"{keys.USAGE_ROOT}.2026010100._.alice.m.prompt"
    return {
        "claim a limit": lambda: counters.claim(window, "router.1", 0, 5, 100),
        "hand places back": lambda: counters.hold(window, "router.1", 0),
        "claim as another router": lambda: counters.claim(window, "other.1", 0, 5, 100),
        "write what another router holds": lambda: counters.hold(window, "other.1", -100),
        "count usage": lambda: counters.add(f"{usage}.router", 5),
        "count another router's usage": lambda: counters.add(f"{usage}.other", -5),
        "subtract from a count all routers share": lambda: counters.add(usage, -5),
        "append to the audit trail": lambda: AuditTrail(bus).append([("id-x", [record])]),
        "read a limit": lambda: counters.held(window),
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


ROUTER_MAY = {
    "claim a limit",
    "hand places back",
    "count usage",
    "append to the audit trail",
    "read a limit",
}


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
        for what in ("write a key", "read the audit trail", "claim a limit", "count usage"):
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


def test_a_router_whose_id_is_not_its_certificate_s_cn_is_refused_before_it_serves(
    pki,  # noqa: F811 - the fixture
) -> None:
    """nats-server lets a router write only subjects named after its CN: under another id
    every claim and count it made would be refused, so it does not start."""
    import os
    import subprocess
    import sys

    from llmgw.bus.server import free_port

    cert, key = pki.cert("router")
    out = subprocess.run(
        [sys.executable, "-m", "llmgw.cli", "router", "--nats", "nats://127.0.0.1:9"]
        + ["--tls-ca", str(pki.ca), "--tls-cert", cert, "--tls-key", key]
        + ["--router-id", "router-b", "--listen", f"127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")},
    )
    assert out.returncode == 1
    assert "--router-id router-b is not the CN of the router's certificate (router" in out.stderr
    assert "llmgw pki issue --router router-b" in out.stderr
