"""Failures of a real vLLM as they really happen, under the supervisor (no validation in
front, which refuses both of these before launch): a fatal engine-core error (a head size
vLLM's CPU attention kernel refuses, at the first request) and a port another program took
while vLLM loaded. Each is reported with the engine's own cause in its reason and its output
tail, and handled by the restart policy. Skips, saying how to get one, where no vLLM is
installed."""

from __future__ import annotations

import socket
import time

import anyio
import pytest
from real_vllm import (
    CONTEXT,
    QUICK_START,
    SERVED,
    TEST_ENV,
    chat_body,
    leftover_vllm_processes,
    tiny_hf_model,
    vllm_binary,
)
from test_supervisor import Recorder, supervisor

from llmgw.agent.engines.base import LaunchSpec
from llmgw.agent.supervisor import SupervisorTiming
from llmgw.bus.records import PORT_IN_USE
from llmgw.bus.server import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.vllm, pytest.mark.timeout(600)]

# one failed start and the policy gives up (FATAL): the controller then moves the replica
ONCE = SupervisorTiming(
    readiness_timeout=300, poll_interval=0.2, max_failed_starts=1, stop_grace=10, cancel_grace=5
)
# what the profile's env would carry; the adapter adds the CPU engine's own
PROFILE_ENV = {k: TEST_ENV[k] for k in ("HF_HUB_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK")}


def cpu_spec(model, port: int) -> LaunchSpec:
    return LaunchSpec(
        served_name=SERVED,
        engine="vllm",
        binary=str(vllm_binary()),
        port=port,
        host="127.0.0.1",
        weights_path=str(model),
        context=CONTEXT,
        kv_cache_bytes=1 << 30,
        extra_args=QUICK_START,
        env=PROFILE_ENV,
    )


@pytest.fixture
def no_vllm_left():
    began = time.time()
    yield
    assert leftover_vllm_processes(began) == []


async def test_a_fatal_engine_core_error_is_reported_with_its_cause_and_the_policy_gives_up(
    tmp_path, no_vllm_left
):
    import http.client

    model = tiny_hf_model(tmp_path, head_dim=16)
    spec = cpu_spec(model, free_port())
    rec = Recorder()
    sup = supervisor(spec, tmp_path, rec, timing=ONCE)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        await rec.reached("ready", timeout=300)  # vLLM loads it and says it is ready

        def ask() -> tuple[int, bytes]:
            conn = http.client.HTTPConnection("127.0.0.1", spec.port, timeout=60)
            headers = {"Content-Type": "application/json"}
            conn.request("POST", "/v1/chat/completions", chat_body(stream=False), headers)
            answer = conn.getresponse()
            return answer.status, answer.read()

        status, body = await anyio.to_thread.run_sync(ask)
        assert status == 500, body
        failed = await rec.reached("failed", timeout=60)
        tg.cancel_scope.cancel()
    assert failed.gave_up and sup.state.value == "fatal"
    assert failed.reason.startswith("exited with code "), failed.reason
    assert "while serving (RuntimeError: " in failed.reason
    assert "Unsupported CPU attention configuration: head_dim=16" in failed.reason
    assert failed.reason.endswith("; gave up after 1 failed starts in a row")
    assert failed.tail and len("\n".join(failed.tail)) <= 8192


async def test_a_port_taken_while_vllm_loads_is_reported_for_the_controller_to_move(
    tmp_path, no_vllm_left, vllm_tiny_model
):
    port = free_port()
    with socket.socket() as other:  # another program, listening where vLLM was placed
        other.bind(("127.0.0.1", port))
        other.listen()
        rec = Recorder()
        sup = supervisor(cpu_spec(vllm_tiny_model, port), tmp_path, rec, timing=ONCE)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sup.run)
            failed = await rec.reached("failed", timeout=120)
            tg.cancel_scope.cancel()
    assert failed.refused == PORT_IN_USE and failed.gave_up
    assert "exited with code 1 while loading (OSError: [Errno 98] Address already in use)" in (
        failed.reason
    ), failed.reason
    assert f"port {port} on 127.0.0.1 is held by another process" in failed.reason
    assert any("Address already in use" in line for line in failed.tail)
