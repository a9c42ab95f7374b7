"""Instructions the router spends on one proxied request, counted by valgrind, beside the
same count for an earlier revision of the router, in the same run.

    .venv/bin/python bench/router_instructions.py                  # against 715533c
    .venv/bin/python bench/router_instructions.py --baseline HEAD~3
    .venv/bin/python bench/router_instructions.py --keys               # what keys cost
    .venv/bin/python bench/router_instructions.py --headers 14         # an SDK's extra headers
    .venv/bin/python bench/router_instructions.py --keys --stream      # streamed answers

Wall-clock figures on a shared 2-core VM drift by 30% between runs; instructions do not
(callgrind counts the same total twice for the same program and input). One process runs a
raw-asyncio engine that answers at once, the router (its real Router, on uvloop) and a
client sending requests one after another on one kept-alive connection; the count for N
requests minus the count for a few hundred, divided, is the cost of one request through
all three, of which the router is most. A baseline revision is unpacked with `git
archive` into a temporary directory and measured the same way.

--keys: this tree's router three ways in the same run: without keys, with a key and no
limits (authenticated, metered, audited), and with a key limited four ways (limits that
never refuse: what is counted is their bookkeeping). The gateway is the router's own
(router/keygate.py over llmgw/gateway), its counters and audit trail in memory instead of
NATS (the audit records still encoded as the bus encodes them), flushed every 1,000
requests (FLUSH_EVERY).

--stream: streamed requests, each answered with STREAM_TOKENS events, an event a turn of
the engine's loop (so that the router reads them one by one, as from an engine generating),
and the usage chunk when the request asks for it (the gateway asks, and strips it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FEW, MANY = 200, 1200
# the gateway's flush (counters, audit records) every this many requests, as a router at
# 5,000 requests a second does every 0.2 s; by count, not by the clock, which runs some 50
# times slower under valgrind (a flush every 0.2 s of it would be one every few requests)
FLUSH_EVERY = 1000

_BODY = (
    b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":'
    b'"assistant","content":"hi"},"finish_reason":"stop"}]}'
)
_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(_BODY),
    _BODY,
)


def _sse(data: bytes) -> bytes:
    event = b"data: " + data + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


STREAM_TOKENS = 16
_TOKEN = _sse(
    b'{"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":'
    b'"tok "},"finish_reason":null}]}'
)
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
_STREAM_END = _sse(
    b'{"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},'
    b'"finish_reason":"stop"}]}'
)
_USAGE = _sse(
    b'{"id":"x","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":4,'
    b'"completion_tokens":%d,"total_tokens":%d}}' % (STREAM_TOKENS, STREAM_TOKENS + 4)
)
_DONE = _sse(b"[DONE]") + b"0\r\n\r\n"


class _Engine(asyncio.Protocol):
    """Answers every request at once (a request's end found by its Content-Length); a
    stream as STREAM_TOKENS events written one by one, and the usage chunk when asked."""

    def connection_made(self, transport) -> None:
        self.transport, self.buffer = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            length = 0
            for line in self.buffer[:end].lower().split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            if b'"stream":true' not in body:
                self.transport.write(_ANSWER)
                continue
            # an event a turn of the loop, as an engine sends them apart: the router reads
            # them one by one
            self.transport.write(_STREAM_HEAD)
            usage = b'"include_usage":true' in body
            asyncio.get_running_loop().call_soon(self._event, STREAM_TOKENS, usage)

    def _event(self, left: int, usage: bool) -> None:
        if left:
            self.transport.write(_TOKEN)
            asyncio.get_running_loop().call_soon(self._event, left - 1, usage)
            return
        self.transport.write(_STREAM_END + (_USAGE if usage else b"") + _DONE)


class _Counters:
    """The usage counters and the limits in memory: a running total a subject, what each
    holder holds of a window."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = {}
        self.held: dict[str, dict[str, int]] = {}

    async def add(self, subject: str, delta: int, msg_id: str | None = None) -> int:
        total = self.totals[subject] = self.totals.get(subject, 0) + delta
        return total

    async def claim(
        self, window: str, holder: str, mine: int, asked: int, limit: int
    ) -> tuple[int, int]:
        holders = self.held.setdefault(window, {})
        others = sum(v for h, v in holders.items() if h != holder)
        got = max(0, min(asked, limit - others - mine))
        holders[holder] = mine + got
        return got, others + mine + got

    async def hold(self, window: str, holder: str, units: int) -> None:
        self.held.setdefault(window, {})[holder] = units


class _Audit:
    """The audit trail in memory: records encoded into messages as the bus does."""

    def __init__(self) -> None:
        self.messages = 0

    async def append(self, batch) -> None:
        from llmgw.bus.counters import audit_messages

        for _, recs in batch:
            self.messages += len(audit_messages(recs))


def _gateway(gate: str):
    """A gateway holding one key ("key": no limits, "limits": four that never refuse), and
    that key's secret."""
    from llmgw.bus import keys, records
    from llmgw.gateway import credentials
    from llmgw.gateway.gateway import Gateway

    gateway = Gateway("bench", _Counters(), _Audit())
    secret = credentials.new_secret("bench")
    big = 10**9
    limits = (
        records.Limits(rpm=big, tpm=big, tokens_per_day=big, max_parallel=big)
        if gate == "limits"
        else records.Limits()
    )
    key = records.ApiKey(name="bench", secrets=[credentials.hash_secret(secret)], limits=limits)
    gateway.apply(keys.apikey("bench"), key)
    return gateway, secret


async def _requests(n: int, gate: str = "off", headers: int = 0, stream: bool = False) -> None:
    import anyio

    from llmgw import catalog
    from llmgw.router.keygate import GatewayGate
    from llmgw.router.service import Router, RouterSettings

    loop = asyncio.get_running_loop()
    engine = await loop.create_server(_Engine, "127.0.0.1", 0)
    port = engine.sockets[0].getsockname()[1]
    # no health probes or engine reports meanwhile (a revision before reports has none)
    quiet = (
        {"report_interval": 3600}
        if "report_interval" in RouterSettings.__dataclass_fields__
        else {}
    )
    router = Router(RouterSettings(host="127.0.0.1", port=0, probe_interval=3600, **quiet))
    model = catalog.Model(id="m", served_name="bench", endpoints=[f"http://127.0.0.1:{port}"])
    chat = {"model": "bench", "messages": [{"role": "user", "content": "hi"}]}
    body = json.dumps({**chat, "stream": True} if stream else chat, separators=(",", ":"))
    # headers such as the openai SDK sends beside these (user-agent, x-stainless-*, ...)
    auth = b"".join(
        b"x-sdk-header-%d: a value of some length %d\r\n" % (i, i) for i in range(headers)
    )
    gateway = None
    if gate != "off":
        gateway, secret = _gateway(gate)
        router.gate = GatewayGate(gateway)
        auth += b"authorization: Bearer %s\r\n" % secret.encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
        b"%scontent-length: %d\r\n\r\n%s" % (auth, len(body), body.encode())
    )
    async with anyio.create_task_group() as tg:
        await tg.start(router.serve_static, [model])
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", int(router.url.rsplit(":", 1)[1])
        )
        for i in range(n):
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if stream:
                await reader.readuntil(b"\r\n0\r\n\r\n")  # the chunked answer's end
            else:
                length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))
                await reader.readexactly(length)
            if gateway is not None and (i + 1) % FLUSH_EVERY == 0:
                await gateway.flush()
        if gateway is not None:
            await gateway.flush()
        writer.close()
        tg.cancel_scope.cancel()


def _count(tree: Path, n: int, gate: str = "off", headers: int = 0, stream: bool = False) -> int:
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable]
        + [str(Path(__file__).resolve()), "--run", str(n), "--gate", gate]
        + ["--headers", str(headers)]
        + (["--stream"] if stream else []),
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=True,
    )
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise SystemExit(f"no count from valgrind:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def per_request(tree: Path, gate: str = "off", headers: int = 0, stream: bool = False) -> float:
    many = _count(tree, MANY, gate, headers, stream)
    return (many - _count(tree, FEW, gate, headers, stream)) / (MANY - FEW)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", default="715533c", help="git revision to compare with")
    parser.add_argument("--keys", action="store_true", help="what keys and limits cost")
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)  # the measured process
    parser.add_argument("--gate", default="off", help=argparse.SUPPRESS)
    parser.add_argument(
        "--headers", type=int, default=0, help="headers a request carries beside the three"
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help=f"streamed requests ({STREAM_TOKENS} events each, apart) instead of whole answers",
    )
    args = parser.parse_args()
    if args.run is not None:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        asyncio.run(_requests(args.run, args.gate, args.headers, args.stream))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian package `valgrind`)")
    if args.keys:
        print(f"instructions a proxied request ({MANY - FEW} requests, valgrind --tool=callgrind):")
        off = per_request(ROOT, stream=args.stream)
        print(f"  {'no keys':>22}: {off:10,.0f}")
        for gate, what in (("key", "a key, no limits"), ("limits", "a key, four limits")):
            now = per_request(ROOT, gate, stream=args.stream)
            print(f"  {what:>22}: {now:10,.0f}  ({now / off:.3f}x, +{now - off:,.0f})")
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.baseline], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
        shutil.copy(Path(__file__), base / "bench" / Path(__file__).name)  # this harness
        before = per_request(base, headers=args.headers, stream=args.stream)
    now = per_request(ROOT, headers=args.headers, stream=args.stream)
    print(f"instructions a proxied request ({MANY - FEW} requests, valgrind --tool=callgrind):")
    print(f"  {args.baseline:>10}: {before:10,.0f}")
    print(f"  {'this tree':>10}: {now:10,.0f}  ({now / before:.3f}x)")


if __name__ == "__main__":
    main()
