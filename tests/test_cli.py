"""The llmgw command as a user meets it: llmgw up, catalog apply/ls, place, status, agent init."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import anyio
import msgspec
import psutil
import pytest
from agent_helpers import host_dirs
from import_helpers import loaded
from record_helpers import shard
from test_placement import two_profiles
from waiting import until, until_logged

from llmgw.agent.config import AgentConfig, Engines, Intervals, Paths, write_config
from llmgw.bus import keys, records
from llmgw.bus.client import Bus, decoder
from llmgw.bus.server import free_port
from llmgw.catalog import Model, encode_model, validate_models
from llmgw.cli.place import dry_run_plan, follow_placement
from llmgw.cli.status import gather, render
from llmgw.controller.loop import Controller, ControllerSettings
from llmgw.sim.bare import SimNode, inventory
from llmgw.sim.fake_engine import install_fake_engines, write_fake_gguf

LLMGW = [sys.executable, "-m", "llmgw.cli"]


def llmgw(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LLMGW, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _catalog(tmp: Path, gguf: Path) -> Path:
    path = tmp / "catalog.toml"
    path.write_text(f"""
[[models]]
id = "tiny"
served_name = "tiny-chat"

[[models.profiles]]
name = "cpu"
engine = "llama-server"
weights = {{ path = "{gguf}" }}
gpus_per_node = 0
host_ram_gb = 1
""")
    return path


@pytest.fixture
def up(tmp_path):
    """`llmgw up` as a user runs it, with the fake engine installed as llama-server."""
    dirs = host_dirs(tmp_path)
    install_fake_engines(dirs["bin"])
    cfg = AgentConfig(
        intervals=Intervals(heartbeat=0.5),
        engines=Engines(listen_host="127.0.0.1", poll_interval=0.1),
        paths=Paths(state_dir=str(tmp_path / "state"), llama_search_dirs=[]),
    )
    write_config(cfg, tmp_path / "agent.toml")
    port, router_port = free_port(), free_port()
    env = {**os.environ, "PATH": f"{dirs['bin']}{os.pathsep}{os.environ['PATH']}"}
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            *LLMGW,
            "up",
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path / "data"),
            "--agent-config",
            str(tmp_path / "agent.toml"),
            "--router-listen",
            f"127.0.0.1:{router_port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"nats://127.0.0.1:{port}"
    until_logged(proc, tmp_path / "up.log", "router listening")
    yield {
        "url": url,
        "router": f"http://127.0.0.1:{router_port}",
        "proc": proc,
        "tmp": tmp_path,
        "env": {"LLMGW_NATS": url},
        "log": tmp_path / "up.log",
    }
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(15)
    log.close()


@pytest.mark.slow
def test_up_then_catalog_place_status_serve_and_ctrl_c_stops_everything(up):
    out = llmgw(
        "catalog",
        "apply",
        str(_catalog(up["tmp"], write_fake_gguf(up["tmp"] / "tiny.gguf"))),
        env=up["env"],
    )
    assert out.returncode == 0, out.stderr
    assert "catalog.tiny: created" in out.stdout
    ls = llmgw("catalog", "ls", env=up["env"])
    assert "tiny  (tiny-chat)  cpu: llama-server, CPU" in ls.stdout

    placed = llmgw("place", "tiny", "--replicas", "1", "--wait", "--timeout", "60", env=up["env"])
    assert placed.returncode == 0, placed.stdout + placed.stderr
    assert "1/1 ready" in placed.stdout
    assert "why: " in placed.stdout  # where it went, and why there
    again = llmgw("place", "tiny", "--replicas", "1", env=up["env"])  # the same request again
    assert again.returncode == 0 and "no controller has decided" not in again.stdout
    assert " ready on " in again.stdout

    status = json.loads(llmgw("status", "--json", env=up["env"]).stdout)
    tiny = status["models"]["tiny"]  # what a script asks: is it ready, where, and if not why
    assert (tiny["desired"], tiny["ready"], tiny["why_not"]) == (1, 1, "")
    (replica,) = tiny["replicas"]
    assert replica["phase"] == "ready" and replica["endpoint"]
    assert tiny["serving"] == replica["nodes"]
    text = llmgw("status", env=up["env"]).stdout
    assert f"{replica['rid']}  ready" in text and "tiny: 1/1 ready" in text
    assert text.index("\nmodels\n") < text.index("\nnodes\n")  # models first

    import urllib.request

    # through the router, by the served name: no engine port in sight
    body = json.dumps(
        {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    req = urllib.request.Request(
        f"{up['router']}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["x-llmgw-replica"] == replica["rid"]
        assert json.load(r)["choices"][0]["message"]["content"]
    startup = up["log"].read_text()
    assert f"router listening on {up['router']}/v1" in startup
    assert f"store {up['tmp'] / 'data'}" in startup and "persist" in startup

    removed = llmgw("place", "tiny", "--replicas", "0", "--wait", "--timeout", "60", env=up["env"])
    assert removed.returncode == 0 and "all replicas removed" in removed.stdout  # drained first
    assert (
        json.loads(llmgw("status", "--json", env=up["env"]).stdout)["models"]["tiny"]["replicas"]
        == []
    )
    assert (
        llmgw(
            "place", "tiny", "--replicas", "1", "--wait", "--timeout", "60", env=up["env"]
        ).returncode
        == 0
    )

    children = psutil.Process(up["proc"].pid).children(recursive=True)
    assert any("nats-server" in " ".join(c.cmdline()) for c in children)
    up["proc"].send_signal(signal.SIGINT)  # Ctrl-C
    assert up["proc"].wait(15) == 0
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"left running after Ctrl-C: {[' '.join(p.cmdline()) for p in alive]}"
    assert "stopped" in up["log"].read_text()


def test_place_explains_what_cannot_be_placed_and_dry_run_writes_nothing(up):
    cat = up["tmp"] / "big.toml"
    cat.write_text("""
[[models]]
id = "big"
[[models.profiles]]
name = "tp8"
engine = "vllm"
weights = { source = "hf://org/big" }
gpus_per_node = 8
""")
    assert llmgw("catalog", "apply", str(cat), env=up["env"]).returncode == 0
    dry = llmgw("place", "big", "--replicas", "2", "--dry-run", env=up["env"])
    assert dry.returncode == 0
    assert "dry run: big x2 (nothing written)" in dry.stdout
    assert "0/2 placed; 0/1 nodes fit: 1 " in dry.stdout
    big = json.loads(llmgw("status", "--json", env=up["env"]).stdout)["models"]["big"]
    assert (big["desired"], big["placement"]) == (0, None)  # in the catalog, asked for nothing
    waited = llmgw("place", "big", "--replicas", "2", "--wait", "--timeout", "20", env=up["env"])
    assert waited.returncode == 1  # explained, not placed
    assert "0/2 placed: 0/1 nodes fit: 1 " in waited.stdout
    assert "unplaced: 0/1 nodes fit" in llmgw("status", env=up["env"]).stdout


def test_catalog_with_errors_is_refused_whole_and_nothing_is_written(up):
    cat = up["tmp"] / "bad.toml"
    cat.write_text("""
[[models]]
id = "ok-model"
[[models.profiles]]
name = "a"
engine = "vllm"
weights = { key = "org/ok" }
gpus_per_node = 1

[[models]]
id = "bad model"
[[models.profiles]]
name = "b"
engine = "tensorrt"
weights = { key = "org/bad" }
gpus_per_node = -1
""")
    out = llmgw("catalog", "apply", str(cat), env=up["env"])
    assert out.returncode == 1
    assert "catalog refused, nothing written" in out.stderr
    assert "gpus_per_node" in out.stderr and "engine" in out.stderr
    assert "ok-model" not in llmgw("catalog", "ls", env=up["env"]).stdout


def test_place_refuses_a_model_not_in_the_catalog(up):
    out = llmgw("place", "nope", "--replicas", "1", env=up["env"])
    assert out.returncode == 2
    assert (
        "model 'nope' is not in the catalog" in out.stderr and "llmgw catalog apply" in out.stderr
    )


def test_agent_init_writes_only_what_it_was_given(tmp_path):
    path = tmp_path / "agent.toml"
    out = llmgw(
        "agent",
        "init",
        "--nats",
        "nats://10.0.0.1:4222",
        "--config",
        str(path),
        "--fabric",
        "mlx5_0=ib-a",
        "--ram-gb",
        "32",
    )
    assert out.returncode == 0, out.stderr
    written = tomllib.loads(path.read_text())
    assert written == {
        "nats": {"urls": ["nats://10.0.0.1:4222"]},
        "node": {"ram_total_gb": 32.0},
        "fabrics": {"mlx5_0": "ib-a"},
        # a fleet node serves its metrics on the documented port unless told otherwise
        "metrics": {"listen": "0.0.0.0:9464"},
    }
    again = llmgw("agent", "init", "--nats", "nats://x:4222", "--config", str(path))
    assert again.returncode == 1 and "--force" in again.stderr
    bad = llmgw(
        "agent",
        "init",
        "--nats",
        "nats://x:4222",
        "--config",
        str(tmp_path / "b.toml"),
        "--fabric",
        "mlx5_0",
    )
    assert bad.returncode == 2 and "ADAPTER=FABRIC" in bad.stderr


# --- status and place, on a real bus without `llmgw up` -----------------------------------


def _tiny_gpu_model(mid: str = "m") -> Model:
    profile = {"name": "p", "engine": "vllm", "weights": {"key": "org/m"}, "gpus_per_node": 1}
    return validate_models({"models": [{"id": mid, "profiles": [profile]}]})[0]


def _replica(rid: str, phase: str, gpu: int) -> records.Replica:
    member = records.ReplicaMember(node="n1", rank=0, gpus=[f"GPU-n1-{gpu:02d}"], port=18000 + gpu)
    return records.Replica(model="m", rid=rid, profile="p", members=[member], phase=phase)


@pytest.mark.anyio
async def test_status_counts_a_draining_replica_apart_and_dates_the_health_reason(bus):
    now = time.time()
    await bus.put(keys.node("n1"), inventory("n1", gpus=2))
    health = records.Health(
        node="n1", phase="ready", since=now - 7200, reason="lease seq 1 moved 1 s ago"
    )
    await bus.put(keys.health("n1"), health)
    await bus.put(keys.desired("m"), records.Desired(model="m", replicas=1))
    await bus.put(keys.replica("m", "r-new"), _replica("r-new", "ready", 0))
    await bus.put(keys.replica("m", "r-old"), _replica("r-old", "draining", 1))
    await bus.put(keys.shard("n1", "r-new"), shard("n1", "r-new", endpoint="127.0.0.1:18000"))
    text = render(await gather(bus), now=now)
    assert "  m: 1/1 ready, 1 draining" in text
    assert "  health  recorded 2.0h ago: lease seq 1 moved 1 s ago" in text


@pytest.mark.anyio
async def test_status_says_what_a_replica_waits_for_before_launch_without_calling_it_failed(bus):
    await bus.put(keys.node("n1"), inventory("n1", gpus=2))
    await bus.put(keys.desired("m"), records.Desired(model="m", replicas=1))
    await bus.put(keys.replica("m", "r1"), _replica("r1", "starting", 0))
    why = "waiting: GPU GPU-n1-00 has 10.0 GB free, less than the 40 GB this replica is given"
    await bus.put(keys.shard("n1", "r1"), shard("n1", "r1", "validating", reason=why))
    text = render(await gather(bus), now=time.time())
    assert "on n1  shards validating" in text
    assert f"      n1: {why}" in text and "failed" not in text


@pytest.mark.anyio
async def test_dry_run_names_no_replica_id_the_controller_would_not_use(bus):
    await bus.put(keys.catalog("m"), encode_model(_tiny_gpu_model()))
    sim = SimNode(bus, inventory("n1", gpus=2))
    await sim.register()
    lines = await dry_run_plan(bus, "m", 2, None)
    placed = [line for line in lines if "would place" in line]
    assert len(placed) == 2, lines
    assert all(line.startswith("  would place a replica on n1 (rank 0, 1 GPU") for line in placed)
    assert not re.search(r"\br[0-9a-f]{10}\b", "\n".join(lines)), lines


def _health(node: str, phase: str) -> records.Health:
    return records.Health(node=node, phase=phase, since=1.0, reason="recorded by a leader")


@pytest.mark.anyio
async def test_dry_run_places_where_the_controller_then_does_past_a_node_without_a_lease(
    bus, nats_settings
):
    """The dry run and the controller build the plan's input with one function: a node
    recorded ready whose lease is gone is unreachable to both (the old dry run took the
    record's word and placed there); a frozen model's replica holds its GPU for both."""
    await bus.put(keys.catalog("m"), encode_model(_tiny_gpu_model()))
    await bus.put(keys.catalog("f"), b'{"id": "f", "profiles": [{"name": 1}]}')  # frozen
    await bus.put(keys.desired("f"), records.Desired(model="f", replicas=1))
    member = records.ReplicaMember(node="a", rank=0, gpus=["GPU-a-00"], port=18000)
    await bus.put(
        keys.replica("f", "rf"), records.Replica(model="f", rid="rf", profile="p", members=[member])
    )
    for name in ("a", "b", "c", "d"):  # one GPU each; a's is held by f's replica
        sim = SimNode(bus, inventory(name, gpus=1))
        if name == "b":
            await bus.put(keys.node("b"), sim.inv)  # its lease is gone, its record says ready
        else:
            await sim.register()
    await bus.put(keys.health("b"), _health("b", "ready"))
    await bus.put(keys.health("c"), _health("c", "lost"))  # and its lease has not moved since

    lines = await dry_run_plan(bus, "m", 1, None)
    assert [line for line in lines if "would place" in line] == [
        "  would place a replica on d (rank 0, 1 GPU, port 18000): "
        "no copy of the weights nearby (the engine fetches org/m); node has all 1 GPUs free"
    ], lines

    await bus.put(keys.desired("m"), records.Desired(model="m", replicas=1))
    async with await Bus.connect(nats_settings, give_up_after=5) as own:
        controller = Controller(own, ControllerSettings(tick=0.05, resync=0.5))
        async with anyio.create_task_group() as tg:
            tg.start_soon(controller.run)
            (placed,) = await until(lambda: _replicas_of(bus, "m"))
            tg.cancel_scope.cancel()
    assert [m.node for m in placed.members] == ["d"]
    assert [r.rid for r in await _replicas_of(bus, "f")] == ["rf"]  # frozen: left as it was


async def _replicas_of(bus, model: str) -> list[records.Replica]:
    got = await bus.list(f"{keys.REPLICAS}.{model}.*", decoder(records.Replica))
    return [e.value for e in got.values()]


def test_status_without_nats_says_what_to_do_in_one_line_without_retrying():
    """`llmgw status` with no NATS retried for 6 s and printed two warnings before its one
    useful line: nothing listening is an answer at the first attempt."""
    url = f"nats://127.0.0.1:{free_port()}"
    out = llmgw("status", "--nats", url)
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        f"Error: cannot connect to NATS at {url}: no server listens there (connection "
        "refused); is llmgw up (or your NATS cluster) running? set --nats or LLMGW_NATS"
    ]


@pytest.mark.anyio
async def test_dry_run_previews_a_count_written_over_one_that_does_not_read(bus):
    """The count `place` would write replaces the garbled one: the preview places (it said
    the model was frozen and advised running the very command it previewed)."""
    await bus.put(keys.catalog("m"), encode_model(_tiny_gpu_model()))
    await bus.put(keys.desired("m"), b'{"model": "m", "replicas": "two"}')
    await SimNode(bus, inventory("n1", gpus=1)).register()
    lines = await dry_run_plan(bus, "m", 1, None)
    assert [line for line in lines if "would place" in line], lines
    assert "1/1 placed" in lines[-1], lines
    assert not [line for line in lines if "frozen" in line or "llmgw place" in line], lines


@pytest.mark.anyio
async def test_dry_run_says_what_it_assumed_where_it_cannot_know_what_the_controller_knows(bus):
    await bus.put(keys.catalog("m"), encode_model(_tiny_gpu_model()))
    await SimNode(bus, inventory("n1", gpus=1)).register()
    lines = await dry_run_plan(bus, "m", 1, None)
    assumed = [line for line in lines if line.startswith("  assumed: ")]
    assert "ports 18000-18999, the controller's default" in assumed[0], lines
    assert "(a dry run does not watch leases move)" in assumed[1], lines


@pytest.mark.anyio
async def test_place_wait_counts_the_replicas_placement_counts_a_stopped_one_is_not_one_of_them(
    bus,
):
    # placement counts neither a draining nor a stopped replica toward desired; `--wait`
    # counted the stopped one and waited for a second replica nobody would place
    decided = records.PlacementRecord(model="m", desired=1, placed=1, desired_at=1.0)
    await bus.put(keys.placement("m"), decided)
    await bus.put(keys.replica("m", "r-new"), _replica("r-new", "ready", 0))
    await bus.put(keys.replica("m", "r-old"), _replica("r-old", "stopped", 1))
    said: list[str] = []
    code = await follow_placement(
        bus, "m", 1.0, wait=True, timeout=2.0, echo=said.append, poll=0.02
    )
    assert code == 0, said
    assert said[-1] == "  1/1 ready"


@pytest.mark.anyio
async def test_place_wait_says_once_that_a_value_does_not_decode(bus, caplog):
    await bus.put(keys.placement("m"), b'{"model": "m", "desired": "one"}')
    await bus.put(keys.replica("m", "rbad"), b"not json")
    said: list[str] = []
    code = await follow_placement(
        bus, "m", 1.0, wait=True, timeout=1.0, echo=said.append, poll=0.02
    )
    assert code == 2  # no decision came
    # kept on the log: what is tested is how often the terminal is told, once per value
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert sum("skipping placement.m " in w for w in warnings) == 1, warnings
    assert sum("skipping replicas.m.rbad " in w for w in warnings) == 1, warnings


# --- llmgw up remembers, llmgw router ------------------------------------------------------


def _start_up(tmp_path: Path, env: dict, log_name: str) -> tuple[subprocess.Popen, Path]:
    log_path = tmp_path / log_name
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                *LLMGW,
                "up",
                "--port",
                str(free_port()),
                "--data-dir",
                str(tmp_path / "data"),
                "--agent-config",
                str(tmp_path / "agent.toml"),
                "--router-listen",
                f"127.0.0.1:{free_port()}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    until_logged(proc, log_path, "router listening", timeout=30)
    return proc, log_path


@pytest.mark.slow
def test_up_restarted_without_the_engine_says_which_replicas_return_and_what_is_missing(up):
    gguf = write_fake_gguf(up["tmp"] / "tiny.gguf")
    assert llmgw("catalog", "apply", str(_catalog(up["tmp"], gguf)), env=up["env"]).returncode == 0
    assert llmgw("place", "tiny", "--replicas", "1", env=up["env"]).returncode == 0
    up["proc"].send_signal(signal.SIGINT)
    assert up["proc"].wait(15) == 0
    # the next day: same store, but llama-server is no longer on PATH
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + "/usr/bin:/bin"}
    proc, log_path = _start_up(up["tmp"], env, "up-again.log")
    try:
        until_logged(None, log_path, "needs llama-server")
        out = log_path.read_text()
        assert "placed again now: tiny x1" in out
        assert "place tiny --replicas 0" in out
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(15)


def _router_proc(args: list[str], tmp_path: Path) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log_path = tmp_path / "router.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*LLMGW, "router", *args, "--listen", f"127.0.0.1:{port}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return proc, f"http://127.0.0.1:{port}", log_path


def test_router_only_run_serves_static_endpoints_without_any_nats(tmp_path):
    import urllib.request

    from router_helpers import fake_engines

    with fake_engines(tmp_path) as fleet:
        engine = fleet.start()
        cat = tmp_path / "static.toml"
        cat.write_text(
            f'[[models]]\nid = "tiny"\nserved_name = "tiny-chat"\nendpoints = ["{engine.url}"]\n'
        )
        proc, url, log_path = _router_proc(["--catalog", str(cat)], tmp_path)
        try:
            until_logged(proc, log_path, "router listening")
            with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
                assert [m["id"] for m in json.load(r)["data"]] == ["tiny-chat"]
            body = json.dumps(
                {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}
            )
            req = urllib.request.Request(
                f"{url}/v1/chat/completions",
                data=body.encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=10) as r:
                assert json.load(r)["choices"][0]["message"]["content"]
            with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
                assert json.load(r)["source"] == "catalog file"
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0
    assert "nats" not in log_path.read_text().lower()


def test_router_refuses_what_it_cannot_serve_and_says_why(tmp_path):
    cat = tmp_path / "placed-only.toml"
    cat.write_text(_catalog(tmp_path, tmp_path / "x.gguf").read_text())
    out = llmgw("router", "--catalog", str(cat))
    assert out.returncode != 0 and "no model with `endpoints`" in out.stderr
    out = llmgw("router", "--catalog", str(cat), "--nats", "nats://127.0.0.1:4222")
    assert out.returncode != 0 and "--catalog runs the router without NATS" in out.stderr
    out = llmgw("router", "--catalog", str(cat), "--engine-api-key-file", str(tmp_path / "none"))
    assert out.returncode != 0 and "cannot read the engine API key file" in out.stderr
    assert "Traceback" not in out.stderr
    out = llmgw("router", "--listen", "8080")
    assert out.returncode != 0 and "expected HOST:PORT" in out.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[[models]]\nid = "m"\n')
    out = llmgw("router", "--catalog", str(bad))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert f"catalog refused, nothing written (1 error(s)):\n  {bad}: model 'm'" in out.stderr


def test_up_on_a_port_nats_already_holds_says_so_without_a_traceback(up, tmp_path):
    taken = up["env"]["LLMGW_NATS"].rsplit(":", 1)[1]
    # its own router port: only NATS's may be the one taken (8080 may be another program's)
    router = f"127.0.0.1:{free_port()}"
    second = str(tmp_path / "second")
    out = llmgw("up", "--port", taken, "--data-dir", second, "--router-listen", router, timeout=30)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    # the holder is named: it is an llmgw
    assert f"NATS 127.0.0.1:{taken} is in use by the NATS of llmgw up (pid {up['proc'].pid}; " in (
        out.stderr
    )
    assert "move it with --port" in out.stderr


def test_commands_that_run_no_agent_do_not_load_its_stack():
    # (aiohttp is loaded by nats-py itself, for its websocket transport)
    stack = ("psutil", "pynvml", "llmgw.agent.service", "llmgw.agent.discovery")
    assert loaded("llmgw.cli", modules=(*stack, "llmgw.router.service")) == []


def test_a_problem_stated_for_a_person_is_a_message_not_a_traceback(up):
    out = llmgw("place", "not.a.token", "--replicas", "1", env=up["env"])
    assert out.returncode == 2  # names nothing there, as a usage error
    assert "is not in the catalog" in out.stderr and "Traceback" not in out.stderr
    out = llmgw("place", "nope", "--replicas", "1", "--bucket-replicas", "9", env=up["env"])
    assert out.returncode == 2 and "--bucket-replicas" in out.stderr


def test_pki_is_a_command_of_llmgw(tmp_path):
    out = llmgw("pki", "init", "--dir", str(tmp_path / "pki"))
    assert out.returncode == 0, out.stderr
    out = llmgw("pki", "issue", "node05", "--dir", str(tmp_path / "pki"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "pki" / "ca.pem").exists()
    assert any("node05" in p.name for p in (tmp_path / "pki").iterdir())


def test_place_refuses_a_count_over_the_bound_before_writing_anything():
    """It wrote 20000 unchecked, said 'no controller has decided yet' and exited 0, and the
    controller read the value as absent: a drained model."""
    for extra in ([], ["--dry-run"]):
        out = llmgw(
            "place", "tiny", "--replicas", "20000", *extra, env={"LLMGW_NATS": "nats://127.0.0.1:1"}
        )
        assert out.returncode == 2
        assert "at most 10,000" in out.stderr and "typo" in out.stderr


@pytest.mark.anyio
async def test_status_names_a_few_bad_keys_and_counts_the_rest(bus, caplog):
    """2,000 garbage keys made `llmgw status` print 1,334 warnings."""
    caplog.set_level(logging.WARNING, logger="llmgw")
    for i in range(200):
        await bus.put(f"desired.g{i}", b"garbage")
    view = await gather(bus)
    await gather(bus)  # read again: nothing said twice
    # kept on the log: the number of lines the terminal is given is the behaviour here
    said = [r for r in caplog.records if r.getMessage().startswith("skipping desired.g")]
    assert len(said) == 20
    assert sum("counted, not named" in r.getMessage() for r in caplog.records) == 1
    text = render(view, now=time.time())
    assert "skipped 200 value(s) that do not decode or are not believed" in text


# --- llmgw node, llmgw rollout, what status says of failures -----------------------------------


async def _llmgw(url: str, *args: str) -> subprocess.CompletedProcess:
    return await anyio.to_thread.run_sync(lambda: llmgw(*args, env={"LLMGW_NATS": url}))


async def _ops(bus: Bus, node: str) -> records.NodeOps | None:
    entry = await bus.get(keys.ops(node), decoder(records.NodeOps))
    return entry.value if entry else None


@pytest.mark.anyio
async def test_node_cordon_drain_gpu_and_taint_are_the_operators_ops_record(bus, nats_server):
    url = nats_server.url
    await bus.put(keys.node("n1"), inventory("n1", gpus=2))
    out = await _llmgw(url, "node", "cordon", "n1", "--reason", "fan noise")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ops.n1: cordoned"
    assert (await _ops(bus, "n1")).cordoned
    out = await _llmgw(url, "node", "cordon", "n1", "--gpu", "1")
    assert (await _ops(bus, "n1")).gpus_out == ["GPU-n1-01"]
    out = await _llmgw(url, "node", "cordon", "n1", "--gpu", "7")
    assert out.returncode == 1 and "node n1 has no GPU '7' (its GPUs: 0 (GPU-n1-00)" in out.stderr
    await bus.put(keys.replica("m", "r1"), _replica("r1", "ready", 0))
    out = await _llmgw(url, "node", "drain", "n1", "--force")
    assert out.returncode == 0, out.stderr
    assert "  m r1 on n1: to be replaced elsewhere, then drained" in out.stdout
    assert "drained anyway (--force)" in out.stdout and "'drained by force'" in out.stdout
    out = await _llmgw(url, "node", "taint", "n1", "gpu-flaky")
    ops = await _ops(bus, "n1")
    assert (ops.drain, ops.force, ops.taints, ops.reason) == (
        True,
        True,
        ["gpu-flaky"],
        "fan noise",
    )

    text = (await _llmgw(url, "status")).stdout
    assert (
        "  ops     draining (--force); GPUs out of service: GPU-n1-01 (index 1) (fan noise)" in text
    )
    assert "  taints  gpu-flaky (operator)" in text
    assert "gpu.model=H100-80GB-HBM3" in text and "node=n1" in text  # what selectors can ask

    for args in (["uncordon", "n1"], ["uncordon", "n1", "--gpu", "GPU-n1-01"]):
        assert (await _llmgw(url, "node", *args)).returncode == 0
    assert (await _ops(bus, "n1")).taints == ["gpu-flaky"]
    assert (await _llmgw(url, "node", "untaint", "n1", "gpu-flaky")).returncode == 0
    assert await _ops(bus, "n1") is None  # asks nothing any more: gone


@pytest.mark.anyio
async def test_status_says_why_a_replica_failed_with_the_engines_last_lines(bus):
    await bus.put(keys.desired("m"), records.Desired(model="m", replicas=1))
    await bus.put(keys.replica("m", "r1"), _replica("r1", "failed", 0))
    record = shard(
        "n1",
        "r1",
        "failed",
        reason="exited with code 1 while loading",
        output_tail=["loading", "", "llama_model_load: error loading model: CUDA error"],
        restarts=3,
    )
    await bus.put(keys.shard("n1", "r1"), record)
    text = render(await gather(bus), now=time.time())
    assert "      n1: exited with code 1 while loading (restarts 3)" in text
    assert "        | llama_model_load: error loading model: CUDA error" in text


def _with_context(context: int) -> Model:
    profile = {
        "name": "p",
        "engine": "vllm",
        "weights": {"key": "org/m"},
        "gpus_per_node": 1,
        "context": context,
    }
    return validate_models({"models": [{"id": "m", "profiles": [profile]}]})[0]


def _rollout(**fields) -> records.Rollout:
    launch = records.ProfileRevision(name="p", launch="new", content={})
    current = records.Revision(profiles=[launch], since=1.0)
    return records.Rollout(model="m", current=current, desired=1, desired_at=1.0, **fields)


@pytest.mark.anyio
async def test_place_wait_follows_a_rollout_to_its_end_and_stops_with_it(bus):
    decided = records.PlacementRecord(model="m", desired=1, placed=1, desired_at=1.0)
    await bus.put(keys.placement("m"), decided)
    await bus.put(keys.replica("m", "r-new"), _replica("r-new", "ready", 0))
    await bus.put(keys.rollout("m"), _rollout(phase="progressing", updated=1, ready=1, old=1))
    said: list[str] = []
    code = await follow_placement(
        bus, "m", 1.0, wait=True, timeout=1.0, echo=said.append, poll=0.02
    )
    assert code == 2, said  # every replica is ready, but the rollout is not over
    assert (
        "  rollout progressing: 1/1 updated (1 ready), 1 old (surge 1, max_unavailable 0)" in said
    )
    stopped = _rollout(phase="stopped", reason="new replica r-new failed", output_tail=["boom"])
    await bus.put(keys.rollout("m"), stopped)
    said.clear()
    code = await follow_placement(
        bus, "m", 1.0, wait=True, timeout=5.0, echo=said.append, poll=0.02
    )
    assert code == 1 and said == ["  rollout stopped: new replica r-new failed\n      | boom"]
    await bus.put(keys.rollout("m"), _rollout(phase="complete", updated=1, ready=1))
    said.clear()
    code = await follow_placement(
        bus, "m", 1.0, wait=True, timeout=5.0, echo=said.append, poll=0.02
    )
    assert code == 0 and said[-1] == "  1/1 ready"


@pytest.mark.anyio
async def test_rollout_undo_writes_the_earlier_profile_back_and_status_shows_the_history(
    bus, nats_server
):
    old, now = _with_context(4096), _with_context(8192)
    from llmgw.catalog import launch_hash

    def revision(m: Model) -> records.Revision:
        p = m.profiles[0]
        content = msgspec.to_builtins(p)
        return records.Revision(
            served_name=m.served_name,
            profiles=[records.ProfileRevision(name="p", launch=launch_hash(m, p), content=content)],
            completed_at=1.0,
        )

    await bus.put(keys.catalog("m"), encode_model(now))
    ro = records.Rollout(
        model="m", phase="complete", current=revision(now), history=[revision(old)]
    )
    await bus.put(keys.rollout("m"), ro)
    url = nats_server.url
    text = (await _llmgw(url, "rollout", "status", "m")).stdout
    assert text.startswith("m: rollout complete\n")
    assert (
        f"history (`llmgw rollout undo` goes back to the last)\n    the catalog's profiles in order: p (launch {launch_hash(old, old.profiles[0])})"
        in text
    )
    out = await _llmgw(url, "rollout", "undo", "m")
    assert out.returncode == 0, out.stderr
    entry = await bus.get(
        keys.catalog("m"), lambda b: validate_models({"models": [json.loads(b)]})[0]
    )
    assert entry.value == old
    await bus.put(
        keys.rollout("m"), records.Rollout(model="m", phase="complete", current=revision(now))
    )
    out = await _llmgw(url, "rollout", "undo", "m")
    assert out.returncode == 1 and "no earlier revision to go back to" in out.stderr


@pytest.mark.anyio
async def test_rollout_undo_after_a_profile_switch_asks_for_the_earlier_profile_again(
    bus, nats_server
):
    """`llmgw place m --profile q` switched profiles: undo names `p` again in desired.m,
    leaves the catalog alone (its content did not change), and --wait follows the
    controller's rollout back to its end."""
    from llmgw.catalog import launch_hash

    two = two_profiles(key="org/m")
    profiles = [
        records.ProfileRevision(
            name=p.name, launch=launch_hash(two, p), content=msgspec.to_builtins(p)
        )
        for p in two.profiles
    ]
    on_p = records.Revision(profile="p", profiles=profiles, completed_at=1.0)
    on_q = records.Revision(profile="q", profiles=profiles, since=2.0)
    await bus.put(keys.catalog("m"), encode_model(two))
    await bus.put(keys.desired("m"), records.Desired(model="m", replicas=1, profile="q"))
    await bus.put(
        keys.rollout("m"),
        records.Rollout(model="m", phase="progressing", current=on_q, history=[on_p]),
    )
    url = nats_server.url

    async def controller_follows() -> None:
        # what the controller does once desired names p again: p's revision is current
        # and complete, and placement has answered the new desired
        async def asked_for_p():
            got = await bus.get(keys.desired("m"), decoder(records.Desired))
            return got.value if got and got.value.profile == "p" else None

        chosen = await until(asked_for_p, timeout=20)
        await bus.put(
            keys.rollout("m"),
            records.Rollout(model="m", phase="complete", current=on_p, history=[on_q]),
        )
        await bus.put(
            keys.placement("m"),
            records.PlacementRecord(model="m", desired=1, placed=1, desired_at=chosen.updated_at),
        )
        await bus.put(keys.replica("m", "r1"), _replica("r1", "ready", 0))

    async with anyio.create_task_group() as tg:
        tg.start_soon(controller_follows)
        out = await _llmgw(url, "rollout", "undo", "m", "--wait", "--timeout", "20")
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert "desired.m: profile p" in out.stdout and "catalog.m" not in out.stdout
    desired = await bus.get(keys.desired("m"), decoder(records.Desired))
    assert desired.value.profile == "p" and desired.value.replicas == 1
    assert (await bus.get(keys.catalog("m"), lambda b: b)).value == encode_model(two)


@pytest.mark.anyio
async def test_drain_wait_names_the_replicas_with_nowhere_to_go_and_ends_once_none_is_left(bus):
    from llmgw.cli.node import follow_drain

    await bus.put(keys.replica("m", "r1"), _replica("r1", "ready", 0))
    waiting = records.PlacementRecord(
        model="m",
        desired=1,
        placed=1,
        waiting=1,
        explanation="1 replacement (rollout or drain) waits for a node: 0/1 nodes fit: 1 draining",
    )
    await bus.put(keys.placement("m"), waiting)
    said: list[str] = []
    code = await follow_drain(bus, "n1", timeout=5, echo=said.append, poll=0.02, settle=0.1)
    assert code == 1, said
    assert said[0] == "  m r1 on n1: ready"
    assert said[1].startswith("  m r1 cannot be placed elsewhere: 1 replacement (rollout or")
    assert "`llmgw node drain n1 --force` drains them anyway" in said[2]

    forced = msgspec.structs.replace(
        _replica("r1", "draining", 0), reason="drained by force: nowhere else to place it (...)"
    )
    await bus.put(keys.replica("m", "r1"), forced)
    said.clear()

    async def removed_later() -> None:
        await anyio.sleep(0.3)
        await bus.delete(keys.replica("m", "r1"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(removed_later)
        code = await follow_drain(
            bus, "n1", force=True, timeout=5, echo=said.append, poll=0.02, settle=0.1
        )
    assert code == 0
    assert said == [
        "  m r1 on n1: draining (drained by force: nowhere else to place it (...))",
        "  no replica left on n1",
    ]
