"""What tests do to serve a model and talk to it, in one place: write its catalog entry and
the replicas wanted (as `llmgw catalog apply` and `llmgw place` would), a one-node CPU
model for the fake or real llama-server, and a streamed chat completion read event by event."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp

from llmgw import catalog
from llmgw.bus import keys, records
from llmgw.bus.client import Bus


def cpu_model(
    weights: str,
    *,
    model_id: str = "tiny",
    served_name: str = "tiny-chat",
    env: dict[str, str] | None = None,
    **profile: object,
) -> catalog.Model:
    """A llama-server model on CPU nodes, from the GGUF at `weights`, validated as the CLI does."""
    return catalog.validate_models(
        {
            "models": [
                {
                    "id": model_id,
                    "served_name": served_name,
                    "profiles": [
                        {
                            "name": "cpu",
                            "engine": "llama-server",
                            "weights": {"path": weights},
                            "gpus_per_node": 0,
                            **({"env": env} if env else {}),
                            **profile,
                        }
                    ],
                }
            ]
        }
    )[0]


async def want(bus: Bus, model: str, replicas: int, *, at: float = 1.0) -> None:
    """`llmgw place MODEL --replicas N`; `at` is the request's time, which the controller echoes."""
    await bus.put(
        keys.desired(model), records.Desired(model=model, replicas=replicas, updated_at=at)
    )


async def serve(bus: Bus, model: catalog.Model, replicas: int, *, at: float = 1.0) -> None:
    """The catalog entry, then the replicas wanted."""
    await bus.put(keys.catalog(model.id), catalog.encode_model(model))
    await want(bus, model.id, replicas, at=at)


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """A streamed answer's `data:` payloads as they arrive (events can span reads)."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    yield line[len(b"data: ") :].decode()


async def stream_chat(
    base_url: str,
    served: str,
    *,
    max_tokens: int | None = None,
    events: list[str] | None = None,
    content: str = "hi",
) -> list[str]:
    """POST a streamed chat completion to `base_url` (http://host:port); the payloads of its
    events, "[DONE]" last. `events`, when given, fills as they arrive."""
    body: dict[str, object] = {
        "model": served,
        "stream": True,
        "messages": [{"role": "user", "content": content}],
    }
    if max_tokens:
        body["max_tokens"] = max_tokens
    events = [] if events is None else events
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{base_url}/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        async for data in sse_events(r):
            events.append(data)
    return events
