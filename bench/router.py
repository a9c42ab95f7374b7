"""What the router costs and what its routing buys, each figure beside its baseline.

    .venv/bin/python bench/router.py            # everything (about 4 minutes)
    .venv/bin/python bench/router.py latency ceiling stream   # some sections

Sections:
- latency:  non-streaming chat completions at concurrency 1, 64 and 256 against an engine
            with a realistic service time (first token after 100 ms, then one every 10 ms,
            16 tokens), straight to the engine and through the router (wrk);
- idle:     the latency added at concurrency 1 against that engine, in alternating rounds
            (direct, router, nginx, again and again) and as the median over rounds: few
            requests a round at 4 a second, and a VM whose speed drifts between rounds;
- ceiling:  against an engine that answers at once: the most requests/s one router
            process sustains, the latency it adds at concurrency 1, its CPU per 1,000 requests;
- stream:   streamed completions at concurrency 64 and 256 (realistic engine, a new client
            connection a stream), direct, through the router and nginx, in interleaved
            rounds: time to first token p50/p99, tokens/s relayed, each router's CPU a
            stream (BENCH_STREAM_ROUNDS, _SECONDS, _CONCURRENCY);
- tokens:   one stream at a time against llmgw's fake engine, direct, through nginx
            (proxy_buffering off) and through the router, interleaved: time to first token
            and between tokens at 2,000 tokens/s, and one stream's token rate at 500, 2,000
            and 8,000 tokens/s (BENCH_STREAMS, BENCH_ROUNDS: how many);
BENCH_BASELINE=REV adds the router of git revision REV beside this tree's, in the same
rounds (sections latency, idle, stream, tokens, large).
- keys:     the router with keys and limits on (a bucket holding a key limited in requests,
            tokens, tokens a day and in flight; every request authenticated, charged,
            metered and audited) against the same router with none (a bucket without keys),
            against an engine that answers at once, in alternating rounds: added p50 at
            concurrency 1 and the throughput ratio at 256 (BENCH_KEYS_ROUNDS, _SECONDS); then
            streams at 256 against the realistic engine (tokens/s ratio, time to first
            token, router CPU a stream; BENCH_KEYS_STREAM_SECONDS); then the ratio at 256
            against an engine that answers after its service time (BENCH_KEYS_SERVICE,
            seconds, comma-separated; 0.05 by default);
- large:    whole answers of 200 KB, 400 KB and 1 MB (an embeddings batch is this size),
            past the router's buffer mark (256 KiB) or not, straight to the engine and
            through the router, in interleaved rounds at concurrency 8 on kept-alive
            connections: answers/s, MB/s, the router's ratio to direct, its CPU an answer,
            and answers that stalled (none within 2 s; BENCH_LARGE_SIZES, _CONCURRENCY,
            _ROUNDS, _SECONDS);
- balance:  a simulation of exact least-in-flight against power-of-two choices and random
            (the same arrivals and service times for each);
- affinity: a multi-turn chat workload over 4 real llama-servers (the tiny model, built by
            tools/build-llama-server.sh): prompt tokens served from the engines' cache and
            time to first token, with prefix affinity and with plain least-in-flight.

The engine, the router and the load generator share this machine's cores. The engine is
bench/instant_engine.py (raw asyncio, microseconds a request) on a realistic schedule, so
that the comparison measures the router and not an engine competing with it for CPU.
wrk (Debian package `wrk`) drives the non-streaming load; without it those sections say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmgw.bus.server import free_port  # noqa: E402

PY = sys.executable
# first token after 100 ms, then one every 10 ms, 16 in all
REALISTIC = ("--first-token", "0.1", "--token-interval", "0.01", "--tokens", "16")
CHAT = {"model": "bench", "messages": [{"role": "user", "content": "hello there"}]}


# --- processes ---------------------------------------------------------------------------


def _wait_http(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    import http.client

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"process {proc.args} exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{proc.args} not ready on port {port}")


@contextlib.contextmanager
def process(
    argv: list[str],
    port: int,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    cwd: Path | None = None,
):
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=cwd
    )
    try:
        _wait_http(port, proc)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log:
            out.close()


def bench_engine(*schedule: str):
    """bench/instant_engine.py: costs microseconds a request, so the router is what is measured."""
    port = free_port()
    argv = [PY, str(ROOT / "bench" / "instant_engine.py"), str(port), *schedule]
    return port, process(argv, port)


def router(
    tmp: Path, engine_ports: list[int], *args: str, served: str = "bench", tree: Path | None = None
):
    """The router of this tree, or of `tree` (a baseline revision unpacked by `baseline`)."""
    port = free_port()
    cat = tmp / f"catalog-{port}.toml"
    urls = ", ".join(f'"http://127.0.0.1:{p}"' for p in engine_ports)
    cat.write_text(f'[[models]]\nid = "m"\nserved_name = "{served}"\nendpoints = [{urls}]\n')
    argv = [PY, "-m", "llmgw.cli", "--log-level", "ERROR", "router", "--catalog", str(cat)]
    argv += ["--listen", f"127.0.0.1:{port}", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    if tree is not None:
        # before the installed (editable) llmgw; and `-m` puts the working directory first
        env["PYTHONPATH"] = str(tree)
    return port, process(argv, port, env, cwd=tree)


def baseline(tmp: Path) -> Path | None:
    """BENCH_BASELINE=REV (a git revision): that revision's tree, unpacked with `git archive`,
    so that a section can run its router beside this tree's in the same rounds."""
    rev = os.environ.get("BENCH_BASELINE")
    if not rev:
        return None
    tree = tmp / "baseline"
    if not tree.exists():
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True)
        if archive.returncode:
            raise SystemExit(f"BENCH_BASELINE={rev}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def nginx(tmp: Path, engine_port: int):
    """nginx as a reference proxy (keep-alive upstream, no buffering), when installed."""
    port = free_port()
    d = tmp / f"nginx-{port}"
    d.mkdir()
    (d / "nginx.conf").write_text(f"""
worker_processes 1;
daemon off;
error_log {d}/error.log;
pid {d}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {d}/body;
  proxy_temp_path {d}/proxy;
  upstream engine {{ server 127.0.0.1:{engine_port}; keepalive 1024; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://engine;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
""")
    return port, process(["nginx", "-c", str(d / "nginx.conf")], port)


# --- wrk ---------------------------------------------------------------------------------


def wrk(
    port: int, connections: int, seconds: float, body: dict, headers: dict[str, str] | None = None
) -> dict[str, float]:
    script = Path(tempfile.mkstemp(suffix=".lua")[1])
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(json.dumps(body))}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        + "".join(
            f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}\n" for k, v in (headers or {}).items()
        )
    )
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{seconds}s",
            "--latency",
            "-s",
            str(script),
            f"http://127.0.0.1:{port}/v1/chat/completions",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    script.unlink()
    if "Non-2xx" in out:
        raise SystemExit(f"errors under load:\n{out}")

    def latency(label: str) -> float:
        m = re.search(rf"^\s+{label}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        assert m, out
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]

    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    total = int(re.search(r"(\d+) requests in", out).group(1))
    if total == 0:  # every connection failed or timed out: a ratio to it means nothing
        raise SystemExit(f"no request answered in {seconds:g} s at c={connections}:\n{out}")
    return {"rps": rps, "p50_ms": latency("50"), "p99_ms": latency("99"), "requests": total}


def need_wrk() -> bool:
    if shutil.which("wrk"):
        return True
    print("  (skipped: wrk is not installed; `apt-get install wrk`)")
    return False


# --- sections ----------------------------------------------------------------------------


def _realistic_behind_proxies(
    tmp: Path, stack: contextlib.ExitStack, procs: dict[str, psutil.Process] | None = None
) -> tuple[int, list[tuple[str, int]]]:
    """The realistic engine, with the router and (if installed) nginx in front of it: the
    engine's port and the (name, port) of each proxy, all stopped with `stack`; `procs`
    gets each router's process by name."""
    eport, engine = bench_engine(*REALISTIC)
    stack.enter_context(engine)
    rport, rt = router(tmp, [eport])
    proc = stack.enter_context(rt)
    proxies = [("router", rport)]
    if procs is not None:
        procs["router"] = psutil.Process(proc.pid)
    base = baseline(tmp)
    if base is not None:
        bport, brt = router(tmp, [eport], tree=base)
        proc = stack.enter_context(brt)
        proxies.append(("base", bport))  # BENCH_BASELINE's router, in the same rounds
        if procs is not None:
            procs["base"] = psutil.Process(proc.pid)
    if shutil.which("nginx"):
        nport, ngx = nginx(tmp, eport)
        stack.enter_context(ngx)
        proxies.append(("nginx", nport))  # a reference point, not a goal
    return eport, proxies


def section_latency(tmp: Path) -> None:
    print("\n## Non-streaming chat completions, realistic engine (100 ms + 16 x 10 ms)")
    if not need_wrk():
        return
    with contextlib.ExitStack() as stack:
        eport, proxies = _realistic_behind_proxies(tmp, stack)
        print(f"{'':>11} | {'direct':^26} | " + " | ".join(f"{n:^40}" for n, _ in proxies))
        print(
            f"{'concurrency':>11} | {'req/s':>8} {'p50':>8} {'p99':>8} | "
            + " | ".join(
                f"{'req/s':>8} {'p50':>8} {'p99':>8} {'ratio':>5} {'+p50':>7}" for _ in proxies
            )
        )
        for c in (1, 64, 256):
            seconds = 8 if c > 1 else 6
            for port in [eport] + [p for _, p in proxies]:
                wrk(port, c, 2, CHAT)  # warm every path
            d = wrk(eport, c, seconds, CHAT)
            cells = []
            for _, port in proxies:
                r = wrk(port, c, seconds, CHAT)
                cells.append(
                    f"{r['rps']:>8.0f} {r['p50_ms']:>6.2f}ms {r['p99_ms']:>6.1f}ms "
                    f"{r['rps'] / d['rps']:>5.2f} {r['p50_ms'] - d['p50_ms']:>5.2f}ms"
                )
            print(
                f"{c:>11} | {d['rps']:>8.0f} {d['p50_ms']:>6.2f}ms {d['p99_ms']:>6.1f}ms | "
                + " | ".join(cells)
            )


def section_idle(tmp: Path) -> None:
    """Added p50 at concurrency 1 against the realistic engine, measured in alternating rounds:
    one request every 260 ms gives few samples a round, and the VM's noise drifts between
    rounds, so direct and proxied runs take turns and the added time is the median over
    rounds of (proxied p50 - direct p50 of the same round)."""
    print("\n## Concurrency 1, realistic engine: added p50 over alternating rounds")
    if not need_wrk():
        return
    rounds, seconds = 7, 15
    with contextlib.ExitStack() as stack:
        eport, proxies = _realistic_behind_proxies(tmp, stack)
        for port in [eport] + [p for _, p in proxies]:
            wrk(port, 1, 2, CHAT)  # warm every path
        added: dict[str, list[float]] = {name: [] for name, _ in proxies}
        samples = 0
        for _ in range(rounds):
            d = wrk(eport, 1, seconds, CHAT)
            samples += d["requests"]
            for name, port in proxies:
                added[name].append(wrk(port, 1, seconds, CHAT)["p50_ms"] - d["p50_ms"])
        print(f"{rounds} rounds of {seconds} s each way (~{samples // rounds} requests a round)")
        for name, values in added.items():
            print(
                f"{name:>7}: added p50 median {statistics.median(values):.2f} ms "
                f"(rounds: {', '.join(f'{v:.2f}' for v in values)})"
            )


def section_ceiling(tmp: Path) -> None:
    print("\n## Against an engine that answers at once")
    if not need_wrk():
        return
    eport, engine = bench_engine()
    with engine:
        rport, rt = router(tmp, [eport])
        with rt as proc:
            p = psutil.Process(proc.pid)
            for c in (1, 64):
                wrk(eport, c, 2, CHAT)
                wrk(rport, c, 2, CHAT)
                d = wrk(eport, c, 8, CHAT)
                cpu0 = sum(p.cpu_times()[:2])
                r = wrk(rport, c, 8, CHAT)
                cpu = sum(p.cpu_times()[:2]) - cpu0
                print(
                    f"  concurrency {c:>3}: direct {d['rps']:>7.0f} req/s p50 {d['p50_ms']:.3f} ms | "
                    f"router {r['rps']:>7.0f} req/s p50 {r['p50_ms']:.3f} ms | "
                    f"added p50 {r['p50_ms'] - d['p50_ms']:.3f} ms | "
                    f"router CPU {cpu / r['requests'] * 1000:.3f} s per 1,000 requests"
                )


def _bucket_router(tmp: Path, name: str, engine_port: int, key: str):
    """A nats-server whose bucket serves `bench` at the engine (catalog endpoints), with a
    key in it unless `key` is "": "limited" (all four limits) or "unlimited" (metered and
    audited only); the secret, the nats-server, and a router on it."""
    import anyio

    from llmgw import catalog
    from llmgw.bus import keys, records
    from llmgw.bus.client import BucketSettings, Bus, NatsSettings
    from llmgw.bus.counters import ensure_streams
    from llmgw.bus.server import EmbeddedNats
    from llmgw.gateway import credentials

    server = EmbeddedNats(data_dir=tmp / f"nats-{name}", port=free_port())
    server.start()
    secret = credentials.new_secret("bench")

    async def fill() -> None:
        bus = await Bus.connect(
            NatsSettings(urls=(server.url,), name="bench"), BucketSettings(), give_up_after=10
        )
        try:
            await ensure_streams(bus)
            model = catalog.Model(
                id="m", served_name="bench", endpoints=[f"http://127.0.0.1:{engine_port}"]
            )
            await bus.put(keys.catalog("m"), catalog.encode_model(model))
            if key:
                big = 10**9  # limits that never refuse: what is measured is their bookkeeping
                limits = (
                    records.Limits(rpm=big, tpm=big, tokens_per_day=big, max_parallel=big)
                    if key == "limited"
                    else records.Limits()
                )
                record = records.ApiKey(
                    name="bench", secrets=[credentials.hash_secret(secret)], limits=limits
                )
                await bus.put(keys.apikey("bench"), record)
        finally:
            await bus.close()

    anyio.run(fill)
    port = free_port()
    argv = [PY, "-m", "llmgw.cli", "--log-level", "ERROR", "router", "--nats", server.url]
    argv += ["--listen", f"127.0.0.1:{port}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    return secret, server, port, process(argv, port, env)


def _until_routed(port: int, headers: dict[str, str]) -> None:
    import http.client

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        c.request("POST", "/v1/chat/completions", json.dumps(CHAT), headers)
        if c.getresponse().status == 200:
            return
        time.sleep(0.1)
    raise SystemExit(f"the router on {port} does not route bench")


def _keys_rounds(
    tmp: Path, schedule: tuple[str, ...], concurrencies: tuple[int, ...], rounds: int, seconds: int
) -> dict[tuple[str, int], list[dict[str, float]]]:
    """wrk against three routers on one engine (`schedule`: bench/instant_engine.py's
    options), one without keys ("off"), one with a key limited four ways ("on"), one with
    a key and no limits ("key"), in alternating rounds at each concurrency."""
    eport, engine = bench_engine(*schedule)
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    with engine, contextlib.ExitStack() as stack:
        routers = _keyed_routers(tmp, stack, eport)
        for c in concurrencies:
            for port, auth, _ in routers.values():
                wrk(port, c, 2, CHAT, auth)  # warm: connections, the first claims
            for _ in range(rounds):
                for name, (port, auth, _) in routers.items():
                    results.setdefault((name, c), []).append(wrk(port, c, seconds, CHAT, auth))
    return results


def _keyed_routers(
    tmp: Path, stack: contextlib.ExitStack, eport: int
) -> dict[str, tuple[int, dict[str, str], psutil.Process]]:
    """Three routers on the engine at `eport`, each on a nats-server of its own, all stopped
    with `stack`: "off" (no keys), "on" (a key limited four ways), "key" (a key, no limits):
    name -> (port, the headers a client sends, the router's process)."""
    routers = {}
    for name, key in (("off", ""), ("on", "limited"), ("key", "unlimited")):
        secret, server, port, rt = _bucket_router(tmp, f"{name}-{eport}", eport, key)
        stack.callback(server.stop)
        proc = stack.enter_context(rt)
        auth = {"Authorization": f"Bearer {secret}"} if key else {}
        _until_routed(port, {"Content-Type": "application/json", **auth})
        routers[name] = (port, auth, psutil.Process(proc.pid))
    return routers


def _keys_streams(tmp: Path, rounds: int, seconds: float, c: int) -> None:
    """Streams at concurrency `c` against the realistic engine (the workload of issue 28's
    comparison with LiteLLM), through the three routers of `_keyed_routers` in alternating
    rounds: tokens/s relayed, time to first token, each router's CPU a stream. The keyed
    routers ask the engine for its usage chunk and strip it from what the client gets."""
    eport, engine = bench_engine(*REALISTIC)
    got: dict[str, dict[str, Any]] = {}
    with engine, contextlib.ExitStack() as stack:
        routers = _keyed_routers(tmp, stack, eport)
        lines = {
            n: b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in auth.items())
            for n, (_, auth, _) in routers.items()
        }
        for name, (port, _, _) in routers.items():
            asyncio.run(_stream_load(port, c, 1, lines[name]))  # warm
        for _ in range(rounds):
            for name, (port, _, proc) in routers.items():
                cpu = sum(proc.cpu_times()[:2])
                r = asyncio.run(_stream_load(port, c, seconds, lines[name]))
                r["cpu"] = sum(proc.cpu_times()[:2]) - cpu
                acc = got.setdefault(name, {"ttfts": [], "rates": [], "cpu": 0.0, "streams": 0})
                acc["ttfts"] += r["ttfts"]
                acc["rates"].append(r["tokens"] / r["seconds"])
                acc["cpu"] += r["cpu"]
                acc["streams"] += len(r["ttfts"])
    print(
        f"  streams at concurrency {c}, realistic engine (100 ms + 16 x 10 ms), {rounds} rounds "
        f"of {seconds:g} s each way (load average {_load()}):"
    )
    off = got["off"]
    for name, what in (("off", "no keys"), *_KEYED):
        g = got[name]
        ratios = [a / b for a, b in zip(g["rates"], off["rates"], strict=True)]
        print(
            f"    {what:>26}: {statistics.median(g['rates']):6.0f} tokens/s (ratio median "
            f"{statistics.median(ratios):.3f}x; goal >= 0.99x, issue 36), TTFT p50 "
            f"{_pct(g['ttfts'], 0.5) * 1000:.1f} ms p99 {_pct(g['ttfts'], 0.99) * 1000:.1f} ms, "
            f"router CPU {g['cpu'] / g['streams'] * 1e6:.0f} us a stream"
        )


_KEYED = (("on", "a key with all four limits"), ("key", "a key, no limits"))


def _ratios(results: dict, name: str, c: int) -> tuple[dict[str, float], list[float]]:
    rps = {n: statistics.median(r["rps"] for r in results[n, c]) for n in ("off", name)}
    ratios = [
        on["rps"] / off["rps"] for off, on in zip(results["off", c], results[name, c], strict=True)
    ]
    return rps, ratios


def section_keys(tmp: Path) -> None:
    print("\n## Keys and limits on, against the same router with none (engine answers at once)")
    if not need_wrk():
        return
    rounds = int(os.environ.get("BENCH_KEYS_ROUNDS", "5"))
    seconds = int(os.environ.get("BENCH_KEYS_SECONDS", "4"))
    results = _keys_rounds(tmp, (), (1, 256), rounds, seconds)
    print(f"  {rounds} rounds of {seconds:g} s each way; load average {_load()}")
    for name, what in _KEYED:
        p50 = {n: statistics.median(r["p50_ms"] for r in results[n, 1]) for n in ("off", name)}
        added = [
            on["p50_ms"] - off["p50_ms"]
            for off, on in zip(results["off", 1], results[name, 1], strict=True)
        ]
        rps, ratios = _ratios(results, name, 256)
        print(
            f"  {what}: c=1 p50 {p50['off']:.3f} -> {p50[name]:.3f} ms, added median "
            f"{statistics.median(added) * 1000:.0f} us (rounds "
            f"{', '.join(f'{a * 1000:.0f}' for a in added)}; goal <= 50 us); c=256 "
            f"{rps['off']:.0f} -> {rps[name]:.0f} req/s, ratio median "
            f"{statistics.median(ratios):.3f}x (rounds "
            f"{', '.join(f'{x:.3f}' for x in ratios)}; goal >= 0.98x)"
        )
    # streams, as clients of a real fleet send them (issue 28 compares gateways on these)
    _keys_streams(tmp, rounds, float(os.environ.get("BENCH_KEYS_STREAM_SECONDS", "6")), 256)
    # an engine is not instant: the same at c=256 against one that takes its service time
    for service in os.environ.get("BENCH_KEYS_SERVICE", "0.05").split(","):
        results = _keys_rounds(tmp, ("--first-token", service), (256,), rounds, seconds)
        print(
            f"  engine answering after {float(service) * 1000:g} ms, c=256 "
            f"(load average {_load()}):"
        )
        for name, what in _KEYED:
            rps, ratios = _ratios(results, name, 256)
            p50 = {
                n: statistics.median(r["p50_ms"] for r in results[n, 256]) for n in ("off", name)
            }
            print(
                f"    {what}: {rps['off']:.0f} -> {rps[name]:.0f} req/s, ratio median "
                f"{statistics.median(ratios):.3f}x (rounds {', '.join(f'{x:.3f}' for x in ratios)}"
                f"); p50 {p50['off']:.1f} -> {p50[name]:.1f} ms"
            )


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


async def _stream_one(port: int, body: bytes, headers: bytes = b"") -> tuple[float, int, float]:
    """(time to first token, tokens, total time) of one streamed request (`headers`: more
    header lines, each ending in CRLF)."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"%sconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (headers, len(body), body)
    )
    first = None
    tokens = 0
    tail = b""
    while True:
        data = await reader.read(65536)
        if not data:
            break
        seen = (tail + data).count(b'"content": "tok') - tail.count(b'"content": "tok')
        if seen and first is None:
            first = time.perf_counter() - started
        tokens += seen
        tail = (tail + data)[-32:]
        if tail.endswith(b"\r\n0\r\n\r\n"):  # the last chunk: the connection may stay open
            break
    writer.close()
    return first or float("nan"), tokens, time.perf_counter() - started


async def _stream_load(
    port: int, concurrency: int, seconds: float, headers: bytes = b""
) -> dict[str, Any]:
    body = json.dumps({**CHAT, "stream": True}).encode()
    ttfts: list[float] = []
    token_count = 0
    deadline = time.perf_counter() + seconds

    async def worker():
        nonlocal token_count
        while time.perf_counter() < deadline:
            ttft, n, _ = await _stream_one(port, body, headers)
            ttfts.append(ttft)
            token_count += n

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"ttfts": ttfts, "tokens": token_count, "seconds": time.perf_counter() - started}


def section_stream(tmp: Path) -> None:
    """Streams at concurrency 64 and 256 against the realistic engine, direct, through the
    router and through nginx (proxy_buffering off), in interleaved rounds (BENCH_STREAM_ROUNDS,
    BENCH_STREAM_SECONDS; BENCH_STREAM_CONCURRENCY, default "64,256"): time to first token p50 and p99 over every stream of every round,
    tokens/s relayed, each path's ratio to direct, and the router's p99 against nginx's."""
    rounds = int(os.environ.get("BENCH_STREAM_ROUNDS", "3"))
    seconds = float(os.environ.get("BENCH_STREAM_SECONDS", "6"))
    print(
        f"\n## Streaming, realistic engine (100 ms + 16 x 10 ms), {rounds} interleaved rounds "
        f"of {seconds:g} s each way"
    )
    with contextlib.ExitStack() as stack:
        procs: dict[str, psutil.Process] = {}
        eport, proxies = _realistic_behind_proxies(tmp, stack, procs)
        paths = [("direct", eport), *proxies]
        for c in [int(c) for c in os.environ.get("BENCH_STREAM_CONCURRENCY", "64,256").split(",")]:
            for _, port in paths:
                asyncio.run(_stream_load(port, c, 1))  # warm every path
            got: dict[str, dict[str, Any]] = {
                n: {"ttfts": [], "tokens": 0, "seconds": 0.0, "cpu": 0.0} for n, _ in paths
            }
            for _ in range(rounds):
                for name, port in paths:
                    proc = procs.get(name)
                    cpu = sum(proc.cpu_times()[:2]) if proc else 0.0
                    r = asyncio.run(_stream_load(port, c, seconds))
                    acc = got[name]
                    acc["ttfts"] += r["ttfts"]
                    acc["tokens"] += r["tokens"]
                    acc["seconds"] += r["seconds"]
                    acc["cpu"] += sum(proc.cpu_times()[:2]) - cpu if proc else 0.0
            print(f"  concurrency {c}:")
            rate = {n: g["tokens"] / g["seconds"] for n, g in got.items()}
            for name, g in got.items():
                t = g["ttfts"]
                cpu = f", CPU {g['cpu'] / len(t) * 1e6:.0f} us a stream" if g["cpu"] else ""
                print(
                    f"    {name:>6}: TTFT p50 {_pct(t, 0.5) * 1000:6.1f} ms p99 "
                    f"{_pct(t, 0.99) * 1000:6.1f} ms, {rate[name]:7.0f} tokens/s relayed "
                    f"({rate[name] / rate['direct']:.3f}x direct, {len(t)} streams{cpu})"
                )
            if "nginx" in got:
                for name in ("router", "base") if "base" in got else ("router",):
                    p99 = {n: _pct(got[n]["ttfts"], 0.99) * 1000 for n in (name, "nginx")}
                    print(
                        f"    {name} TTFT p99 - nginx's: {p99[name] - p99['nginx']:+.1f} ms "
                        f"(goal: within 20 ms); tokens/s {name}/direct "
                        f"{rate[name] / rate['direct']:.3f} (goal >= 0.99)"
                    )


# --- tokens: one stream's time to first token, time between tokens, token rate --------------


def fake_engine(tmp: Path, rate: float, tokens: int):
    """llmgw's fake engine as llama-server, streaming `tokens` tokens at `rate` a second."""
    from llmgw.sim.fake_engine import write_fake_gguf

    port = free_port()
    model = write_fake_gguf(tmp / "fake.gguf")
    argv = [PY, "-m", "llmgw.sim.fake_engine", "llama-server", "-m", str(model)]
    argv += ["--port", str(port), "--alias", "bench", "-np", "4"]
    env = {"FAKE_ENGINE_TOKEN_RATE": str(rate), "FAKE_ENGINE_TOKENS": str(tokens)}
    return port, process(argv, port, env)


async def _timed_stream(port: int, body: bytes) -> tuple[float, list[float], int, float]:
    """One streamed chat completion on a new connection: (time to first token, the gaps
    between reads that brought tokens, tokens, seconds from the first token to the last)."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    marker = b'"content": "tok'
    first = last = None
    gaps: list[float] = []
    tokens = 0
    tail = b""
    while True:
        data = await reader.read(65536)
        if not data:
            break
        now = time.perf_counter()
        seen = (tail + data).count(marker) - tail.count(marker)
        if seen:
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
            tokens += seen
        tail = (tail + data)[-32:]
        if tail.endswith(b"\r\n0\r\n\r\n"):
            break
    writer.close()
    if first is None:
        raise SystemExit(f"no token came back from port {port}")
    return first - started, gaps, tokens, last - first


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def _token_targets(tmp: Path, stack: contextlib.ExitStack, eport: int) -> list[tuple[str, int]]:
    """(name, port): the engine, nginx (if installed), the router, BENCH_BASELINE's router."""
    targets = [("direct", eport)]
    if shutil.which("nginx"):
        nport, ngx = nginx(tmp, eport)
        stack.enter_context(ngx)
        targets.append(("nginx", nport))
    rport, rt = router(tmp, [eport])
    stack.enter_context(rt)
    targets.append(("router", rport))
    base = baseline(tmp)
    if base is not None:
        bport, brt = router(tmp, [eport], tree=base)
        stack.enter_context(brt)
        targets.append(("base", bport))
    return targets


def section_tokens(tmp: Path) -> None:
    """Streams one at a time, direct, through nginx (proxy_buffering off) and through the
    router, interleaved (direct, nginx, router, again...) so the VM's drift hits each alike:
    time to first token and between tokens at 2,000 tokens/s (short streams), then one
    stream's token rate at 500, 2,000 and 8,000 tokens/s (the engine's own pace)."""
    streams = int(os.environ.get("BENCH_STREAMS", "30"))
    rounds = int(os.environ.get("BENCH_ROUNDS", "5"))
    chat = json.dumps({**CHAT, "stream": True}).encode()
    print("\n## One stream at a time: fake engine, direct vs nginx vs router, interleaved")
    with contextlib.ExitStack() as stack:
        eport, engine = fake_engine(tmp, 2000, 32)
        stack.enter_context(engine)
        targets = _token_targets(tmp, stack, eport)
        for _, port in targets:
            asyncio.run(_timed_stream(port, chat))  # warm every path
        ttft: dict[str, list[float]] = {name: [] for name, _ in targets}
        gaps: dict[str, list[float]] = {name: [] for name, _ in targets}
        for _ in range(streams):
            for name, port in targets:
                first, between, _, _ = asyncio.run(_timed_stream(port, chat))
                ttft[name].append(first)
                gaps[name] += between
        print(f"  2,000 tokens/s, {streams} streams of 32 tokens each way")
        print(
            f"  {'':>7} | {'TTFT p50':>9} {'p90':>8} {'+p50':>8} | {'between tokens p50':>18} {'p99':>8}"
        )
        base = _pct(ttft["direct"], 0.5)
        for name, _ in targets:
            print(
                f"  {name:>7} | {_pct(ttft[name], 0.5) * 1e3:>7.2f}ms {_pct(ttft[name], 0.9) * 1e3:>6.2f}ms "
                f"{(_pct(ttft[name], 0.5) - base) * 1e3:>6.2f}ms | "
                f"{_pct(gaps[name], 0.5) * 1e3:>16.3f}ms {_pct(gaps[name], 0.99) * 1e3:>6.3f}ms"
            )
    print(f"\n  single-stream token rate, median of {rounds} streams each way (ratio to direct)")
    for rate in (500, 2000, 8000):
        tokens = rate // 2 if rate > 2000 else rate  # half a second to a second a stream
        with contextlib.ExitStack() as stack:
            eport, engine = fake_engine(tmp, rate, tokens)
            stack.enter_context(engine)
            targets = _token_targets(tmp, stack, eport)
            for _, port in targets:
                asyncio.run(_timed_stream(port, chat))
            rates: dict[str, list[float]] = {name: [] for name, _ in targets}
            for _ in range(rounds):
                for name, port in targets:
                    _, _, n, took = asyncio.run(_timed_stream(port, chat))
                    rates[name].append((n - 1) / took if took > 0 else float("nan"))
            direct = statistics.median(rates["direct"])
            cells = " | ".join(
                f"{name} {statistics.median(r):>7.0f}/s ({statistics.median(r) / direct:.3f}x)"
                for name, r in rates.items()
            )
            print(f"  engine at {rate:>5} tokens/s ({tokens} tokens): {cells}")


# --- large: whole answers past the router's buffer mark ------------------------------------

# an answer not complete within this is counted as stalled, and its connection dropped
LARGE_STALL = 2.0


async def _whole_answers(port: int, concurrency: int, seconds: float) -> dict[str, float]:
    """Whole answers on `concurrency` kept-alive connections for `seconds`: how many, their
    bytes, and how many stalled (a new connection replaces a stalled one)."""
    body = json.dumps(CHAT).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    got = {"answers": 0, "bytes": 0, "stalled": 0}
    deadline = time.perf_counter() + seconds

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"answered {head[:200]!r}")
        length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
        await reader.readexactly(length)
        return length

    async def worker() -> None:
        conn = None
        while time.perf_counter() < deadline:
            if conn is None:
                conn = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
            try:
                size = await asyncio.wait_for(one(*conn), LARGE_STALL)
            except TimeoutError:
                got["stalled"] += 1
                conn[1].close()
                conn = None
                continue
            got["answers"] += 1  # (not `+= await`: that would add to a stale total)
            got["bytes"] += size
        if conn is not None:
            conn[1].close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    got["seconds"] = time.perf_counter() - started
    return got


def section_large(tmp: Path) -> None:
    """Whole answers of each size in BENCH_LARGE_SIZES (bytes), straight to the engine and
    through the router (and BENCH_BASELINE's), in interleaved rounds."""
    sizes = [
        int(x) for x in os.environ.get("BENCH_LARGE_SIZES", "200000,400000,1000000").split(",")
    ]
    c = int(os.environ.get("BENCH_LARGE_CONCURRENCY", "8"))
    rounds = int(os.environ.get("BENCH_LARGE_ROUNDS", "3"))
    seconds = float(os.environ.get("BENCH_LARGE_SECONDS", "3"))
    print(
        f"\n## Whole answers past the buffer mark, concurrency {c}, {rounds} interleaved rounds "
        f"of {seconds:g} s each way (stalled: none within {LARGE_STALL:g} s)"
    )
    base = baseline(tmp)
    for size in sizes:
        # instant_engine.py's answer is "tok " a token, and some 200 bytes besides
        eport, engine = bench_engine("--tokens", str(max(1, (size - 200) // 4)))
        with engine, contextlib.ExitStack() as stack:
            rport, rt = router(tmp, [eport])
            procs = {"router": psutil.Process(stack.enter_context(rt).pid)}
            paths = [("direct", eport), ("router", rport)]
            if base is not None:
                bport, brt = router(tmp, [eport], tree=base)
                procs["base"] = psutil.Process(stack.enter_context(brt).pid)
                paths.append(("base", bport))
            for _, port in paths:
                asyncio.run(_whole_answers(port, c, 1))  # warm every path
            got = {
                n: {"answers": 0, "bytes": 0, "stalled": 0, "seconds": 0.0, "cpu": 0.0}
                for n, _ in paths
            }
            rounds_rate: dict[str, list[float]] = {n: [] for n, _ in paths}
            for _ in range(rounds):
                for name, port in paths:
                    proc = procs.get(name)
                    cpu = sum(proc.cpu_times()[:2]) if proc else 0.0
                    r = asyncio.run(_whole_answers(port, c, seconds))
                    r["cpu"] = sum(proc.cpu_times()[:2]) - cpu if proc else 0.0
                    rounds_rate[name].append(r["answers"] / r["seconds"])
                    for k, v in r.items():
                        got[name][k] += v
            print(f"  answers of {size / 1000:g} KB (load average {_load()}):")
            rate = {n: g["answers"] / g["seconds"] for n, g in got.items()}
            for name, g in got.items():
                ratio = f", {rate[name] / rate['direct']:.3f}x direct" if name != "direct" else ""
                if g["cpu"]:
                    ratio += f", CPU {g['cpu'] / max(g['answers'], 1) * 1e6:.0f} us an answer"
                print(
                    f"    {name:>6}: {rate[name]:7.1f} answers/s, "
                    f"{g['bytes'] / g['seconds'] / 1e6:7.1f} MB/s{ratio}, {g['stalled']} stalled"
                )
            if base is not None:
                ratios = [
                    a / max(b, 1e-9)
                    for a, b in zip(rounds_rate["router"], rounds_rate["base"], strict=True)
                ]
                print(
                    f"    router/base: median {statistics.median(ratios):.3f}x "
                    f"(rounds {', '.join(f'{x:.3f}' for x in ratios)})"
                )


def section_balance(_tmp: Path) -> None:
    """Replicas with 4 slots each (FIFO queue behind), Poisson arrivals at 90% of capacity,
    exponential service times; the same random streams for every policy."""
    print(
        "\n## Choosing among 4 replicas: exact least-in-flight vs power of two vs random (simulated)"
    )
    import heapq

    def run(policy: str, seed: int, n: int = 200_000, replicas: int = 4, slots: int = 4) -> float:
        rng = random.Random(seed)
        pick_rng = random.Random(seed + 1)
        load = 0.9 * replicas * slots
        t = 0.0
        in_flight = [0] * replicas
        busy = [0] * replicas
        queues: list[list[float]] = [[] for _ in range(replicas)]
        events: list[tuple[float, int, int, float]] = []  # (time, kind 0=done, replica, arrived)
        total = 0.0
        done = 0
        arrivals = 0
        next_arrival = rng.expovariate(load)
        while done < n:
            if events and events[0][0] <= next_arrival:
                t, _, r, arrived = heapq.heappop(events)
                total += t - arrived
                done += 1
                in_flight[r] -= 1
                busy[r] -= 1
                if queues[r]:
                    a = queues[r].pop(0)
                    busy[r] += 1
                    heapq.heappush(events, (t + rng.expovariate(1.0), 0, r, a))
                continue
            t = next_arrival
            next_arrival = t + rng.expovariate(load)
            arrivals += 1
            if policy == "random":
                r = pick_rng.randrange(replicas)
            elif policy == "p2c":
                a, b = pick_rng.randrange(replicas), pick_rng.randrange(replicas)
                r = a if in_flight[a] <= in_flight[b] else b
            else:
                least = min(in_flight)
                r = pick_rng.choice([i for i, x in enumerate(in_flight) if x == least])
            in_flight[r] += 1
            if busy[r] < slots:
                busy[r] += 1
                heapq.heappush(events, (t + rng.expovariate(1.0), 0, r, t))
            else:
                queues[r].append(t)
        return total / done

    results = {p: statistics.mean(run(p, s) for s in (1, 2, 3)) for p in ("exact", "p2c", "random")}
    for p, v in results.items():
        print(
            f"  {p:>6}: mean time in system {v:.3f} service times ({v / results['exact']:.2f}x exact)"
        )


# --- affinity over real llama-servers ----------------------------------------------------


def _llama_binary() -> Path | None:
    if os.environ.get("LLMGW_LLAMA_SERVER"):
        return Path(os.environ["LLMGW_LLAMA_SERVER"])
    root = Path(os.environ.get("LLMGW_CACHE") or Path.home() / ".cache" / "llmgw")
    found = sorted(root.glob("llama-server-*/llama-server"))
    return found[-1] if found else None


async def _chat_turn(port: int, messages: list[dict]) -> tuple[float, int, int, str, float]:
    """(time to first token, prompt tokens, of them from cache, answer, the engine's own
    prompt-processing ms) of one streamed turn."""
    body = json.dumps(
        {
            "model": "tiny",
            "messages": messages,
            "stream": True,
            "max_tokens": 16,
            "temperature": 0,
            "seed": 1,
        }
    ).encode()
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    raw = b""
    first = None
    while True:
        data = await reader.read(65536)
        if not data:
            break
        if first is None and b'"content"' in data:
            first = time.perf_counter() - started
        raw += data
        if raw.endswith(b"\r\n0\r\n\r\n"):  # the last chunk (not a header ending in 0)
            break
    writer.close()
    if not raw.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"a chat turn failed: {raw[:500]!r}")
    answer, cached, prompt, prefill_ms = "", 0, 0, 0.0
    for line in raw.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        for choice in event.get("choices") or []:
            answer += (choice.get("delta") or {}).get("content") or ""
        if "timings" in event:
            cached = event["timings"].get("cache_n", 0)
            prompt = cached + event["timings"].get("prompt_n", 0)
            prefill_ms = event["timings"].get("prompt_ms", 0.0)
    return first or float("nan"), prompt, cached, answer, prefill_ms


async def _conversations(port: int, n: int, turns: int, concurrency: int, seed: int):
    """Conversations that each open with their own document (a few hundred tokens) and then
    ask short questions about it: what makes a cached prefix worth keeping."""
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()
    system = {"role": "system", "content": "You are a helpful assistant."}
    results: list[tuple[int, float, int, int, float]] = []  # turn, ttft, prompt, cached, prefill
    sem = asyncio.Semaphore(concurrency)

    async def conversation(i: int) -> None:
        local = random.Random(seed * 1000 + i)
        document = " ".join(local.choice(words) for _ in range(900))
        messages = [system]
        async with sem:
            for turn in range(turns):
                if turn:
                    # a person reads the answer before asking again: meanwhile the load on
                    # the replicas moves, as it does in real traffic
                    await asyncio.sleep(local.uniform(0.2, 1.5))
                q = " ".join(local.choice(words) for _ in range(12))
                content = f"Document {i}: {document}\n\nQuestion: {q}" if turn == 0 else q
                messages.append({"role": "user", "content": content})
                ttft, prompt, cached, answer, prefill = await _chat_turn(port, messages)
                messages.append({"role": "assistant", "content": answer})
                results.append((turn, ttft, prompt, cached, prefill))

    await asyncio.gather(*(conversation(i) for i in range(n)))
    return results


def section_affinity(tmp: Path) -> None:
    print("\n## Multi-turn chat over 4 real llama-servers: prefix affinity vs least-in-flight")
    binary = _llama_binary()
    if binary is None or not binary.exists():
        print("  (skipped: no llama-server; run tools/build-llama-server.sh)")
        return
    vocab = binary.parent / "ggml-vocab-llama-spm.gguf"
    from llmgw.sim.tiny_gguf import write_tiny_gguf

    model = write_tiny_gguf(vocab, tmp / "tiny.gguf")
    ports = [free_port() for _ in range(4)]
    with contextlib.ExitStack() as stack:
        for p in ports:
            argv = [
                str(binary),
                "-m",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(p),
                "-c",
                "16384",
                "-np",
                "8",
                "-ngl",
                "0",
                "--alias",
                "tiny",
                "-t",
                "1",
                # the KV cache is what affinity keeps warm: no second cache in host RAM
                # (--cache-ram; GPU engines have none), 8 slots of 2,048 tokens each
                "--cache-ram",
                "0",
            ]
            stack.enter_context(process(argv, p, log=tmp / f"llama-{p}.log"))
        rows = {}
        for label, args in (("affinity", []), ("least-in-flight", ["--affinity-load-factor", "0"])):
            rport, rt = router(tmp, ports, *args, served="tiny")
            with rt:
                rows[label] = asyncio.run(
                    _conversations(rport, n=32, turns=6, concurrency=8, seed=7)
                )
    print(
        f"  {'policy':>16} | {'prompt tokens':>13} {'from cache':>10} {'share':>6} | "
        f"{'engine prefill':>14} | {'TTFT p50':>8} {'p90':>8}   (turns 2-6)"
    )
    for label, res in rows.items():
        later = [r for r in res if r[0] > 0]
        prompt = sum(r[2] for r in later)
        cached = sum(r[3] for r in later)
        prefill = sum(r[4] for r in later) / 1000
        ttfts = sorted(r[1] for r in later)
        print(
            f"  {label:>16} | {prompt:>13} {cached:>10} {cached / max(prompt, 1):>6.1%} | "
            f"{prefill:>12.1f} s | {ttfts[len(ttfts) // 2] * 1000:>6.1f}ms "
            f"{ttfts[int(len(ttfts) * 0.9)] * 1000:>6.1f}ms"
        )


SECTIONS = {
    "latency": section_latency,
    "idle": section_idle,
    "ceiling": section_ceiling,
    "stream": section_stream,
    "tokens": section_tokens,
    "keys": section_keys,
    "large": section_large,
    "balance": section_balance,
    "affinity": section_affinity,
}


def main() -> None:
    wanted = sys.argv[1:] or list(SECTIONS)
    unknown = [w for w in wanted if w not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    print(f"bench/router.py on {os.cpu_count()} CPU(s), Python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory() as d:
        for name in wanted:
            SECTIONS[name](Path(d))


if __name__ == "__main__":
    main()
