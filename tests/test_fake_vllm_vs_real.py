"""The fake engine's vLLM mode held to the real vLLM: the same requests to both (health,
/v1/models with and without the key, streamed and whole chats and completions with usage, an
unknown model, a prompt over the context, bad requests) get the same status codes and
shapes (tests/engine_answers.py), and /metrics carries the gauges llmgw reads. Where no vLLM
is installed the fake is held to vLLM 0.32.0's answers as recorded."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_answers import answers, recorded
from real_vllm import CONTEXT, SERVED, RunningVllm

from llmgw.bus.server import free_port
from llmgw.sim.fake_engine import install_fake_engines

KEY = "engine-key"  # conftest's vllm_server has it too


def start_fake(tmp: Path, load_seconds: float = 0.0) -> tuple[subprocess.Popen, int]:
    bins = install_fake_engines(tmp / "bin")
    model = tmp / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text("{}")
    port = free_port()
    argv = [str(bins["vllm"]), "serve", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--served-model-name", SERVED, "--max-model-len", str(CONTEXT)]
    env = {**os.environ, "VLLM_API_KEY": KEY, "FAKE_ENGINE_LOAD_SECONDS": str(load_seconds)}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, port


def refused_until_ready(port: int, proc: subprocess.Popen, within: float = 30.0) -> int:
    """Connection attempts refused before the port answered (as RunningVllm counts them)."""
    refused, deadline = 0, time.monotonic() + within
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the fake vLLM exited"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return refused
        except ConnectionRefusedError:
            refused += 1
            time.sleep(0.05)
    raise AssertionError(f"the fake vLLM did not listen within {within} s")


@pytest.fixture(scope="module")
def fake_vllm(tmp_path_factory) -> Iterator[str]:
    proc, port = start_fake(tmp_path_factory.mktemp("fake-vllm"))
    try:
        refused_until_ready(port, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def fake_answers(fake_vllm: str) -> dict:
    return answers(fake_vllm, KEY)


def test_the_fake_vllm_answers_as_vllm_0_32_did(fake_answers: dict):
    assert fake_answers == recorded()


def test_the_fake_vllm_does_not_listen_while_it_loads(tmp_path: Path):
    proc, port = start_fake(tmp_path, load_seconds=1.0)
    try:
        assert refused_until_ready(port, proc) > 0
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.vllm
def test_the_fake_vllm_answers_as_the_real_one_does(fake_answers: dict, vllm_server: RunningVllm):
    real = answers(vllm_server.base_url, KEY)
    assert fake_answers == real
    assert real == recorded()  # the recording is the real one's: refresh it if vLLM moved


@pytest.mark.vllm
def test_the_real_vllm_does_not_listen_while_it_loads(vllm_server: RunningVllm):
    assert vllm_server.refused_while_loading > 0
