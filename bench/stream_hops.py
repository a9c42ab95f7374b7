"""Where a streamed answer's time goes: one engine, straight and through the router, per hop.

    .venv/bin/python bench/stream_hops.py                                  # the fake engine
    .venv/bin/python bench/stream_hops.py --llama-server BIN --model M.gguf [--ngl 99]

Each round sends sequential streamed chat completions, in turn straight to the engine and
through a router (`llmgw router --catalog`, uvloop), each over a new connection. For each
stream the client, a raw socket, records when the response head came, when the first event
came, when the first token came, and the gaps between tokens; llama-server's own `timings`
(prompt_ms, predicted_per_token_ms) say what the engine spent on the prompt and a token, so
what is left is the path and the engine's work before it starts (queueing, slot selection,
its prompt cache). The kernel's count of delayed ACKs (TcpExt DelayedACKs, machine-wide) is
read around each phase.

Every stream is measured twice over, in two orders: right after another long answer on the
same engine ("after long"), and after a short one of --lead-tokens ("after short"). The
order matters to llama-server: a slot that must drop most of what it holds (a long answer
followed by a new request sharing only the prompt) is first saved to its host-memory prompt
cache, on the request's time (docs/performance.md, "Time to first token, hop by hop").

Prints a table and, with --json FILE, writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmgw.bus.server import free_port  # noqa: E402

PY = sys.executable


# --- the kernel's ACK counters ------------------------------------------------------------


def delayed_acks() -> int | None:
    """TcpExt DelayedACKs: delayed ACKs the kernel sent, machine-wide (None off Linux)."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            row = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return int(row.get("DelayedACKs", 0))
    return None


# --- one stream, read raw ------------------------------------------------------------------


class _Chunked:
    """Removes HTTP/1.1 chunked framing from bytes fed in any pieces."""

    def __init__(self) -> None:
        self.buf = b""
        self.left = 0  # bytes of the current chunk still to come (+2 for its CRLF)
        self.done = False

    def feed(self, data: bytes) -> bytes:
        self.buf += data
        out = []
        while not self.done:
            if self.left > 2:  # payload still to come
                n = min(len(self.buf), self.left - 2)
                if n == 0:
                    break
                out.append(self.buf[:n])
                self.buf, self.left = self.buf[n:], self.left - n
            elif self.left:  # the CRLF after the payload
                n = min(len(self.buf), self.left)
                if n == 0:
                    break
                self.buf, self.left = self.buf[n:], self.left - n
            else:
                line, sep, rest = self.buf.partition(b"\r\n")
                if not sep:
                    break
                size = int(line.split(b";")[0].strip() or b"0", 16)
                self.buf = rest
                if size == 0:
                    self.done = True
                    break
                self.left = size + 2
        return b"".join(out)


def stream_once(port: int, body: bytes, timeout: float = 120.0) -> dict:
    """One streamed chat completion over a new connection; times in ms from the request."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    t0 = time.perf_counter()
    s.sendall(request)
    raw = b""
    head: bytes | None = None
    chunked = None
    text = b""
    r: dict = {"head_ms": None, "first_event_ms": None, "first_token_ms": None, "tokens": []}
    timings = None
    try:
        while True:
            data = s.recv(65536)
            now = (time.perf_counter() - t0) * 1000
            if not data:
                break
            if head is None:
                raw += data
                end = raw.find(b"\r\n\r\n")
                if end < 0:
                    continue
                head, data = raw[:end], raw[end + 4 :]
                r["head_ms"] = now
                r["status"] = int(head.split(b" ", 2)[1])
                chunked = _Chunked() if b"chunked" in head.lower() else None
            piece = chunked.feed(data) if chunked else data
            text += piece
            while b"\n\n" in text:
                event, text = text.split(b"\n\n", 1)
                if not event.startswith(b"data: "):
                    continue
                payload = event[6:].strip()
                if r["first_event_ms"] is None:
                    r["first_event_ms"] = now
                if payload == b"[DONE]":
                    continue
                try:
                    doc = json.loads(payload)
                except ValueError:
                    continue
                if doc.get("timings"):
                    timings = doc["timings"]
                for choice in doc.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if r["first_token_ms"] is None:
                            r["first_token_ms"] = now
                        r["tokens"].append(now)
            if chunked is not None and chunked.done:
                break
    finally:
        s.close()
    r["total_ms"] = (time.perf_counter() - t0) * 1000
    r["timings"] = timings
    return r


# --- processes -----------------------------------------------------------------------------


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{what} did not listen on {port} within {timeout:g} s")


def start_engine(args, port: int, log, tmp: str) -> subprocess.Popen:
    if args.llama_server:
        cmd = [
            args.llama_server,
            "-m",
            args.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-c",
            "4096",
            "-np",
            "4",
            "-ngl",
            str(args.ngl),
            *args.engine_arg,
        ]
    else:
        cmd = [
            PY,
            "-m",
            "llmgw.sim.fake_engine",
            "llama-server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-m",
            str(Path(tmp) / "bench.gguf"),
        ]
        (Path(tmp) / "bench.gguf").write_bytes(b"GGUF" + bytes(64))
    env = dict(
        os.environ, FAKE_ENGINE_TOKEN_RATE=str(args.rate), FAKE_ENGINE_TOKENS=str(args.tokens)
    )
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    wait_port(port, p, "engine")
    if args.llama_server:  # listening is not loaded: wait for /health
        end = time.monotonic() + 180
        while time.monotonic() < end:
            try:
                c = socket.create_connection(("127.0.0.1", port), 1)
                c.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                if b" 200 " in c.recv(4096):
                    c.close()
                    break
                c.close()
            except OSError:
                pass
            time.sleep(0.25)
    return p


def start_router(engine_port: int, log, tmp: str) -> tuple[subprocess.Popen, int]:
    """`llmgw router --catalog` in front of the engine, as an operator runs one."""
    port = free_port()
    cat = Path(tmp) / "static.toml"
    cat.write_text(
        f'[[models]]\nid = "bench"\nserved_name = "bench"\n'
        f'endpoints = ["http://127.0.0.1:{engine_port}"]\n'
    )
    p = subprocess.Popen(
        [PY, "-m", "llmgw.cli", "router", "--catalog", str(cat), "--listen", f"127.0.0.1:{port}"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_port(port, p, "router")
    return p, port


# --- figures -------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(runs: list[dict], acks: int | None) -> dict:
    ok = [r for r in runs if r.get("status") == 200 and r["first_token_ms"] is not None]
    gaps = [b - a for r in ok for a, b in zip(r["tokens"], r["tokens"][1:], strict=False)]
    rates = [
        (len(r["tokens"]) - 1) / ((r["tokens"][-1] - r["tokens"][0]) / 1000)
        for r in ok
        if len(r["tokens"]) > 1 and r["tokens"][-1] > r["tokens"][0]
    ]
    engine_first = [
        r["timings"]["prompt_ms"] + r["timings"].get("predicted_per_token_ms", 0)
        for r in ok
        if r["timings"] and "prompt_ms" in r["timings"]
    ]
    engine_rate = [
        r["timings"]["predicted_per_second"]
        for r in ok
        if r["timings"] and r["timings"].get("predicted_per_second")
    ]
    out = {
        "streams": len(runs),
        "ok": len(ok),
        "head_ms_p50": pct([r["head_ms"] for r in ok], 0.5),
        "first_event_ms_p50": pct([r["first_event_ms"] for r in ok], 0.5),
        "ttft_ms_p50": pct([r["first_token_ms"] for r in ok], 0.5),
        "ttft_ms_min": min((r["first_token_ms"] for r in ok), default=None),
        "gap_ms_p50": pct(gaps, 0.5),
        "gap_ms_p99": pct(gaps, 0.99),
        "gap_ms_max": max(gaps, default=None),
        "tok_s_p50": pct(rates, 0.5),
        "engine_first_token_ms_p50": pct(engine_first, 0.5),
        "engine_tok_s_p50": pct(engine_rate, 0.5),
        "delayed_acks_per_stream": None if acks is None or not runs else acks / len(runs),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", help="a llama-server binary (else the fake engine)")
    ap.add_argument("--model", help="the GGUF file llama-server loads")
    ap.add_argument("--ngl", type=int, default=0, help="llama-server -ngl (99 on a GPU)")
    ap.add_argument("--engine-port", type=int, help="an engine already listening here")
    ap.add_argument("--rate", type=float, default=2000.0, help="the fake engine's tokens/s")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per measured stream")
    ap.add_argument(
        "--lead-tokens",
        type=int,
        default=8,
        help="tokens of the short answer before an 'after short' stream",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--streams", type=int, default=6, help="streams per phase and round")
    ap.add_argument(
        "--engine-arg", action="append", default=[], help="one more llama-server argument (repeat)"
    )
    ap.add_argument(
        "--log", help="the engine's and the router's output go here (default: a temporary file)"
    )
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    if args.llama_server and not args.model:
        ap.error("--llama-server needs --model")

    tmp = tempfile.mkdtemp(prefix="stream-hops-")
    log = open(args.log or os.path.join(tmp, "processes.log"), "ab")
    procs: list[subprocess.Popen] = []
    try:
        if args.engine_port:
            eport = args.engine_port
        else:
            eport = free_port()
            procs.append(start_engine(args, eport, log, tmp))
        router, rport = start_router(eport, log, tmp)
        procs.append(router)

        def body(tokens: int) -> bytes:
            return json.dumps(
                {
                    "model": "bench",
                    "stream": True,
                    "max_tokens": tokens,
                    "ignore_eos": True,
                    "temperature": 0.8,
                    "messages": [{"role": "user", "content": "Tell me a long story."}],
                }
            ).encode()

        long, lead = body(args.tokens), body(args.lead_tokens)
        paths = {"direct": eport, "router": rport}
        phases = [
            (f"{path}, after {order}", port, order)
            for order in ("long", "short")
            for path, port in paths.items()
        ]
        for port in paths.values():  # warm every path once
            stream_once(port, long)
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in phases}
        acks: dict[str, int | None] = {name: 0 for name, _, _ in phases}
        for _ in range(args.rounds):
            for name, port, order in phases:
                before = delayed_acks()
                for _ in range(args.streams):
                    if order == "short":
                        stream_once(port, lead)
                    runs[name].append(stream_once(port, long))
                after = delayed_acks()
                if before is None or after is None or acks[name] is None:
                    acks[name] = None
                else:
                    acks[name] += after - before
        result = {name: summarize(runs[name], acks[name]) for name in runs}
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(p.pid, signal.SIGKILL)
    engine = (
        f"llama-server -ngl {args.ngl}" if args.llama_server else f"fake engine {args.rate:g} tok/s"
    )
    print(
        f"{engine}, {args.tokens} tokens a stream, {args.rounds} rounds x {args.streams} streams a phase"
    )
    cols = [
        "head_ms_p50",
        "ttft_ms_p50",
        "ttft_ms_min",
        "gap_ms_p50",
        "gap_ms_p99",
        "tok_s_p50",
        "engine_first_token_ms_p50",
        "engine_tok_s_p50",
        "delayed_acks_per_stream",
    ]
    print(f"{'':22}" + "".join(f"{c[:14]:>15}" for c in cols))
    for name, row in result.items():
        cells = "".join(f"{'-' if row[c] is None else format(row[c], '.2f'):>15}" for c in cols)
        print(f"{name:22}{cells}")
    for order in ("long", "short"):
        d, r = result[f"direct, after {order}"], result[f"router, after {order}"]
        if d["ttft_ms_p50"] is not None and r["ttft_ms_p50"] is not None:
            rate = (r["tok_s_p50"] / d["tok_s_p50"]) if d["tok_s_p50"] and r["tok_s_p50"] else 0.0
            print(
                f"after {order}: the router adds {r['ttft_ms_p50'] - d['ttft_ms_p50']:+.2f} ms to the "
                f"time to first token (p50) and relays {rate:.3f}x direct's token rate"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": result, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
