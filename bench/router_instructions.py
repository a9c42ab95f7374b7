"""Instructions the router spends on one proxied request, counted by valgrind, beside the
same count for an earlier revision of the router, in the same run.

    .venv/bin/python bench/router_instructions.py                  # against 715533c
    .venv/bin/python bench/router_instructions.py --baseline HEAD~3

Wall-clock figures on a shared 2-core VM drift by 30% between runs; instructions do not
(callgrind counts the same total twice for the same program and input). One process runs a
raw-asyncio engine that answers at once, the router (its real Router, on uvloop) and a
client sending requests one after another on one kept-alive connection; the count for N
requests minus the count for a few hundred, divided, is the cost of one request through
all three, of which the router is most. A baseline revision is unpacked with `git
archive` into a temporary directory and measured the same way.
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

_BODY = (
    b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":'
    b'"assistant","content":"hi"},"finish_reason":"stop"}]}'
)
_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(_BODY),
    _BODY,
)


class _Engine(asyncio.Protocol):
    """Answers every request at once (a request's end found by its Content-Length)."""

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
            self.buffer = self.buffer[end + 4 + length :]
            self.transport.write(_ANSWER)


async def _requests(n: int) -> None:
    import anyio

    from llmgw import catalog
    from llmgw.router.service import Router, RouterSettings

    loop = asyncio.get_running_loop()
    engine = await loop.create_server(_Engine, "127.0.0.1", 0)
    port = engine.sockets[0].getsockname()[1]
    router = Router(RouterSettings(host="127.0.0.1", port=0, probe_interval=3600))
    model = catalog.Model(id="m", served_name="bench", endpoints=[f"http://127.0.0.1:{port}"])
    body = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "hi"}]})
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body.encode())
    )
    async with anyio.create_task_group() as tg:
        await tg.start(router.serve_static, [model])
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", int(router.url.rsplit(":", 1)[1])
        )
        for _ in range(n):
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))
            await reader.readexactly(length)
        writer.close()
        tg.cancel_scope.cancel()


def _count(tree: Path, n: int) -> int:
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable]
        + [str(Path(__file__).resolve()), "--run", str(n)],
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


def per_request(tree: Path) -> float:
    return (_count(tree, MANY) - _count(tree, FEW)) / (MANY - FEW)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", default="715533c", help="git revision to compare with")
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)  # the measured process
    args = parser.parse_args()
    if args.run is not None:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        asyncio.run(_requests(args.run))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian package `valgrind`)")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.baseline], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
        shutil.copy(Path(__file__), base / "bench" / Path(__file__).name)  # this harness
        before = per_request(base)
    now = per_request(ROOT)
    print(f"instructions a proxied request ({MANY - FEW} requests, valgrind --tool=callgrind):")
    print(f"  {args.baseline:>10}: {before:10,.0f}")
    print(f"  {'this tree':>10}: {now:10,.0f}  ({now / before:.3f}x)")


if __name__ == "__main__":
    main()
