"""A real llama-server (built by tools/build-llama-server.sh) serving a tiny random-weight model.

Skipped, with the reason, where no llama-server binary can be found.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from real_llama import (
    RunningLlamaServer,
    llama_server_binary,
    serving_tiny_model,
    start_llama_server,
    stream_chat,
    tiny_gguf,
    tiny_server_argv,
)

from llmgw.agent.discovery.engines import llama_server_version
from llmgw.agent.engines.base import LaunchSpec
from llmgw.agent.engines.llama_server import LlamaServerAdapter
from llmgw.bus.server import free_port

pytestmark = pytest.mark.llama


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gguf(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def llama_server(tiny_model: Path, tmp_path: Path) -> Iterator[RunningLlamaServer]:
    with serving_tiny_model(tiny_model, tmp_path) as server:
        yield server


def test_ready_server_answers_health_ok_and_lists_its_alias(llama_server: RunningLlamaServer):
    status, body = llama_server.get("/health")
    assert (status, json.loads(body)) == (200, {"status": "ok"})

    status, body = llama_server.get("/v1/models")
    assert status == 200
    assert [m["id"] for m in json.loads(body)["data"]] == ["tiny"]


def test_streamed_chat_arrives_as_chunks_and_ends_with_done(llama_server: RunningLlamaServer):
    events = list(stream_chat(llama_server, "Say something.", max_tokens=16, seed=1))

    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text, f"no content in {len(chunks)} chunks: {chunks[:3]}"
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    # random weights may sample end-of-sequence early; otherwise the 16-token limit ends it
    assert finish[-1] in ("length", "stop")
    assert all(f is None for f in finish[:-1])


def _run_to_exit(model: Path, tmp_path: Path) -> tuple[int, str]:
    port = free_port()
    argv = tiny_server_argv(llama_server_binary(), model, port)
    server = start_llama_server(argv, tmp_path / "llama-server.log", port)
    try:
        code = server.process.wait(timeout=60)
    finally:
        server.stop()
    return code, server.output()


def test_gguf_that_is_not_gguf_makes_it_exit_nonzero_saying_so(tmp_path: Path):
    llama_server_binary()
    model = tmp_path / "garbage.gguf"
    model.write_bytes(b"<html>404 Not Found</html>\n" * 100)

    code, output = _run_to_exit(model, tmp_path)

    assert code != 0, output
    assert "invalid magic characters: '<htm', expected 'GGUF'" in output, output
    assert "exiting due to model loading error" in output, output


def test_truncated_gguf_makes_it_exit_nonzero_saying_so(tiny_model: Path, tmp_path: Path):
    # what a half-finished download looks like: a valid header, tensor data cut short
    model = tmp_path / "truncated.gguf"
    model.write_bytes(tiny_model.read_bytes()[: tiny_model.stat().st_size // 2])

    code, output = _run_to_exit(model, tmp_path)

    assert code != 0, output
    assert "data is not within the file bounds" in output, output
    assert "exiting due to model loading error" in output, output


def _spec(binary: Path, model: Path, port: int) -> LaunchSpec:
    return LaunchSpec(
        served_name="tiny",
        engine="llama-server",
        binary=str(binary),
        port=port,
        host="127.0.0.1",
        weights_path=str(model),
        context=4096,
        parallel=1,
    )


def test_adapter_argv_starts_real_server_its_readiness_accepts(tiny_model: Path, tmp_path: Path):
    adapter = LlamaServerAdapter()
    port = free_port()
    spec = _spec(llama_server_binary(), tiny_model, port)
    command = adapter.command(spec)
    server = start_llama_server(command.argv, tmp_path / "llama-server.log", port, command.env)
    try:
        server.wait_ready()
        answers = {path: server.get(path) for path in adapter.probe_paths(spec)}
        probe = adapter.readiness(spec, answers)
        assert probe.ready, probe.detail

        status, body = server.get("/v1/models")
        assert [m["id"] for m in json.loads(body)["data"]] == [spec.served_name]
    finally:
        server.stop()


def test_adapter_counts_real_in_flight_request_and_idle_server(tiny_model: Path, tmp_path: Path):
    adapter = LlamaServerAdapter()
    port = free_port()
    spec = _spec(llama_server_binary(), tiny_model, port)
    command = adapter.command(spec)
    server = start_llama_server(command.argv, tmp_path / "llama-server.log", port, command.env)
    try:
        server.wait_ready()

        def in_flight() -> dict[str, int | None]:
            return {p: adapter.in_flight(p, *server.get(p)) for p in adapter.in_flight_paths(spec)}

        assert in_flight() == {"/metrics": 0, "/slots": 0}

        # 3000 tokens take over a second at this model's speed, so right after the first chunk
        # it is still generating; ignore_eos: random weights could sample end-of-sequence
        events = stream_chat(server, "Tell a long story.", max_tokens=3000, ignore_eos=True)
        next(events)
        during = in_flight()
        events.close()
        assert during == {"/metrics": 1, "/slots": 1}, server.output()[-2000:]
    finally:
        server.stop()


def test_discovery_reads_the_build_number_from_real_version_output():
    # source builds print "version: 0.6.0-dev (build 11434, commit unknown)", not the
    # "version: 9439 (47f6423ed)" of release archives: both must give a version
    version = llama_server_version(llama_server_binary())

    assert version, "llama-server --version gave no version line"
    assert any(ch.isdigit() for ch in version), version
