"""What keys and limits cost a router, and how close to a limit several routers hold it.

cost: one Gateway (a real nats-server, the counter stream) admitting and finishing requests
with a key limited in requests, tokens, tokens a day and in flight (shares of 1%), against
the same Gateway with no keys in the bucket (the baseline: what a router does today), at
c=1 (microseconds per request, p50) and c=256 (requests a second, and the ratio). The
router's own HTTP cost comes on top of both alike: bench/router.py measures the router with
the gateway plugged in.

accuracy: R routers (Gateways on R connections to one nats-server) share two keys, one
limited to --rpm requests a minute and one to --tpm tokens a minute; C clients spread over
the routers send requests for --seconds (each holds its request 5-20 ms, then finishes with
a usage of 50 prompt tokens and 10-200 completion tokens, max_tokens 200; a refused client
waits min(retry-after, 0.5 s)). Prints, for every whole minute, requests and tokens admitted
against the limit, and the worst overshoot against the stated bound (docs/security.md:
admitted never passes the limit; tokens pass it only by usage beyond a reservation, which
max_tokens rules out here).

accuracy --http: the same through R real `llmgw router --nats` processes on one
nats-server, in front of bench/instant_engine.py (answers at once, 4 prompt and --tokens
completion tokens): the keys are in the bucket, C clients (aiohttp, in this process) spread
over the routers send chat completions with max_tokens 200. What each minute admitted is
read from the audit trail afterwards (each record's time is when its router admitted it,
its tokens the engine's usage), so it is the routers' own count, minute by minute.

    .venv/bin/python bench/gateway.py cost [--requests 20000]
    .venv/bin/python bench/gateway.py accuracy [--routers 3] [--clients 200] [--seconds 120]
    .venv/bin/python bench/gateway.py accuracy --http [--routers 3] [--clients 200] [--seconds 120]
    .venv/bin/python bench/gateway.py metering [--routers 2] [--clients 64] [--seconds 5]

metering: R real routers in front of bench/instant_engine.py --read-bodies (40 tokens, one
every 5 ms), a phase with a key of its own for each route that generates or embeds (chat,
completions, responses, infill, embeddings, rerank) and each framing: whole answers,
streams, and streams whose clients leave after 1-30 tokens; and whole answers of 300,000
tokens (over 1 MiB of JSON) from a second engine. After each, the tokens and requests the
routers metered for its key (the usage counters) against the engine's own count over the
phase (GET /counts: what it read and generated, a stream's tokens as each is written).
Whole answers and streams should match exactly, every route in its own usage names. A
stream cut short is charged the tokens the router relayed, with its prompt estimated from
its body's size where its events do not carry the engine's count (llama-server's /infill
events do), so there the prompt differs by design, and the completion by the tokens the
engine wrote that never reached the router before it closed. Last, a burst of hostile
bodies (caps in forms an engine reads otherwise, `n`, `n_predict`, -1, streams without a
cap, fields named twice, an odd `stream`) at a key limited in requests and tokens a minute
and in flight, against an engine that generates what the worse of llama-server and vLLM
would (3,000 tokens uncapped): what the engine ran in that minute beside each limit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

from llmgw.bus import keys, records
from llmgw.bus.client import BucketSettings, Bus, NatsSettings
from llmgw.bus.counters import AuditTrail, Counters, ensure_streams
from llmgw.bus.server import EmbeddedNats, free_port
from llmgw.gateway import credentials
from llmgw.gateway.gateway import Admission, Gateway
from llmgw.gateway.usage import Usage


async def _bus(url: str, name: str) -> Bus:
    return await Bus.connect(
        NatsSettings(urls=(url,), name=name), BucketSettings(), give_up_after=10
    )


def _key(name: str, secret: str, limits: records.Limits) -> records.ApiKey:
    return records.ApiKey(name=name, secrets=[credentials.hash_secret(secret, 0)], limits=limits)


async def cost(url: str, n: int) -> None:
    bus = await _bus(url, "bench-cost")
    await ensure_streams(bus)
    secret = credentials.new_secret("k")
    big = 10**9
    limited = Gateway("bench", Counters(bus), AuditTrail(bus))
    limited.apply(
        keys.apikey("k"),
        _key("k", secret, records.Limits(rpm=big, tpm=big, tokens_per_day=big, max_parallel=big)),
    )
    open_ = Gateway("bench", Counters(bus), AuditTrail(bus))
    header = f"Bearer {secret}"

    async def one(g: Gateway) -> None:
        a = await g.admit(authorization=header, model="m", prompt_chars=400, max_tokens=100)
        assert isinstance(a, Admission), a
        a.header_pairs()  # what the router adds to the answer
        a.finish(status=200, usage=Usage(100, 50))

    results: dict[str, tuple[float, float]] = {}
    for name, g in (("no keys", open_), ("keys and limits", limited)):
        for _ in range(200):  # warm: the first claims
            await one(g)
        times = []
        for _ in range(n):
            t = time.perf_counter()
            await one(g)
            times.append(time.perf_counter() - t)
        await g.flush()
        p50 = statistics.median(times) * 1e6

        done = 0
        start = time.perf_counter()

        async def worker(g: Gateway = g) -> None:
            nonlocal done
            for _ in range(n // 256 + 1):
                await one(g)
                done += 1

        async with anyio.create_task_group() as tg:
            for _ in range(256):
                tg.start_soon(worker)
        rate = done / (time.perf_counter() - start)
        await g.flush()
        results[name] = (p50, rate)
        print(f"{name:16} c=1 p50 {p50:7.1f} us/request   c=256 {rate:9,.0f} requests/s")
    (b50, brate), (k50, krate) = results["no keys"], results["keys and limits"]
    print(f"keys and limits add {k50 - b50:.1f} us at c=1 (p50); c=256 keeps {krate / brate:.3f}x")
    await bus.close()


async def accuracy(
    url: str, routers: int, clients: int, seconds: float, rpm: int, tpm: int
) -> None:
    buses = [await _bus(url, f"bench-router-{i}") for i in range(routers)]
    await ensure_streams(buses[0])
    secrets = {"req": credentials.new_secret("req"), "tok": credentials.new_secret("tok")}
    gateways = []
    for i, bus in enumerate(buses):
        g = Gateway(f"r{i}", Counters(bus), AuditTrail(bus))
        g.apply(keys.apikey("req"), _key("req", secrets["req"], records.Limits(rpm=rpm)))
        g.apply(keys.apikey("tok"), _key("tok", secrets["tok"], records.Limits(tpm=tpm)))
        gateways.append(g)
    admitted: dict[tuple[str, int], list[int]] = {}  # (key, minute) -> [requests, tokens]
    refused = 0
    rng = random.Random(1)
    stop = time.time() + seconds

    async def client(i: int) -> None:
        nonlocal refused
        name = "req" if i % 2 == 0 else "tok"
        g = gateways[i % routers]
        while time.time() < stop:
            a = await g.admit(
                authorization=f"Bearer {secrets[name]}", model="m", prompt_tokens=50, max_tokens=200
            )
            if not isinstance(a, Admission):
                refused += 1
                await anyio.sleep(min(a.retry_after or 0.5, 0.5))
                continue
            await anyio.sleep(rng.uniform(0.005, 0.02))
            u = Usage(50, rng.randint(10, 200))
            a.finish(status=200, usage=u)
            counts = admitted.setdefault((name, int(a.started // 60)), [0, 0])
            counts[0] += 1
            counts[1] += u.total

    async def flusher() -> None:
        while time.time() < stop + 1:
            for g in gateways:
                await g.flush()
            await anyio.sleep(0.2)

    started = time.time()
    async with anyio.create_task_group() as tg:
        tg.start_soon(flusher)
        for i in range(clients):
            tg.start_soon(client, i)
    print(f"{routers} routers, {clients} clients, {seconds:.0f} s; {refused:,} refusals")
    _per_minute(admitted, started, stop, rpm, tpm)
    for bus in buses:
        await bus.close()


def _per_minute(
    admitted: dict[tuple[str, int], list[int]], started: float, stop: float, rpm: int, tpm: int
) -> None:
    """Print each whole minute's requests (key "req") and tokens (key "tok") against their
    limits, the whole minutes together, and the worst overshoot against the stated bound."""
    first, last = int(started // 60) + 1, int(stop // 60) - 1  # whole minutes only
    worst_req = worst_tok = None
    reqs = toks = 0
    for minute in range(first, last + 1):
        r = admitted.get(("req", minute), [0, 0])[0]
        t = admitted.get(("tok", minute), [0, 0])[1]
        print(
            f"minute {minute}: key limited to {rpm} rpm admitted {r} ({r / rpm:.3f}x); "
            f"key limited to {tpm} tpm used {t} tokens ({t / tpm:.3f}x)"
        )
        worst_req = max(worst_req or 0, r - rpm)
        worst_tok = max(worst_tok or 0, t - tpm)
        reqs, toks = reqs + r, toks + t
    if worst_req is None:
        print("no whole minute in the run: give --seconds of at least 120")
        return
    n = last - first + 1
    print(
        f"{n} whole minute(s): {reqs} requests ({reqs / (n * rpm):.3f}x the limit), {toks} "
        f"tokens ({toks / (n * tpm):.3f}x)"
    )
    print(
        f"worst overshoot: {worst_req} requests, {worst_tok} tokens, against a stated "
        "bound of 0 for both (docs/security.md)"
    )


async def _until_served(http, ports: list[int], body: dict, secret: str) -> None:
    """Until every router on `ports` has read the bucket and serves `body` with `secret`."""
    warm = {"authorization": f"Bearer {secret}"}
    for port in ports:
        with anyio.fail_after(30):
            while True:
                async with http.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=warm
                ) as resp:
                    if resp.status == 200:
                        break
                await anyio.sleep(0.1)


async def accuracy_http(
    url: str, routers: int, clients: int, seconds: float, rpm: int, tpm: int, tokens: int
) -> None:
    import aiohttp
    from router import bench_engine, process  # bench/router.py

    from llmgw import catalog

    bus = await _bus(url, "bench-operator")
    await ensure_streams(bus)
    secrets = {n: credentials.new_secret(n) for n in ("req", "tok", "warm")}
    eport, engine = bench_engine("--tokens", str(tokens))
    model = catalog.Model(id="m", served_name="bench", endpoints=[f"http://127.0.0.1:{eport}"])
    await bus.put(keys.catalog("m"), catalog.encode_model(model))
    for name, limits in (
        ("req", records.Limits(rpm=rpm)),
        ("tok", records.Limits(tpm=tpm)),
        ("warm", records.Limits()),
    ):
        await bus.put(keys.apikey(name), _key(name, secrets[name], limits))
    env = {"LLMGW_LOG_LEVEL": "ERROR"}
    body = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}
    with engine, contextlib.ExitStack() as stack:
        ports = []
        for _ in range(routers):
            port = free_port()
            argv = [sys.executable, "-m", "llmgw.cli", "router", "--nats", url]
            stack.enter_context(process([*argv, "--listen", f"127.0.0.1:{port}"], port, env))
            ports.append(port)
        counts: dict[str, int] = {}
        stop = 0.0

        async def client(http: aiohttp.ClientSession, i: int) -> None:
            name = "req" if i % 2 == 0 else "tok"
            url = f"http://127.0.0.1:{ports[i % routers]}/v1/chat/completions"
            headers = {"authorization": f"Bearer {secrets[name]}"}
            while time.time() < stop:
                async with http.post(url, json=body, headers=headers) as resp:
                    await resp.read()
                    counts[str(resp.status)] = counts.get(str(resp.status), 0) + 1
                    if resp.status != 200:
                        retry = float(resp.headers.get("retry-after", "0.5"))
                        await anyio.sleep(min(retry, 0.5))

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            await _until_served(http, ports, body, secrets["warm"])
            started = time.time()
            stop = started + seconds
            async with anyio.create_task_group() as tg:
                for i in range(clients):
                    tg.start_soon(client, http, i)
        load = os.getloadavg()
    admitted: dict[tuple[str, int], list[int]] = {}
    with anyio.move_on_after(60):
        async for rec in AuditTrail(bus).read(since=started - 1):
            if rec.status != 200 or rec.key not in ("req", "tok"):
                continue
            c = admitted.setdefault((rec.key, int(rec.time // 60)), [0, 0])
            c[0] += 1
            c[1] += rec.prompt_tokens + rec.completion_tokens
    await bus.close()
    print(
        f"{routers} llmgw router processes, {clients} clients, {seconds:.0f} s; answers "
        f"{dict(sorted(counts.items()))}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    _per_minute(admitted, started, stop, rpm, tpm)


# every route a gateway meters, as metering sends it (`max_tokens` and its kin at 40, what
# the engine's answers run to anyway)
M = [{"role": "user", "content": "hi"}]
ROUTES = {
    "chat": ("/v1/chat/completions", {"messages": M, "max_tokens": 40}),
    "completions": ("/v1/completions", {"prompt": "once upon a time", "max_tokens": 40}),
    "responses": ("/v1/responses", {"input": "say hi", "max_output_tokens": 40}),
    "infill": ("/infill", {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 40}),
    "embeddings": ("/v1/embeddings", {"input": "one two three"}),
    "rerank": ("/v1/rerank", {"query": "red apple", "documents": ["a red apple", "blue sky"]}),
}
STREAMING = ("chat", "completions", "responses", "infill")
BIG_TOKENS = 300_000  # a whole answer of "tok " * this is over 1 MiB

# bodies that made an engine generate more than the router read from them (issue 36), and
# ones the router now refuses; sent in a burst at a key limited three ways
_HM = '"model":"hostile","messages":[{"role":"user","content":"hi"}]'
HOSTILE = [
    b'{%s,"max_tokens":5,"max_completion_tokens":"3000"}' % _HM.encode(),
    b'{%s,"max_tokens":5,"max_completion_tokens":3000.0}' % _HM.encode(),
    b'{%s,"max_tokens":5,"n_predict":3000}' % _HM.encode(),
    b'{%s,"max_tokens":400,"n":8}' % _HM.encode(),
    b'{%s,"max_tokens":-1}' % _HM.encode(),
    b'{%s,"stream":true}' % _HM.encode(),
    b'{%s,"stream":true,"max_tokens":"5"}' % _HM.encode(),
    b'{%s,"stream":"yes","max_tokens":5}' % _HM.encode(),
    b'{%s,"model":"other","max_tokens":5}' % _HM.encode(),
    b'{%s,"max_tokens":5,"max_tokens":3000}' % _HM.encode(),
]
HOSTILE_LIMITS = records.Limits(rpm=300, tpm=40_000, max_parallel=4)


async def metering(url: str, routers: int, clients: int, seconds: float) -> None:
    """A phase a route and framing, each with a key of its own: whole answers, streams,
    and streams their clients leave after 1-30 tokens, of every route that generates or
    embeds, and whole answers over 1 MiB; C clients spread over R real routers. After each,
    the routers' usage counters for its key against the engine's own count of what it read
    and generated over the phase (bench/instant_engine.py's GET /counts). Then a burst of
    hostile bodies at a key limited in requests and tokens a minute and in flight: what
    the engine ran in that minute against each limit."""
    import aiohttp
    from router import bench_engine, process  # bench/router.py

    from llmgw import catalog
    from llmgw.gateway.metering import parse_usage_subject

    bus = await _bus(url, "bench-operator")
    await ensure_streams(bus)
    phases = [
        (route, framing)
        for route in ROUTES
        for framing in (("whole", "stream", "cut") if route in STREAMING else ("whole",))
    ] + [("chat", "big")]
    names = [f"{route}-{framing}" for route, framing in phases]
    secrets = {n: credentials.new_secret(n) for n in (*names, "warm", "hostile")}
    engines = {
        # 40 tokens, one every 5 ms: a client leaving after a few leaves mid-stream
        "bench": ("--first-token", "0.01", "--token-interval", "0.005", "--tokens", "40"),
        "big": ("--tokens", str(BIG_TOKENS)),
        # answers of 3,000 tokens, 3 s each: in flight long enough to count
        "hostile": ("--first-token", "0.05", "--token-interval", "0.001", "--tokens", "3000"),
    }
    started = {name: bench_engine(*schedule, "--read-bodies") for name, schedule in engines.items()}
    for name, (eport, _) in started.items():
        model = catalog.Model(id=name, served_name=name, endpoints=[f"http://127.0.0.1:{eport}"])
        await bus.put(keys.catalog(name), catalog.encode_model(model))
    for name, secret in secrets.items():
        limits = HOSTILE_LIMITS if name == "hostile" else records.Limits()
        await bus.put(keys.apikey(name), _key(name, secret, limits))

    async def metered(key: str) -> dict[str, int]:
        out = {"requests": 0, "prompt": 0, "completion": 0}
        for subject, value in (await Counters(bus).totals(f"{keys.USAGE_ROOT}.>")).items():
            row = parse_usage_subject(subject, value)
            if row is not None and row.key == key and row.kind in out:
                out[row.kind] += value
        return out

    async def settled(key: str) -> dict[str, int]:
        """The key's counters once the routers sent all they counted (two reads alike,
        0.5 s apart: a router flushes every 0.2 s)."""
        last = await metered(key)
        while True:
            await anyio.sleep(0.5)
            now = await metered(key)
            if now == last:
                return now
            last = now

    ports: list[int] = []

    async def client(
        http: aiohttp.ClientSession,
        i: int,
        route: str,
        framing: str,
        stop: float,
        answers: dict[int, int],
        rng: random.Random,
    ) -> None:
        path, body = ROUTES[route]
        url = f"http://127.0.0.1:{ports[i % routers]}{path}"
        headers = {"authorization": f"Bearer {secrets[f'{route}-{framing}']}"}
        if framing == "big":
            payload = {"model": "big", "messages": M}
        else:
            payload = {"model": "bench", **body, "stream": framing != "whole"}
        while time.monotonic() < stop:
            leave = rng.randint(1, 30) if framing == "cut" else None
            async with http.post(url, json=payload, headers=headers) as resp:
                answers[resp.status] = answers.get(resp.status, 0) + 1
                if leave is None:
                    await resp.read()
                    continue
                seen = 0
                async for line in resp.content:
                    seen += line.count(b'"tok "')
                    if seen >= leave:
                        break  # leaving the block with the answer unread drops its connection

    async def hostile(
        http: aiohttp.ClientSession, i: int, stop: float, answers: dict[int | str, int]
    ) -> None:
        url = f"http://127.0.0.1:{ports[i % routers]}/v1/chat/completions"
        headers = {
            "authorization": f"Bearer {secrets['hostile']}",
            "content-type": "application/json",
        }
        n = i
        while time.monotonic() < stop:
            body = HOSTILE[n % len(HOSTILE)]
            n += 1
            async with http.post(url, data=body, headers=headers) as resp:
                try:
                    await resp.read()
                except aiohttp.ClientPayloadError:
                    # a stream a limit refused more tokens: the router ends it there
                    answers["ended"] = answers.get("ended", 0) + 1
                    continue
                answers[resp.status] = answers.get(resp.status, 0) + 1
                if resp.status == 429:
                    await anyio.sleep(0.2)

    env = {"LLMGW_LOG_LEVEL": "ERROR"}
    with contextlib.ExitStack() as stack:
        for _, engine in started.values():
            stack.enter_context(engine)
        for _ in range(routers):
            port = free_port()
            argv = [sys.executable, "-m", "llmgw.cli", "router", "--nats", url]
            stack.enter_context(process([*argv, "--listen", f"127.0.0.1:{port}"], port, env))
            ports.append(port)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

            async def counts(engine: str) -> dict[str, int]:
                eport = started[engine][0]
                async with http.get(f"http://127.0.0.1:{eport}/counts") as resp:
                    return await resp.json()

            warm = {"model": "bench", "messages": M, "max_tokens": 1}
            await _until_served(http, ports, warm, secrets["warm"])
            await settled("warm")
            print(
                f"{routers} llmgw router processes, {clients} clients, {seconds:.0f} s a phase; "
                "an engine answering 40 tokens, one every 5 ms (and one answering "
                f"{BIG_TOKENS:,} at once: 'big', over 1 MiB of JSON)"
            )
            for (route, framing), name in zip(phases, names, strict=True):
                engine = "big" if framing == "big" else "bench"
                before = await counts(engine)
                stop = time.monotonic() + seconds
                answers: dict[int, int] = {}
                rng = random.Random(name)
                n = min(clients, 8) if framing == "big" else clients
                async with anyio.create_task_group() as tg:
                    for i in range(n):
                        tg.start_soon(client, http, i, route, framing, stop, answers, rng)
                await anyio.sleep(1)  # the engine sees the last clients leave
                got = await settled(name)
                after = await counts(engine)
                engine_said = {k: after[k] - before[k] for k in got}
                print(f"  {name}: answers {dict(sorted(answers.items()))}")
                for kind in ("requests", "prompt", "completion"):
                    e, m = engine_said[kind], got[kind]
                    print(
                        f"    {kind:>10}: engine {e:9d}, metered {m:9d} "
                        f"({m / e if e else 0:.4f}x, {m - e:+d})"
                    )

            # the hostile burst, inside one minute of the clock (the limits' windows)
            if time.time() % 60 > 60 - seconds - 5:
                await anyio.sleep(60 - time.time() % 60 + 0.2)
            before = await counts("hostile")
            stop = time.monotonic() + seconds
            burst: dict[int | str, int] = {}
            async with anyio.create_task_group() as tg:
                for i in range(clients):
                    tg.start_soon(hostile, http, i, stop, burst)
            await anyio.sleep(1)
            after = await counts("hostile")
            got = await settled("hostile")
            ran = {k: after[k] - before[k] for k in ("requests", "prompt", "completion")}
            tokens = ran["prompt"] + ran["completion"]
            lim = HOSTILE_LIMITS
            print(
                f"  hostile: {len(HOSTILE)} bodies in turn from {clients} clients for "
                f"{seconds:.0f} s, one minute; answers {dict(sorted(burst.items(), key=str))}"
            )
            for what, value, limit, bound in (
                ("requests a minute", ran["requests"], lim.rpm, "0"),
                (
                    "tokens a minute",
                    tokens,
                    lim.tpm,
                    "0, but for the events of streams past their reservation before they end",
                ),
                ("in flight at most", after["most_in_flight"], lim.max_parallel, "0"),
            ):
                assert limit is not None
                print(
                    f"    {what:>18}: engine ran {value:7d} against a limit of {limit:6d}: "
                    f"overshoot {max(0, value - limit):5d}; stated bound {bound}"
                )
            print(
                f"    {'metered':>18}: {got['prompt'] + got['completion']:7d} tokens of the "
                f"{tokens} the engine counted"
            )
        load = os.getloadavg()
    await bus.close()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--requests", type=int, default=20_000)
    a = sub.add_parser("accuracy")
    a.add_argument("--routers", type=int, default=3)
    a.add_argument("--clients", type=int, default=200)
    a.add_argument("--seconds", type=float, default=120.0)
    a.add_argument("--rpm", type=int, default=600)
    a.add_argument("--tpm", type=int, default=20_000)
    a.add_argument("--http", action="store_true", help="through real `llmgw router` processes")
    a.add_argument("--tokens", type=int, default=120, help="--http: completion tokens per answer")
    m = sub.add_parser("metering")
    m.add_argument("--routers", type=int, default=2)
    m.add_argument("--clients", type=int, default=64)
    m.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-gateway-") as tmp:
        server = EmbeddedNats(data_dir=Path(tmp) / "nats", port=free_port())
        server.start()
        try:
            if args.what == "cost":
                anyio.run(cost, server.url, args.requests)
            elif args.what == "metering":
                anyio.run(metering, server.url, args.routers, args.clients, args.seconds)
            else:
                common = (server.url, args.routers, args.clients, args.seconds, args.rpm, args.tpm)
                if args.http:
                    anyio.run(accuracy_http, *common, args.tokens)
                else:
                    anyio.run(accuracy, *common)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
