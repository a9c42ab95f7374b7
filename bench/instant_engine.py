"""A cheap fake engine for benchmarks: canned chat completions on raw asyncio, answered at
once or on a realistic schedule (first token after a delay, then one every interval),
streamed (SSE) when the request asks for it, with a usage chunk at its end when the request
asks for one (`stream_options.include_usage`, as llama-server and vLLM do).

It costs a few microseconds a request, so bench/router.py measures the router rather than
an engine competing with it for this machine's two cores (the test fake engine, on aiohttp,
costs far more per request than the router does).

With `--read-bodies` (bench/gateway.py metering) it reads each body as an engine does
(llmgw/sim/engine_params.py: its cap, its count of answers, `stream`; `--kind worst`
generates the more of what llama-server and vLLM would) and answers every route a gateway
meters with its usage in that route's names: chat and completions (`usage`), responses
(`input_tokens`/`output_tokens`, a stream's in `response.completed`), embeddings and rerank
(`prompt_tokens`, `total_tokens`), /infill (llama-server's `tokens_evaluated` and
`tokens_predicted`, in every event of a stream). GET /counts says what it read, generated
and held in flight at most.

    python bench/instant_engine.py PORT                           # answers at once
    python bench/instant_engine.py PORT --first-token 0.1 --token-interval 0.01 --tokens 16
    python bench/instant_engine.py PORT --read-bodies --tokens 3000 --kind worst
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httptools

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmgw.sim import engine_params  # noqa: E402

PROMPT_TOKENS = 4  # every answer's prompt, as its usage says


def _answer(tokens: int) -> bytes:
    body = json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": "bench",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "tok " * tokens},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": PROMPT_TOKENS,
                "completion_tokens": tokens,
                "total_tokens": PROMPT_TOKENS + tokens,
            },
        }
    ).encode()
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        % len(body)
        + body
    )


def _event(data: bytes) -> bytes:
    payload = b"data: " + data + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(payload), payload)


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
TOKEN = _event(
    b'{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"bench",'
    b'"choices":[{"index":0,"delta":{"content": "tok "},"finish_reason":null}]}'
)
LAST = (
    _event(
        b'{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"bench",'
        b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}'
    )
    + _event(b"[DONE]")
    + b"0\r\n\r\n"
)


def _last_with_usage(tokens: int) -> bytes:
    """LAST with the usage chunk before [DONE], as engines send it to a request asking for
    it (`stream_options.include_usage`): empty choices, the stream's counts."""
    usage = _event(
        b'{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"bench",'
        b'"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}'
        % (PROMPT_TOKENS, tokens, PROMPT_TOKENS + tokens)
    )
    done = LAST.index(b"%x\r\ndata: [DONE]" % len(b"data: [DONE]\n\n"))
    return LAST[:done] + usage + LAST[done:]


# what this engine generated, by its own count (as vLLM's prompt_tokens_total and
# generation_tokens_total): a stream's tokens as each is written, also of a stream whose
# client left; GET /counts answers them (bench/gateway.py metering)
COUNTS = {"requests": 0, "prompt": 0, "completion": 0, "in_flight": 0, "most_in_flight": 0}
HEALTH = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n{"status":"ok"}'


class _Conn(asyncio.Protocol):
    def __init__(self, args: argparse.Namespace, answer: bytes, last_with_usage: bytes) -> None:
        self.args = args
        self.answer = answer
        self.last = LAST
        self.last_with_usage = last_with_usage
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body = b""

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.body = b"", b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        if self.url.endswith(b"/health"):
            self.transport.write(HEALTH)
            return
        if self.url.endswith(b"/counts"):
            body = json.dumps(COUNTS).encode()
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"\r\n%s" % (len(body), body)
            )
            return
        a = self.args
        if a.read_bodies:
            self._route()
            return
        COUNTS["requests"] += 1
        COUNTS["prompt"] += PROMPT_TOKENS
        if b'"stream": true' in self.body or b'"stream":true' in self.body:
            usage = b'"include_usage": true' in self.body or b'"include_usage":true' in self.body
            self.last = self.last_with_usage if usage else LAST
            self.transport.write(STREAM_HEAD)
            self.loop.call_later(a.first_token, self._token, a.tokens)
            return
        delay = a.first_token + a.tokens * a.token_interval
        if delay:
            self.loop.call_later(delay, self._write, self.answer)
        else:
            self._write(self.answer)

    def _write(self, data: bytes) -> None:
        if not self.transport.is_closing():
            COUNTS["completion"] += self.args.tokens
            self.transport.write(data)

    def _token(self, left: int) -> None:
        if self.transport.is_closing():
            return
        if left == 0:
            self.transport.write(self.last)
            return
        self.transport.write(TOKEN)
        COUNTS["completion"] += 1
        self.loop.call_later(self.args.token_interval, self._token, left - 1)

    # --- --read-bodies: every metered route, each body read as an engine reads it ------------

    def _route(self) -> None:
        a = self.args
        route = next((r for suffix, r in _ROUTES if self.url.endswith(suffix)), None)
        try:
            body = json.loads(self.body)
            plan = _plan(a.kind, route, body, a.tokens) if route else None
        except (ValueError, engine_params.Refused) as e:
            self._whole(400, {"error": {"message": str(e)}}, 0)
            return
        if plan is None:
            self._whole(404, {"error": {"message": "no such route"}}, 0)
            return
        stream, events, tokens = plan
        COUNTS["requests"] += 1
        COUNTS["prompt"] += PROMPT_TOKENS
        COUNTS["in_flight"] += 1
        COUNTS["most_in_flight"] = max(COUNTS["most_in_flight"], COUNTS["in_flight"])
        if stream:
            self.transport.write(STREAM_HEAD)
            self.loop.call_later(a.first_token, self._event, _stream(route, events, body))
            return
        answer = _whole_answer(route, tokens)
        delay = a.first_token + tokens * a.token_interval
        self.loop.call_later(delay, self._whole, 200, answer, tokens)

    def _whole(self, status: int, answer: dict, tokens: int) -> None:
        if status == 200:
            COUNTS["in_flight"] -= 1
        if self.transport.is_closing():
            return
        COUNTS["completion"] += tokens
        data = json.dumps(answer).encode()
        self.transport.write(
            b"HTTP/1.1 %d -\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (status, len(data), data)
        )

    def _event(self, events: Iterator[tuple[bytes, int]]) -> None:
        if self.transport.is_closing():
            COUNTS["in_flight"] -= 1
            return
        event = next(events, None)
        if event is None:
            COUNTS["in_flight"] -= 1
            self.transport.write(b"0\r\n\r\n")
            return
        data, tokens = event
        COUNTS["completion"] += tokens
        self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.loop.call_later(self.args.token_interval if tokens else 0, self._event, events)


_ROUTES = (
    (b"/v1/chat/completions", "chat"),
    (b"/v1/completions", "completions"),
    (b"/v1/responses", "responses"),
    (b"/infill", "infill"),
    (b"/v1/embeddings", "embeddings"),
    (b"/rerank", "rerank"),
)


def _plan(kind: str, route: str, body: dict, natural: int) -> tuple[bool, int, int]:
    """(streams, token events, tokens in all) for `body` on `route`, as `kind` reads it;
    `natural`: what an answer runs to when no cap stops it."""
    if route in ("embeddings", "rerank"):
        return False, 0, 0
    kinds = ("llama-server", "vllm") if kind == "worst" else (kind,)
    if route == "infill":
        kinds = ("llama-server",)  # vLLM serves none
    most, stream = 0, False
    for k in kinds:
        try:
            cap = engine_params.cap(k, route, body)
            answers = engine_params.choices(k, body)
            streams = engine_params.streams(k, body)
        except engine_params.Refused:
            if kind != "worst":
                raise
            continue
        prompt = body.get("prompt")
        if route == "completions" and isinstance(prompt, list) and prompt:
            answers *= max(1, sum(1 for p in prompt if isinstance(p, str | list)))
        tokens = answers * min(natural, cap or natural)
        if tokens > most:
            most, stream = tokens, streams
    return stream, most, most


def _whole_answer(route: str, tokens: int) -> dict:
    text = "tok " * tokens
    if route == "responses":
        return {
            "object": "response",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}],
            "usage": {
                "input_tokens": PROMPT_TOKENS,
                "output_tokens": tokens,
                "total_tokens": PROMPT_TOKENS + tokens,
            },
        }
    if route == "infill":
        return {
            "content": text,
            "stop": True,
            "tokens_predicted": tokens,
            "tokens_evaluated": PROMPT_TOKENS,
        }
    if route in ("embeddings", "rerank"):
        data = "data" if route == "embeddings" else "results"
        return {
            data: [{"index": 0, "embedding": [0.5, 0.25]}],
            "usage": {"prompt_tokens": PROMPT_TOKENS, "total_tokens": PROMPT_TOKENS},
        }
    return {
        "object": "chat.completion" if route == "chat" else "text_completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
        "usage": {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": tokens,
            "total_tokens": PROMPT_TOKENS + tokens,
        },
    }


def _sse(data: dict, event: str | None = None) -> bytes:
    head = b"event: %s\n" % event.encode() if event else b""
    return head + b"data: " + json.dumps(data).encode() + b"\n\n"


def _stream(route: str, tokens: int, body: dict) -> Iterator[tuple[bytes, int]]:
    """A stream's events, each with the tokens it carries, in `route`'s own shape."""
    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": tokens}
    for i in range(tokens):
        if route == "responses":
            delta = {"type": "response.output_text.delta", "delta": "tok "}
            yield _sse(delta, "response.output_text.delta"), 1
        elif route == "infill":
            counts = {"tokens_predicted": i + 1, "tokens_evaluated": PROMPT_TOKENS}
            yield _sse({"content": "tok ", "stop": False, **counts}), 1
        else:
            yield _sse({"choices": [{"index": 0, "delta": {"content": "tok "}}]}), 1
    if route == "responses":
        said = {"input_tokens": PROMPT_TOKENS, "output_tokens": tokens}
        done = {"type": "response.completed", "response": {"usage": said}}
        yield _sse(done, "response.completed"), 0
        return
    if route == "infill":
        counts = {"tokens_predicted": tokens, "tokens_evaluated": PROMPT_TOKENS}
        yield _sse({"content": "", "stop": True, **counts}), 0
        return
    yield _sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}), 0
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        yield _sse({"choices": [], "usage": usage}), 0
    yield b"data: [DONE]\n\n", 0


async def main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    answer, last = _answer(args.tokens), _last_with_usage(args.tokens)
    await loop.create_server(
        lambda: _Conn(args, answer, last), "127.0.0.1", args.port, backlog=4096
    )
    await asyncio.Event().wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("--first-token", type=float, default=0.0)
    p.add_argument("--token-interval", type=float, default=0.0)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--read-bodies", action="store_true", help="every metered route (docstring)")
    p.add_argument("--kind", choices=("vllm", "llama-server", "worst"), default="worst")
    args = p.parse_args()
    try:
        import uvloop

        uvloop.run(main(args))
    except ImportError:
        asyncio.run(main(args))
