"""The bus against a real nats-server: bucket, typed reads, watches, reconnect, backoff."""

from __future__ import annotations

import logging
import random

import anyio
import pytest

from llmgw.bus import keys, records
from llmgw.bus.backoff import Backoff
from llmgw.bus.client import BucketSettings, Bus, BusError, Synced, Update, decoder
from llmgw.bus.server import EmbeddedNats, free_port

pytestmark = pytest.mark.anyio


def _lease(node: str, seq: int) -> records.Lease:
    return records.Lease(
        node=node,
        seq=seq,
        time=1.0,
        started_at=1.0,
        memory=records.Memory(total_bytes=10, available_bytes=5),
    )


async def test_value_is_compact_ascii_json_readable_by_the_nats_cli(bus: Bus) -> None:
    await bus.put(keys.lease("node05"), _lease("node05", 1))
    raw, _ = await bus.get_raw("leases.node05")
    assert raw.startswith(b'{"node":"node05","seq":1')
    assert raw.isascii() and b"\n" not in raw


async def test_garbage_value_is_logged_and_skipped_not_fatal(bus: Bus, caplog) -> None:
    await bus.put("leases.good", _lease("good", 1))
    await bus.put("leases.bad", b"this is not json")
    await bus.put("leases.wrongtype", b'{"node":"x","seq":"one"}')
    got = await bus.list(keys.pattern(keys.LEASES), decoder(records.Lease))
    assert list(got) == ["leases.good"]
    assert await bus.get("leases.bad", decoder(records.Lease)) is None
    text = caplog.text
    assert "skipping leases.bad" in text and "nats kv del" in text
    assert "skipping leases.wrongtype" in text


async def test_watch_replays_then_syncs_then_follows_live_changes(bus: Bus) -> None:
    await bus.put("leases.a", _lease("a", 1))
    seen: list[object] = []
    async with anyio.create_task_group() as tg:

        async def consume() -> None:
            async for item in bus.watch("leases.*", decoder(records.Lease)):
                seen.append(item)
                if isinstance(item, Update) and item.value is None:
                    tg.cancel_scope.cancel()

        tg.start_soon(consume)
        await _until(lambda: any(isinstance(s, Synced) for s in seen))
        await bus.put("leases.b", _lease("b", 7))
        await bus.delete("leases.a")
    assert isinstance(seen[0], Update) and seen[0].key == "leases.a"
    assert isinstance(seen[1], Synced)
    assert seen[2].key == "leases.b" and seen[2].value.seq == 7
    assert seen[3].key == "leases.a" and seen[3].value is None


async def test_existing_bucket_with_other_replicas_is_refused_not_recreated(nats_settings) -> None:
    first = await Bus.connect(nats_settings, BucketSettings(), give_up_after=5)
    await first.put("leases.keep", _lease("keep", 1))
    await first.close()
    with pytest.raises(BusError, match=r"replicas=1 \(configured 3\).*does not recreate"):
        await Bus.connect(nats_settings, BucketSettings(replicas=3), give_up_after=5)
    again = await Bus.connect(nats_settings, BucketSettings(), give_up_after=5)
    assert (await again.get("leases.keep", decoder(records.Lease))).value.seq == 1
    await again.close()


async def test_cas_update_refuses_a_stale_revision(bus: Bus) -> None:
    rev = await bus.create("leader", records.Leader(holder="a", since=1, renewed_at=1))
    assert await bus.create("leader", records.Leader(holder="b", since=1, renewed_at=1)) is None
    assert await bus.update("leader", records.Leader(holder="a", since=1, renewed_at=2), last=rev)
    assert (
        await bus.update("leader", records.Leader(holder="b", since=1, renewed_at=2), last=rev)
        is None
    )


async def test_watch_sees_changes_made_while_the_server_was_down(tmp_path) -> None:
    port = free_port()
    server = EmbeddedNats(data_dir=tmp_path / "n", port=port)
    server.start()
    from llmgw.bus.client import NatsSettings

    settings = NatsSettings(urls=(server.url,), backoff_base=0.05, backoff_cap=0.2)
    watcher_bus = await Bus.connect(settings, give_up_after=5)
    writer = await Bus.connect(settings, give_up_after=5)
    await writer.put("leases.a", _lease("a", 1))
    await writer.put("leases.b", _lease("b", 1))
    state: dict[str, int] = {}
    syncs = 0
    try:
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                nonlocal syncs
                async for item in watcher_bus.watch("leases.*", decoder(records.Lease)):
                    if isinstance(item, Synced):
                        syncs += 1
                    elif item.value is None:
                        state.pop(item.key, None)
                    else:
                        state[item.key] = item.value.seq

            tg.start_soon(consume)
            await _until(lambda: syncs == 1)
            assert state == {"leases.a": 1, "leases.b": 1}
            # restart the server; while watcher_bus reconnects, the writer changes things
            before = writer.reconnects
            server.stop()
            server.start()
            await _until(lambda: writer.reconnects > before and writer.connected, timeout=10)
            await writer.delete("leases.a")
            await writer.put("leases.b", _lease("b", 2))
            await _until(lambda: state == {"leases.b": 2}, timeout=10)
            tg.cancel_scope.cancel()
    finally:
        await watcher_bus.close()
        await writer.close()
        server.stop()


async def test_first_connect_gives_up_with_a_clear_error_when_asked() -> None:
    from llmgw.bus.client import NatsSettings

    settings = NatsSettings(
        urls=(f"nats://127.0.0.1:{free_port()}",), backoff_base=0.05, backoff_cap=0.1
    )
    with pytest.raises(BusError, match="cannot connect to NATS at nats://127.0.0.1"):
        await Bus.connect(settings, give_up_after=0.5)


def test_backoff_grows_with_jitter_and_is_reset_only_explicitly() -> None:
    b = Backoff(base=1.0, cap=8.0, rng=random.Random(1))
    delays = [b.next_delay() for _ in range(6)]
    ceilings = [1, 2, 4, 8, 8, 8]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert delays[3] > delays[0]  # the seed's bug: it never grew
    assert len({round(d, 6) for d in delays}) == 6  # jittered: no lockstep
    b.reset()
    assert b.next_delay() <= 1.0


async def test_reconnect_delays_grow_while_the_server_stays_down(tmp_path, caplog) -> None:
    from llmgw.bus.client import NatsSettings

    server = EmbeddedNats(data_dir=tmp_path / "n", port=free_port())
    server.start()
    settings = NatsSettings(
        urls=(server.url,), backoff_base=0.05, backoff_cap=10, healthy_after=0.5
    )
    b = await Bus.connect(settings, give_up_after=5)
    try:
        await anyio.sleep(0.6)  # healthy: backoff at zero
        assert b.backoff.attempt == 0
        server.kill()
        await _until(lambda: b.backoff.attempt >= 4, timeout=10)
        # failed attempts never reset it: still counting up while the server is away
        await anyio.sleep(1.0)
        assert b.backoff.attempt >= 4
        server.start()
        await _until(lambda: b.connected, timeout=20)
        await _until(lambda: b.backoff.attempt == 0, timeout=5)
    finally:
        await b.close()
        server.stop()


async def _until(cond, timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not cond():
            await anyio.sleep(0.02)


def test_log_level_fixture_is_active(caplog) -> None:
    logging.getLogger("llmgw.x").info("hello")
    assert "hello" in caplog.text
