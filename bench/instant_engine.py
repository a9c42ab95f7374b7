"""A cheap fake engine for benchmarks: canned chat completions on raw asyncio, answered at
once or on a realistic schedule (first token after a delay, then one every interval),
streamed (SSE) when the request asks for it, with a usage chunk at its end when the request
asks for one (`stream_options.include_usage`, as llama-server and vLLM do).

It costs a few microseconds a request, so bench/router.py measures the router rather than
an engine competing with it for this machine's two cores (the test fake engine, on aiohttp,
costs far more per request than the router does).

    python bench/instant_engine.py PORT                           # answers at once
    python bench/instant_engine.py PORT --first-token 0.1 --token-interval 0.01 --tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import json

import httptools

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
COUNTS = {"requests": 0, "prompt": 0, "completion": 0}
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
    args = p.parse_args()
    try:
        import uvloop

        uvloop.run(main(args))
    except ImportError:
        asyncio.run(main(args))
