"""The same requests to a vLLM, real or fake, and what came back reduced to its shape.

A shape keeps what a client or the router acts on (status, content type, keys, value types,
nulls, the error's type, param and code, the `object` of each body, the order of a stream's
events) and drops what differs by nature (ids, times, the tokens a random model samples).
tests/samples/vllm-0.32.0-answers.json is the real vLLM 0.32.0's, recorded with

    python tests/engine_answers.py http://127.0.0.1:PORT engine-key > tests/samples/vllm-0.32.0-answers.json
"""

from __future__ import annotations

import http.client
import json
import sys
from pathlib import Path
from urllib.parse import urlsplit

RECORDED = Path(__file__).parent / "samples" / "vllm-0.32.0-answers.json"
SERVED = "tiny"
# values kept as they are: what clients and the router branch on
KEPT = frozenset({"object", "type", "param", "code", "role", "owned_by", "model"})
# ignore_eos: a random model that samples its end early would change the events' order
_CHAT = {"model": SERVED, "max_tokens": 4, "ignore_eos": True}
_HI = [{"role": "user", "content": "hello"}]
_LONG = " ".join(["hello world"] * 1200)  # over 1,024 tokens for vLLM's tokenizer and the fake's

# name -> (method, path, body or None, send the key)
ASKED: dict[str, tuple[str, str, object, bool]] = {
    "health": ("GET", "/health", None, False),
    "models": ("GET", "/v1/models", None, True),
    "models without the key": ("GET", "/v1/models", None, False),
    "streamed chat with usage": (
        "POST",
        "/v1/chat/completions",
        {**_CHAT, "messages": _HI, "stream": True, "stream_options": {"include_usage": True}},
        True,
    ),
    "streamed chat": (
        "POST",
        "/v1/chat/completions",
        {**_CHAT, "messages": _HI, "stream": True},
        True,
    ),
    "chat": ("POST", "/v1/chat/completions", {**_CHAT, "messages": _HI}, True),
    "streamed completion with usage": (
        "POST",
        "/v1/completions",
        {**_CHAT, "prompt": "hello", "stream": True, "stream_options": {"include_usage": True}},
        True,
    ),
    "completion": ("POST", "/v1/completions", {**_CHAT, "prompt": "hello"}, True),
    "unknown model": (
        "POST",
        "/v1/chat/completions",
        {**_CHAT, "model": "nope", "messages": _HI},
        True,
    ),
    "prompt over the context": (
        "POST",
        "/v1/chat/completions",
        {**_CHAT, "messages": [{"role": "user", "content": _LONG}]},
        True,
    ),
    "streamed prompt over the context": (
        "POST",
        "/v1/chat/completions",
        {**_CHAT, "messages": [{"role": "user", "content": _LONG}], "stream": True},
        True,
    ),
    "max_tokens over the context": (
        "POST",
        "/v1/chat/completions",
        {**_CHAT, "messages": _HI, "max_tokens": 5000},
        True,
    ),
    "messages not a list": (
        "POST",
        "/v1/chat/completions",
        {**_CHAT, "messages": "hello"},
        True,
    ),
    "no messages": ("POST", "/v1/chat/completions", {"model": SERVED}, True),
    "empty messages": ("POST", "/v1/chat/completions", {**_CHAT, "messages": []}, True),
    "completion without a prompt": ("POST", "/v1/completions", {"model": SERVED}, True),
    "a list for a body": ("POST", "/v1/chat/completions", [1, 2], True),
    "not JSON": ("POST", "/v1/chat/completions", b'{"model":', True),
    "unknown path": ("GET", "/v1/nothing", None, True),
    "GET of a POST route": ("GET", "/v1/chat/completions", None, True),
}
# the gauges llmgw reads from vLLM's /metrics (load records, autoscaling, status)
GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)


def shape(value: object, key: str = "") -> object:
    if isinstance(value, dict):
        return {k: shape(v, k) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0], key)] if value else []
    if key in KEPT:
        return value
    return "null" if value is None else type(value).__name__


def event_kind(event: object) -> str:
    if event == "[DONE]":
        return "[DONE]"
    assert isinstance(event, dict), event
    if not event["choices"]:
        return "usage"
    choice = event["choices"][0]
    if "role" in choice.get("delta", {}):
        return "role"
    return "finish" if choice.get("finish_reason") else "token"


def stream_shape(raw: bytes) -> dict:
    """A stream's events: the order of their kinds (runs of one kind as one) and the shape of
    each kind's first."""
    events = [
        "[DONE]" if d == "[DONE]" else json.loads(d)
        for line in raw.decode().split("\n")
        if line.startswith("data: ") and (d := line[len("data: ") :])
    ]
    order: list[str] = []
    shapes: dict[str, object] = {}
    for event in events:
        kind = event_kind(event)
        if not order or order[-1] != kind:
            order.append(kind)
        shapes.setdefault(kind, shape(event))
    return {"events": order, "shapes": shapes}


def answer_shape(status: int, content_type: str, raw: bytes) -> dict:
    kind = content_type.split(";")[0].strip()
    if kind == "text/event-stream":
        body: object = stream_shape(raw)
    elif kind == "application/json":
        body = shape(json.loads(raw))
    else:
        body = raw.decode()
    return {"status": status, "content_type": kind, "body": body}


def ask(base_url: str, key: str | None, name: str) -> dict:
    method, path, body, send_key = ASKED[name]
    url = urlsplit(base_url)
    headers = {}
    if send_key and key:
        headers["Authorization"] = f"Bearer {key}"
    data = None
    if body is not None:
        headers["Content-Type"] = "application/json"
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.request(method, path, data, headers)
        r = conn.getresponse()
        return answer_shape(r.status, r.getheader("content-type") or "", r.read())
    finally:
        conn.close()


def metric_names(base_url: str) -> list[str]:
    """Which of GAUGES the engine's /metrics carries."""
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    return [g for g in GAUGES if g in names]


def answers(base_url: str, key: str | None) -> dict:
    """Every request of ASKED, and the gauges, against the engine at `base_url`."""
    return {
        "answers": {name: ask(base_url, key, name) for name in ASKED},
        "gauges": metric_names(base_url),
    }


def recorded() -> dict:
    return json.loads(RECORDED.read_text())


if __name__ == "__main__":
    print(json.dumps(answers(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None), indent=1))
