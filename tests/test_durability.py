"""What the store keeps, as llmgw sets it up (docs/reliability.md, "What the store keeps"):
every nats-server config llmgw ships or writes fsyncs each write before acknowledging it,
the gateway's streams get as many copies as the bucket, and every acknowledged write of
every kind (bucket, limits, usage, audit) is there after every server of a 3-server
cluster is SIGKILLed at once under load."""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import pytest
from durability_load import Writes, drive, kinds, lost_after_restart
from local_cluster import LocalCluster

from llmgw.bus import keys
from llmgw.bus.client import BucketSettings, Bus, NatsSettings
from llmgw.bus.counters import ensure_streams
from llmgw.bus.server import SYNC_INTERVAL, EmbeddedNats, free_port

pytestmark = pytest.mark.anyio

NATS_DIR = Path(__file__).parent.parent / "nats"


@pytest.mark.parametrize("conf", sorted(NATS_DIR.glob("*.conf")), ids=lambda p: p.name)
def test_every_shipped_server_config_fsyncs_each_write(conf: Path) -> None:
    jetstream = re.search(r"jetstream\s*\{(.*?)\}", conf.read_text(), re.S)
    assert jetstream and re.search(r"^\s*sync_interval:\s*always\s*$", jetstream[1], re.M)


def test_the_server_llmgw_up_starts_fsyncs_each_write(tmp_path) -> None:
    server = EmbeddedNats(tmp_path, port=free_port())
    assert SYNC_INTERVAL == "always"
    with server:
        assert "sync_interval: always" in server.config_path.read_text()


async def test_the_gateways_streams_get_as_many_copies_as_the_bucket(tmp_path) -> None:
    cluster = LocalCluster(tmp_path / "cluster").start_all()
    try:
        settings = NatsSettings(urls=cluster.urls, connect_timeout=1)
        async with await Bus.connect(settings, BucketSettings(replicas=3), give_up_after=30):
            pass
        # an operator's command given no --bucket-replicas, as `llmgw key ls` is
        async with await Bus.connect(settings, give_up_after=30) as bus:
            await ensure_streams(bus)
            copies = {
                name: (await bus.js.stream_info(name)).config.num_replicas
                for name in (keys.LIMITS_STREAM, keys.USAGE_STREAM, keys.AUDIT_STREAM)
            }
    finally:
        cluster.stop()
    assert copies == dict.fromkeys(copies, 3)


@pytest.mark.slow
async def test_every_acknowledged_write_survives_every_server_killed_at_once(tmp_path) -> None:
    cluster = LocalCluster(tmp_path / "cluster", sync_interval=SYNC_INTERVAL).start_all()
    acked = Writes()
    try:
        settings = NatsSettings(urls=cluster.urls, connect_timeout=1)
        bus = await Bus.connect(settings, BucketSettings(replicas=3), give_up_after=30)
        await ensure_streams(bus)
        async with anyio.create_task_group() as tg:
            for write in kinds(bus, acked).values():
                tg.start_soon(drive, write, 60, acked)
            await anyio.sleep(3)
            cluster.kill_all()
            await anyio.sleep(0.5)
            tg.cancel_scope.cancel()
        await bus.close()
        for i in range(len(cluster.servers)):
            cluster.start(i)
        cluster.wait_healthy()
        async with await Bus.connect(settings, give_up_after=60) as again:
            missing = await lost_after_restart(again, acked)
    finally:
        cluster.stop()
    assert missing.pop("writes") > 1000
    assert missing == dict.fromkeys(missing, 0)
