"""Finding, starting and talking to a real llama-server built by tools/build-llama-server.sh.

Tests that need one call `llama_server_binary()` / `llama_vocab()`, which skip the test
with the reason when there is none. A test module wants two fixtures (a session-wide model,
because reading the 32k-token vocabulary takes a second or two):

    @pytest.fixture(scope="session")
    def tiny_model(tmp_path_factory):
        return tiny_gguf(tmp_path_factory.mktemp("tiny-model"))

    @pytest.fixture
    def llama_server(tiny_model, tmp_path):
        with serving_tiny_model(tiny_model, tmp_path) as server:
            yield server
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmgw.bus.server import free_port

BINARY_ENV = "LLMGW_LLAMA_SERVER"  # an existing llama-server to test against
VOCAB_ENV = "LLMGW_LLAMA_VOCAB"  # a vocab-only GGUF, when it is not next to the binary
VOCAB_NAME = "ggml-vocab-llama-spm.gguf"
BUILD_HINT = (
    "run tools/build-llama-server.sh (about 7 minutes on 2 cores) or set "
    f"{BINARY_ENV}=/path/to/llama-server"
)


def cache_root() -> Path:
    return Path(os.environ.get("LLMGW_CACHE") or Path.home() / ".cache" / "llmgw")


def _cached_builds() -> list[Path]:
    """Cache directories holding a built llama-server, newest llama.cpp build first."""

    def build_number(path: Path) -> int:
        number = path.parent.name.removeprefix("llama-server-").split(".")[0]
        return int(number) if number.isdigit() else -1

    found = cache_root().glob("llama-server-*/llama-server")
    return sorted((p.parent for p in found if os.access(p, os.X_OK)), key=build_number)[::-1]


def from_env(name: str) -> Path | str | None:
    """The executable $`name` names, why it is not one, or None when it is unset."""
    if explicit := os.environ.get(name):
        path = Path(explicit)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        return f"{name}={explicit} is not an executable file"
    return None


def found_or_skip(found: Path | str, env: str) -> Path:
    """`found`, or the calling test skipped with why not. A wrong $`env` fails it instead:
    someone asked for that binary, and a skip would hide the typo."""
    if isinstance(found, str):
        if os.environ.get(env):
            pytest.fail(found)
        pytest.skip(found)
    return found


def find_llama_server() -> Path | str:
    """The binary to test, or why there is none: $LLMGW_LLAMA_SERVER, the build cache, PATH."""
    if (explicit := from_env(BINARY_ENV)) is not None:
        return explicit
    if builds := _cached_builds():
        return builds[0] / "llama-server"
    if on_path := shutil.which("llama-server"):
        return Path(on_path)
    return f"no llama-server in ${BINARY_ENV}, {cache_root()}/llama-server-*/ or PATH; {BUILD_HINT}"


def find_vocab(binary: Path) -> Path | str:
    """A vocab-only GGUF: $LLMGW_LLAMA_VOCAB, beside the binary, or in a cached build."""
    if explicit := os.environ.get(VOCAB_ENV):
        path = Path(explicit)
        return path if path.is_file() else f"{VOCAB_ENV}={explicit} is not a file"
    for directory in [binary.parent, *_cached_builds()]:
        if (directory / VOCAB_NAME).is_file():
            return directory / VOCAB_NAME
    return (
        f"no {VOCAB_NAME} beside {binary} or in {cache_root()}/llama-server-*/; set {VOCAB_ENV} "
        "to a vocab-only GGUF from llama.cpp's models/ directory, or run "
        "tools/build-llama-server.sh, which puts one there"
    )


def llama_server_binary() -> Path:
    """The llama-server to test; skips the calling test, with the reason, when there is none."""
    return found_or_skip(find_llama_server(), BINARY_ENV)


def llama_vocab() -> Path:
    found = find_vocab(llama_server_binary())
    if isinstance(found, str):
        pytest.skip(found)
    return found


def tiny_gguf(directory: Path, *, seed: int = 0) -> Path:
    """A random-weight llama GGUF (dim 64, 2 layers, 32k vocabulary) in `directory`."""
    from llmgw.sim.tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(llama_vocab(), directory / "tiny-random.gguf", seed=seed)


@dataclass
class RunningLlamaServer:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def wait_ready(self, give_up_after: float = 60.0) -> None:
        """Until /health answers 200; fails with the server's output if it exits or never does."""
        deadline = time.monotonic() + give_up_after
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(
                    f"llama-server exited with {self.process.returncode} before becoming ready:\n"
                    f"{self.output()[-3000:]}"
                )
            try:
                status, _ = self.get("/health")
            except OSError:
                status = 0  # not listening yet
            if status == 200:
                return
            time.sleep(0.05)
        pytest.fail(f"llama-server not ready after {give_up_after} s:\n{self.output()[-3000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_llama_server(
    argv: Sequence[str], log_path: Path, port: int, env: dict[str, str] | None = None
) -> RunningLlamaServer:
    """Start `argv` (a full llama-server command line) with its output going to `log_path`."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    return RunningLlamaServer(process=process, port=port, log_path=log_path)


def tiny_server_argv(binary: Path, model: Path, port: int, *extra: str) -> list[str]:
    # One slot and a small context keep startup and memory tiny; -ngl 0 since the CPU build
    # has no GPU and a GPU build must not grab one for a test.
    return [
        str(binary),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        "512",
        "-np",
        "1",
        "-ngl",
        "0",
        *extra,
    ]


@contextmanager
def serving_tiny_model(model: Path, directory: Path) -> Iterator[RunningLlamaServer]:
    """A ready llama-server serving `model` as "tiny" on a free port; stopped on exit.

    Its output goes to `directory`/llama-server.log.
    """
    port = free_port()
    argv = tiny_server_argv(llama_server_binary(), model, port, "--alias", "tiny")
    server = start_llama_server(argv, directory / "llama-server.log", port)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def stream_chat(
    server: RunningLlamaServer, content: str, max_tokens: int = 16, **extra: object
) -> Iterator[dict | str]:
    """POST a streamed chat completion; yields each SSE event's JSON, then the string "[DONE]".

    `extra` goes into the request body (llama-server's own fields: seed, ignore_eos ...).
    """
    body = json.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "stream": True,
            **extra,
        }
    )
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        try:
            if response.status != 200:
                raise AssertionError(f"chat answered {response.status}: {response.read()!r}")
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue  # blank separators between events
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    yield data
                    return
                yield json.loads(data)
        finally:
            # the response holds the socket too; llama-server will not exit on SIGTERM
            # while a client still holds a streaming request open
            response.close()
    finally:
        conn.close()
