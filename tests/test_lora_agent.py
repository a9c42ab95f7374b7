"""The agent's side of LoRA adapters, without NATS: what it asks a running vLLM (agent/lora.py
LoraSync, against an engine that answers as vLLM 0.32 does), which adapters llama-server is
started with, and the command lines both engines get."""

from __future__ import annotations

import json

import pytest

from llmgw.agent.engines import LaunchSpec, adapter_for
from llmgw.agent.engines.vllm import loras_in_use
from llmgw.agent.lora import LoraSync, adopted_files, started_with
from llmgw.bus.records import AdapterAssigned, HeldAdapter, LoraRoom, Store
from llmgw.sim.fake_engine import write_fake_gguf
from llmgw.sim.fake_lora import VllmLoras
from llmgw.sim.tiny_lora import write_gguf_lora, write_peft_adapter

pytestmark = pytest.mark.anyio


class Engine:
    """vLLM's runtime LoRA API, answered by the fake engine's own rules."""

    def __init__(self) -> None:
        self.loras = VllmLoras(enabled=True, max_rank=8, max_loras=4, max_cpu_loras=4)
        self.asked: list[tuple[str, str]] = []
        self.down = False

    async def ask(self, method: str, path: str, body: bytes | None):
        self.asked.append((method, path))
        if self.down:
            return None
        if path == "/v1/models":
            entries = self.loras.model_entries("tiny", 0)
            return 200, json.dumps({"data": [{"id": "tiny"}, *entries]}).encode()
        if path == "/metrics":
            return 200, self.loras.metrics().encode()
        do = self.loras.load if path.endswith("/load_lora_adapter") else self.loras.unload
        args = (json.loads(body), "tiny") if do == self.loras.load else (json.loads(body),)
        status, answer = do(*args)
        return status, answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def assigned(tmp_path, name: str, rank: int = 8) -> AdapterAssigned:
    path = write_peft_adapter(tmp_path / name, rank=rank)
    return AdapterAssigned(id=name, name=f"acme/{name}", path=str(path), rank=rank)


async def test_an_adapter_asked_for_is_loaded_and_one_refused_is_said_once(tmp_path):
    engine, clock = Engine(), Clock()
    sync = LoraSync(engine.ask, clock)
    sql, big = assigned(tmp_path, "sql"), assigned(tmp_path, "big", rank=16)
    assert await sync.sync([sql, big])
    assert sync.served() == ["sql"] and list(engine.loras.loaded) == ["acme/sql"]
    (failure,) = sync.failures()
    assert (failure.adapter, failure.reason) == (
        "big",
        "LoRA rank 16 is greater than max_lora_rank 8.",
    )
    loads = engine.asked.count(("POST", "/v1/load_lora_adapter"))
    assert not await sync.sync([sql, big])  # nothing new: nothing asked again
    assert engine.asked.count(("POST", "/v1/load_lora_adapter")) == loads


async def test_an_adapter_in_use_is_never_unloaded(tmp_path):
    engine, clock = Engine(), Clock()
    sync = LoraSync(engine.ask, clock, settle_s=2.0)
    sql = assigned(tmp_path, "sql")
    await sync.sync([sql])
    engine.loras.running["acme/sql"] = 1  # a request for it runs in the engine
    assert await sync.sync([])  # left out of the shard record at once
    assert sync.served() == [] and "acme/sql" in engine.loras.loaded
    clock.now += 5
    await sync.sync([])
    assert "acme/sql" in engine.loras.loaded  # in flight: still loaded
    engine.loras.running["acme/sql"] = 0
    await sync.sync([])
    assert "acme/sql" not in engine.loras.loaded and not sync.pending


async def test_an_adapter_leaving_waits_the_settle_time_before_it_is_unloaded(tmp_path):
    engine, clock = Engine(), Clock()
    sync = LoraSync(engine.ask, clock, settle_s=2.0)
    sql = assigned(tmp_path, "sql")
    await sync.sync([sql])
    await sync.sync([])
    assert "acme/sql" in engine.loras.loaded  # a router may have sent one just before
    clock.now += 1
    await sync.sync([sql])  # asked for again before it went: kept, never reloaded
    assert sync.served() == ["sql"] and engine.loras.loads == 1


async def test_an_adopted_engine_keeps_what_it_serves_and_unloads_the_rest(tmp_path):
    engine, clock = Engine(), Clock()
    sql, old = assigned(tmp_path, "sql"), assigned(tmp_path, "old")
    engine.loras.loaded = {"acme/sql": sql.path, "acme/old": old.path}
    sync = LoraSync(engine.ask, clock)
    assert await sync.sync([sql])
    assert sync.served() == ["sql"] and list(engine.loras.loaded) == ["acme/sql"]
    assert engine.loras.loads == 0


async def test_an_engine_that_does_not_answer_is_asked_again_later(tmp_path):
    engine, clock = Engine(), Clock()
    sync = LoraSync(engine.ask, clock)
    engine.down = True
    assert not await sync.sync([assigned(tmp_path, "sql")])
    engine.down = False
    assert await sync.sync([assigned(tmp_path, "sql")])
    assert sync.served() == ["sql"]


def test_vllm_says_what_runs_in_its_newest_lora_sample():
    text = (
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",'
        'waiting_lora_adapters=""} 100.0\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",'
        'waiting_lora_adapters="c"} 200.0\n'
    )
    assert loras_in_use(text) == {"c"}
    assert loras_in_use("vllm:num_requests_running 0\n") is None


def _held(path, base="fake") -> HeldAdapter:
    store = Store(kind="local", identity="local:n1")
    return HeldAdapter(
        key="x", format="gguf", path=str(path), bytes=1, files=1, store=store, base=base
    )


def test_llama_server_starts_with_the_adapters_it_can_take_and_says_why_not_the_others(tmp_path):
    base = write_fake_gguf(tmp_path / "base.gguf")  # architecture "fake"
    ok = write_gguf_lora(tmp_path / "ok.gguf", arch="fake")
    other = write_gguf_lora(tmp_path / "other.gguf", arch="qwen2")
    want = [
        AdapterAssigned(id="ok", name="acme/ok", path=str(ok)),
        AdapterAssigned(id="other", name="acme/other", path=str(other)),
        AdapterAssigned(id="gone", name="acme/gone", path=str(tmp_path / "gone.gguf")),
    ]
    spec = LaunchSpec(
        served_name="tiny", engine="llama-server", binary="llama-server", port=1,
        weights_path=str(base), lora_files=tuple((a.id, a.path) for a in want),
    )  # fmt: skip
    held = {str(ok): _held(ok), str(other): _held(other, "qwen2")}
    launched, failures = started_with(spec, want, held)
    assert launched.lora_files == (("ok", str(ok)),)
    assert {f.adapter: f.reason for f in failures} == {
        "other": f"{other} is a LoRA for architecture 'qwen2', and the base model is 'fake': "
        "an adapter of another base",
        "gone": f"{tmp_path / 'gone.gguf'} is not held complete on this node (the scan finds "
        "no GGUF adapter there)",
    }
    argv = adapter_for("llama-server").command(launched).argv
    assert argv[-3:] == ["--lora", str(ok), "--lora-init-without-apply"]


def test_an_adopted_llama_server_s_adapters_are_read_from_its_command_line():
    want = [AdapterAssigned(id="b", name="acme/b", path="/w/b.gguf")]
    argv = ["llama-server", "-m", "m.gguf", "--lora", "/w/a.gguf", "--lora", "/w/b.gguf"]
    assert adopted_files(argv, want) == (("", "/w/a.gguf"), ("b", "/w/b.gguf"))


def test_vllm_with_room_is_started_with_lora_and_runtime_updating():
    spec = LaunchSpec(
        served_name="tiny", engine="vllm", binary="vllm", port=1, weights_path="/m",
        lora=LoraRoom(rank=16, slots=32),
    )  # fmt: skip
    command = adapter_for("vllm").command(spec)
    argv = command.argv
    assert argv[argv.index("--enable-lora") :][:7] == [
        "--enable-lora", "--max-lora-rank", "16", "--max-loras", "8", "--max-cpu-loras", "32",
    ]  # fmt: skip
    assert command.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
