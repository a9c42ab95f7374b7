"""The agent as a real process against a real nats-server: registration, heartbeats,
keeping the inventory true, overrides, stopping."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from agent_helpers import agent_config, host_dirs, start_agent, stop, write_meminfo
from samples.infiniband import FABRIC_MAP, FILES, LINKS
from samples.sysfs import write_tree
from waiting import until

from llmgw.agent.config import AgentConfig
from llmgw.bus import records
from llmgw.bus.client import Bus, decoder
from llmgw.bus.server import free_port

pytestmark = pytest.mark.anyio

GIB = 1 << 30


async def _node(bus: Bus, node: str) -> records.NodeInventory | None:
    e = await bus.get(f"nodes.{node}", decoder(records.NodeInventory))
    return e.value if e else None


async def _scanned(bus: Bus, node: str) -> records.NodeInventory | None:
    """nodes.<node> once it carries a finished weights scan (registration comes first)."""
    inv = await _node(bus, node)
    return inv if inv is not None and inv.weights.scanned_at > 0 else None


async def _lease(bus: Bus, node: str) -> records.Lease | None:
    e = await bus.get(f"leases.{node}", decoder(records.Lease))
    return e.value if e else None


@pytest.fixture
def host(tmp_path):
    return host_dirs(tmp_path)


def _run(
    cfg: AgentConfig, host: dict[str, Path], tmp_path: Path, simulate: list[str] | None = None
) -> subprocess.Popen:
    """The agent as a process, its config in tmp_path/a.toml and its log in agent.log."""
    log = tmp_path / "agent.log"
    return start_agent(cfg, tmp_path / "a.toml", [host["bin"]], log, simulate=simulate)


async def test_registration_carries_the_whole_inventory_with_overrides_marked(
    bus, nats_server, host, tmp_path
):
    write_tree(host["sysfs"], FILES, LINKS)
    cfg = agent_config(nats_server.url, host, id="gpu05", address="10.1.2.3")
    import msgspec

    cfg = msgspec.structs.replace(cfg, fabrics=FABRIC_MAP)
    proc = _run(cfg, host, tmp_path)
    try:
        inv = await until(lambda: _node(bus, "gpu05"))
        assert inv.address == "10.1.2.3"
        assert inv.memory.total_bytes == 64 * GIB
        assert inv.cpu.count == 2 and inv.cpu.model == "Test CPU"
        assert inv.gpus.status == "disabled"
        assert {a.name: a.fabric for a in inv.ib} == {
            "mlx5_0": "ib-a",
            "mlx5_1": "ib-b",
            "mlx5_2": "ib-a",
            "mlx5_3": None,
        }
        assert set(inv.from_config) >= {"node.id", "node.address", "node.gpus", "fabrics"}
        lease = await until(lambda: _lease(bus, "gpu05"))
        assert lease.seq >= 1
    finally:
        assert stop(proc) == 0


async def test_ram_growing_shows_in_the_next_lease_and_rewrites_the_node(
    bus, nats_server, host, tmp_path
):
    proc = _run(agent_config(nats_server.url, host, id="vm1"), host, tmp_path)
    try:
        first = await until(lambda: _node(bus, "vm1"))
        assert first.memory.total_bytes == 64 * GIB
        write_meminfo(host["procfs"], 128, 120)  # the hypervisor gave the VM more RAM

        async def grown_lease():
            lease = await _lease(bus, "vm1")
            return lease if lease and lease.memory.total_bytes == 128 * GIB else None

        lease = await until(grown_lease)
        assert lease.memory.available_bytes == 120 * GIB

        async def grown_node():
            inv = await _node(bus, "vm1")
            return inv if inv and inv.memory.total_bytes == 128 * GIB else None

        assert (await until(grown_node)).memory.total_bytes == 128 * GIB
    finally:
        stop(proc)


async def test_config_ram_override_beats_discovery(bus, nats_server, host, tmp_path):
    proc = _run(agent_config(nats_server.url, host, id="vm2", ram_total_gb=32), host, tmp_path)
    try:
        inv = await until(lambda: _node(bus, "vm2"))
        assert inv.memory.total_bytes == 32 * GIB  # discovery says 64
        assert inv.memory.available_bytes <= 32 * GIB
        assert "node.ram_total_gb" in inv.from_config
    finally:
        stop(proc)


async def test_engine_installed_while_running_is_reported_within_the_probe_interval(
    bus, nats_server, host, tmp_path
):
    proc = _run(agent_config(nats_server.url, host, id="n1"), host, tmp_path)
    try:
        inv = await until(lambda: _node(bus, "n1"))
        assert inv.engines == []
        exe = host["bin"] / "llama-server"
        exe.write_text(
            "#!/bin/sh\necho 'version: 9439 (47f6423ed)' >&2\necho 'built with cc' >&2\n"
        )
        exe.chmod(0o755)

        async def with_engine():
            inv = await _node(bus, "n1")
            return inv if inv and inv.engines else None

        inv = await until(with_engine)
        assert [(e.name, e.version, e.path) for e in inv.engines] == [
            ("llama-server", "9439 (47f6423ed)", str(exe))
        ]
        exe.unlink()

        async def without_engine():
            inv = await _node(bus, "n1")
            return inv if inv and not inv.engines else None

        await until(without_engine)
    finally:
        stop(proc)


async def test_agent_restart_refreshes_its_node_record(bus, nats_server, host, tmp_path):
    cfg = agent_config(nats_server.url, host, id="n2")
    proc = _run(cfg, host, tmp_path)
    first = await until(lambda: _node(bus, "n2"))
    stop(proc)
    await bus.delete("nodes.n2")  # the control plane lost it (or someone removed it by hand)
    proc = _run(cfg, host, tmp_path)
    try:
        again = await until(lambda: _node(bus, "n2"))
        assert again.started_at > first.started_at

        # the first agent's last lease stays until the new one's first beat replaces it
        async def new_lease():
            lease = await _lease(bus, "n2")
            return lease if lease and lease.started_at != first.started_at else None

        lease = await until(new_lease)
        assert lease.started_at == again.started_at
    finally:
        stop(proc)


async def test_sigterm_stops_the_agent_promptly_and_closes_its_connection(
    bus, nats_server, host, tmp_path
):
    proc = _run(agent_config(nats_server.url, host, id="n3"), host, tmp_path)
    await until(lambda: _lease(bus, "n3"))
    assert _client_names(nats_server).count("llmgw-agent n3") == 1
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == 0  # hangs (and fails) if stopping waits on the connection
    assert "llmgw-agent stopped" in (tmp_path / "agent.log").read_text()
    assert "llmgw-agent n3" not in _client_names(nats_server)


def test_sigterm_stops_an_agent_that_cannot_reach_nats(host, tmp_path):
    """The seed's agent blocked in its stream and took 90 s; here it is stuck connecting."""
    cfg = agent_config(f"nats://127.0.0.1:{free_port()}", host, id="n4")
    proc = _run(cfg, host, tmp_path)
    _wait_log(tmp_path / "agent.log", "cannot connect to NATS")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == 0


def test_a_config_with_an_unknown_key_is_refused_naming_file_and_key(tmp_path):
    bad = tmp_path / "agent.toml"
    bad.write_text('[nats]\nurls = ["nats://127.0.0.1:4222"]\n\n[node]\nram_gb = 32\n')
    out = subprocess.run(
        [sys.executable, "-m", "llmgw.agent.service", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode != 0
    assert f"{bad}: unknown key 'node.ram_gb'" in out.stderr


@pytest.mark.parametrize("kind", ["a FIFO", "a device"])
def test_a_config_that_is_no_regular_file_is_refused_at_once_naming_it(tmp_path, kind):
    """A FIFO at the config's path hung the agent before it registered; a link to /dev/zero
    grew it until it died. Refused, naming the file and what to give instead."""
    path = tmp_path / "agent.toml"
    if kind == "a FIFO":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    out = subprocess.run(
        [sys.executable, "-m", "llmgw.agent.service", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode != 0
    assert f"{path}: is {kind}, not a regular file" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_config_that_is_not_utf8_or_too_large_is_refused_naming_it(tmp_path):
    from llmgw.agent.config import MAX_CONFIG_BYTES, ConfigError, load_config

    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[nats]\nurls = ["nats://127.0.0.1:4222"]\n# caf\xe9\n')
    with pytest.raises(
        ConfigError, match=r"latin1.toml: not UTF-8 text \(byte 0xe9 at line 3, column 6\)"
    ):
        load_config(latin1)
    huge = tmp_path / "huge.toml"
    huge.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match=r"huge.toml: over 1 MiB"):
        load_config(huge)


def _client_names(server) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/connz", timeout=2) as r:
        return [c.get("name", "") for c in json.load(r).get("connections", [])]


def _wait_log(path, text, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path}:\n{path.read_text() if path.exists() else ''}")


async def test_agent_reports_complete_weights_and_rescans_on_request(
    bus, nats_server, host, tmp_path
):
    from test_weights_scan import write_safetensors

    models = tmp_path / "models"
    write_safetensors(models / "llama-a" / "model.safetensors")
    (models / "empty-download").mkdir(parents=True)  # an empty directory is not weights
    cfg = agent_config(nats_server.url, host, id="w1")
    import msgspec

    cfg = msgspec.structs.replace(
        cfg, weights=msgspec.structs.replace(cfg.weights, dirs=[str(models)], scan_interval=3600)
    )
    proc = _run(cfg, host, tmp_path)
    try:
        inv = await until(lambda: _scanned(bus, "w1"))
        assert inv.weights.looked is True
        assert [m.key for m in inv.weights.models] == ["llama-a"]
        assert inv.weights.models[0].store.kind == "local"
        write_safetensors(models / "llama-b" / "model.safetensors")
        reply = json.loads(await bus.request("llmgw.agent.w1.rescan", b"", timeout=10))
        assert reply["models"] == 2
        inv = await _node(bus, "w1")
        assert [m.key for m in inv.weights.models] == ["llama-a", "llama-b"]
    finally:
        stop(proc)


async def test_agent_never_configured_to_look_says_so(bus, nats_server, host, tmp_path):
    proc = _run(agent_config(nats_server.url, host, id="w2"), host, tmp_path)
    try:
        inv = await until(lambda: _scanned(bus, "w2"))
        assert inv.weights.looked is False
        assert [d.path for d in inv.weights.dirs] == [str(host["fetch"])]
        assert (
            inv.weights.dirs[0].status == "missing"
        )  # reported, not an error that stops the agent
    finally:
        stop(proc)


# --- hostile files and bad certificates -----------------------------------------------------


def _weights_config(url: str, host, node: str, models, **weights: object):
    import msgspec

    cfg = agent_config(url, host, id=node)
    return msgspec.structs.replace(
        cfg,
        weights=msgspec.structs.replace(
            cfg.weights, dirs=[str(models)], scan_interval=3600, **weights
        ),
    )


async def test_malformed_weights_files_are_reported_and_the_agent_keeps_running(
    bus, nats_server, host, tmp_path
):
    from test_weights_formats import write_nested_gguf
    from test_weights_scan import write_safetensors

    models = tmp_path / "models"
    write_safetensors(models / "good" / "model.safetensors")
    write_nested_gguf(models / "nested.gguf", 5000)  # 60 KB; RecursionError in a naive reader
    (models / "deep").mkdir()
    (models / "deep" / "model.safetensors.index.json").write_bytes(b"[" * 100_000)
    cfg = _weights_config(nats_server.url, host, "h1", models)
    proc = _run(cfg, host, tmp_path)
    try:
        inv = await until(lambda: _scanned(bus, "h1"))
        assert [m.key for m in inv.weights.models] == ["good"]
        assert {i.key: i.reason for i in inv.weights.incomplete} == {
            "nested": "nested.gguf header does not parse",
            "deep": "model.safetensors.index.json does not parse",
        }
        # still alive: a rescan answers, and it starts again with the files in place
        reply = json.loads(await bus.request("llmgw.agent.h1.rescan", b"", timeout=10))
        assert reply["models"] == 1
    finally:
        assert stop(proc) == 0


async def test_fifos_among_the_weights_never_block_registration(bus, nats_server, host, tmp_path):
    from test_weights_scan import write_hf_repo, write_safetensors

    models = tmp_path / "models"
    write_safetensors(models / "good" / "model.safetensors")
    (models / "piped").mkdir()
    os.mkfifo(models / "piped" / "model.safetensors")  # a FIFO named as a shard
    os.mkfifo(models / ".llmgw-share-id")  # read before anything else is scanned
    repo = write_hf_repo(models / "hub", "org/name", main=False)
    (repo / "refs").mkdir()
    os.mkfifo(repo / "refs" / "main")
    cfg = _weights_config(nats_server.url, host, "f1", models)
    proc = _run(cfg, host, tmp_path)
    try:
        inv = await until(lambda: _scanned(bus, "f1"))
        assert [m.key for m in inv.weights.models] == ["good", "org/name"]
        assert inv.weights.models[0].store.kind == "local"  # the FIFO names no share
        assert {i.key: i.reason for i in inv.weights.incomplete} == {
            "piped": "model.safetensors not a regular file"
        }
    finally:
        assert stop(proc) == 0


async def test_a_weights_scan_stuck_in_a_filer_shows_in_the_inventory_and_never_blocks_heartbeats(
    bus, nats_server, host, tmp_path
):
    filer = tmp_path / "filer"
    filer.mkdir()
    cfg = _weights_config(nats_server.url, host, "s1", filer, scan_timeout=0.5)
    proc = _run(cfg, host, tmp_path, simulate=["--hung-weights-dir", str(filer)])
    try:
        registered = await until(lambda: _node(bus, "s1"))  # before any scan finished
        assert registered.weights.scanned_at == 0

        async def stuck():
            inv = await _node(bus, "s1")
            dirs = inv.weights.dirs if inv else []
            return dirs[0] if dirs and dirs[0].status == "timeout" else None

        d = await until(stuck)
        assert d.path == str(filer)
        assert re.fullmatch(rf"scan of {re.escape(str(filer))} running for \d+ s", d.detail)
        first = await until(lambda: _lease(bus, "s1"))

        async def beat_after_first():
            lease = await _lease(bus, "s1")
            return lease if lease and lease.seq > first.seq + 2 else None

        await until(beat_after_first)  # heartbeats go on while the scan thread is stuck
    finally:
        assert stop(proc) == 0  # SIGTERM is not held up by the stuck scan either


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    trustme = pytest.importorskip("trustme", reason="test extra: pip install trustme")
    d = tmp_path_factory.mktemp("certs")
    ca = trustme.CA(organization_name="llmgw-test")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    leaf = ca.issue_cert("node05.fleet.test", common_name="node05")
    leaf.cert_chain_pems[0].write_to_path(str(d / "node05.pem"))
    leaf.private_key_pem.write_to_path(str(d / "node05-key.pem"))
    return d


def _run_agent_once(cfg, tmp_path) -> subprocess.CompletedProcess[str]:
    from llmgw.agent.config import write_config

    write_config(cfg, tmp_path / "agent.toml")
    return subprocess.run(
        [sys.executable, "-m", "llmgw.agent.service", "--config", str(tmp_path / "agent.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _tls(cfg, certs, **files: str):
    import msgspec

    paths = {
        "tls_ca": str(certs / "ca.pem"),
        "tls_cert": str(certs / "node05.pem"),
        "tls_key": str(certs / "node05-key.pem"),
        **files,
    }
    return msgspec.structs.replace(cfg, nats=msgspec.structs.replace(cfg.nats, **paths))


def test_a_certificate_naming_another_node_refuses_to_start_in_one_line(host, tmp_path, certs):
    cfg = _tls(agent_config(f"tls://127.0.0.1:{free_port()}", host, id="node06"), certs)
    out = _run_agent_once(cfg, tmp_path)
    assert out.returncode == 78  # EX_CONFIG: restarting does not help
    assert "Traceback" not in out.stderr and "ExceptionGroup" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"Error: certificate CN=node05 ({certs / 'node05.pem'}) does not match node id node06 "
        f"(from config node.id); set node.id in {tmp_path / 'agent.toml'} or reissue the certificate"
    )


@pytest.mark.parametrize(
    "which, content, problem",
    [
        ("tls_cert", None, "does not exist; fix nats.tls_cert or install the file"),
        ("tls_cert", b"\x30\x82\x01\x0a not pem", "is not a PEM file holding a certificate"),
        (
            "tls_key",
            b"-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n",
            "private key",
        ),
        ("tls_ca", b"", "is not a PEM file holding a certificate"),
    ],
)
def test_a_missing_or_non_pem_tls_file_is_named_with_what_is_wrong(
    host, tmp_path, certs, which, content, problem
):
    bad = tmp_path / f"bad-{which}.pem"
    if content is not None:
        bad.write_bytes(content)
    cfg = _tls(agent_config(f"tls://127.0.0.1:{free_port()}", host, id="node05"), certs)
    out = _run_agent_once(_tls(cfg, certs, **{which: str(bad)}), tmp_path)
    assert out.returncode == 78
    assert "Traceback" not in out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith(f"Error: {bad} (nats.{which} in {tmp_path / 'agent.toml'})"), line
    assert problem in line


# --- the config -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "toml, key, allowed",
    [
        ("[engines]\nbackoff_cap = -1\n", "engines.backoff_cap", "0 < value <= 86400 seconds"),
        ("[engines]\nstop_grace = -0.5\n", "engines.stop_grace", "0 <= value <= 3600 seconds"),
        ("[intervals]\nheartbeat = nan\n", "intervals.heartbeat", "0 < value <= 3600 seconds"),
        ("[weights]\nscan_timeout = inf\n", "weights.scan_timeout", "0 < value <= 86400 seconds"),
        ("[node]\nram_total_gb = 0\n", "node.ram_total_gb", "0 < value <= 1.04858e+06 GiB"),
    ],
)
def test_config_numbers_out_of_range_are_refused_naming_file_key_and_range(toml, key, allowed):
    from llmgw.agent.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as refused:
        parse_config(toml, Path("/etc/llmgw/agent.toml"))
    assert str(refused.value).startswith(f"/etc/llmgw/agent.toml: key '{key}': ")
    assert str(refused.value).endswith(f"is out of range; allowed: {allowed}")


def test_every_number_of_the_config_has_a_range():
    import msgspec

    from llmgw.agent import config

    numbers = {
        f"{section}.{f.name}"
        for section, struct in (
            ("nats", config.Nats),
            ("node", config.Node),
            ("weights", config.Weights),
            ("intervals", config.Intervals),
            ("engines", config.Engines),
            ("paths", config.Paths),
        )
        for f in msgspec.structs.fields(struct)
        if "float" in str(f.type) or "int" in str(f.type)
    }
    assert numbers == set(config.RANGES)


def test_backoff_cap_below_its_base_is_refused():
    from llmgw.agent.config import ConfigError, parse_config

    with pytest.raises(
        ConfigError, match="'engines.backoff_cap': 2 is below engines.backoff_base 5"
    ):
        parse_config("[engines]\nbackoff_base = 5\nbackoff_cap = 2\n")


def test_config_error_is_an_llmgw_error_and_still_a_value_error():
    from llmgw.agent.config import ConfigError
    from llmgw.errors import LlmgwError

    assert issubclass(ConfigError, LlmgwError) and issubclass(ConfigError, ValueError)


async def test_gpu_processes_and_faults_are_written_at_once_and_memory_drift_within_a_report(
    bus, nats_server, host
):
    """The agent in this process, on recorded NVML answers that change while it runs."""
    import anyio
    import msgspec

    from llmgw.agent.config import Intervals
    from llmgw.agent.discovery.gpus import discover_gpus
    from llmgw.agent.inventory import Hardware
    from llmgw.agent.service import Agent
    from llmgw.sim.nvml import RecordedNvml

    nvml = RecordedNvml(count=4)
    cfg = agent_config(nats_server.url, host, id="gpu07", gpus=True)
    cfg = msgspec.structs.replace(
        cfg,
        intervals=Intervals(
            heartbeat=0.2, engine_probe=60, gpu_probe=0.1, gpu_report=1.5, port_probe=60
        ),
    )
    agent = Agent(cfg, hardware=Hardware(gpus=lambda lookup: discover_gpus(nvml, lookup)))

    async def written():
        return await bus.get("nodes.gpu07", decoder(records.NodeInventory))

    async def gpu3(cond):
        e = await written()
        return e if e is not None and cond(e.value.gpus.devices[3]) else None

    async with anyio.create_task_group() as tg:
        await tg.start(agent.run)
        first = await until(written)
        assert first.value.gpus.devices[3].processes == []
        assert first.value.gpus.devices[3].memory_used_bytes == 555_745_280

        nvml.processes = {3: [(4242, 60 * 10**9)]}  # another team's job starts
        held = await until(lambda: gpu3(lambda g: g.processes), timeout=2)
        assert [(p.pid, p.own) for p in held.value.gpus.devices[3].processes] == [(4242, False)]

        nvml.processes = {3: [(4242, 60 * 10**9 + 300_000_000)]}  # it grows by 0.3 GB
        await anyio.sleep(0.6)  # several probes: not worth a write yet
        assert (await written()).revision == held.revision
        drifted = await until(
            lambda: gpu3(lambda g: g.processes[0].used_bytes > 60 * 10**9), timeout=3
        )
        assert drifted.revision > held.revision  # within gpu_report

        nvml.ecc_uncorrected = {3: 2}  # a double-bit error
        bad = await until(lambda: gpu3(lambda g: g.errors.ecc_uncorrected_volatile), timeout=2)
        assert bad.value.gpus.devices[3].errors.ecc_uncorrected_volatile == 2
        tg.cancel_scope.cancel()
