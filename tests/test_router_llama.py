"""The router in front of two real llama-servers serving the tiny model: a conversation
keeps landing on the replica that holds its prefix, so every later turn is served from
that engine's prompt cache (llama-server reports it in `usage.prompt_tokens_details`)."""

from __future__ import annotations

import contextlib

import aiohttp
import pytest
from real_llama import llama_server_binary, start_llama_server, tiny_gguf, tiny_server_argv
from router_helpers import router_settings, running_router

from llmgw import catalog
from llmgw.bus.server import free_port
from llmgw.router.balancer import BalancerSettings

pytestmark = [pytest.mark.anyio, pytest.mark.llama]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def two_llama_servers(tiny_model, tmp_path):
    servers = []
    with contextlib.ExitStack() as stack:
        for i in range(2):
            port = free_port()
            # two slots each, as a real deployment would have several
            argv = tiny_server_argv(llama_server_binary(), tiny_model, port, "--alias", "tiny")
            argv[argv.index("-np") + 1] = "2"
            argv[argv.index("-c") + 1] = "2048"
            server = start_llama_server(argv, tmp_path / f"llama-{i}.log", port)
            stack.callback(server.stop)
            server.wait_ready()
            servers.append(server)
        yield servers


def _conversation_turns(n: int, opening: str):
    messages = [{"role": "system", "content": "You answer in one short sentence. " * 4}]
    for i in range(n):
        question = f"{opening}, question {i}: " + " ".join(f"word{i}{j}" for j in range(30))
        messages.append({"role": "user", "content": question})
        yield messages
        messages.append({"role": "assistant", "content": "OK."})


async def _turns_through(http, url: str, opening: str) -> list[tuple[str, int, int]]:
    """(replica, prompt tokens, of them from cache) for each turn of one conversation."""
    out = []
    for messages in _conversation_turns(4, opening):
        body = {"model": "tiny", "messages": messages, "max_tokens": 4, "seed": 1}
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            usage = (await resp.json())["usage"]
            out.append(
                (
                    resp.headers["x-llmgw-replica"],
                    usage["prompt_tokens"],
                    usage["prompt_tokens_details"]["cached_tokens"],
                )
            )
    return out


def _warm(turns: list[tuple[str, int, int]], i: int) -> bool:
    """Turn i found everything up to the previous turn's prompt in the engine's cache (a
    replica that never saw this conversation shares only the system prompt with it)."""
    return turns[i][2] >= turns[i - 1][1] - 8


def _model(servers) -> catalog.Model:
    return catalog.Model(id="tiny", served_name="tiny", endpoints=[s.base_url for s in servers])


async def test_a_conversation_keeps_its_prefix_cache_through_the_router(two_llama_servers):
    async with running_router([_model(two_llama_servers)]) as r, aiohttp.ClientSession() as http:
        for opening in ("first conversation", "second conversation", "third conversation"):
            turns = await _turns_through(http, r.url, opening)
            assert len({t[0] for t in turns}) == 1, f"{opening} moved: {turns}"
            assert all(_warm(turns, i) for i in range(1, len(turns))), turns


async def test_without_affinity_turns_scatter_and_lose_their_cache(two_llama_servers):
    """The baseline for the test above: plain least-in-flight moves turns between
    replicas, and a turn that moves starts (partly) cold."""
    settings = router_settings(balancer=BalancerSettings(affinity_load_factor=0))
    async with (
        running_router([_model(two_llama_servers)], settings=settings) as r,
        aiohttp.ClientSession() as http,
    ):
        cold = 0
        for c in range(8):
            turns = await _turns_through(http, r.url, f"conversation {c}")
            cold += sum(not _warm(turns, i) for i in range(1, len(turns)))
        assert cold > 0
