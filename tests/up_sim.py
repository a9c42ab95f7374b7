"""`llmgw up --sim FLEET.toml` as a user runs it: a subprocess on free ports, its own data
dir and no LLMGW_ variables of the test run, with the CLI run against it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from waiting import until_logged

from llmgw.bus.server import free_port

ROOT = Path(__file__).resolve().parents[1]
# the example fleet as committed; examples/fleet.toml is the reader's to edit
FLEET = ROOT / "tests" / "samples" / "fleet.toml"
LLMGW = [sys.executable, "-m", "llmgw.cli"]


@dataclass
class UpSim:
    http_url: str
    env: dict[str, str]
    log: Path

    def run(self, *args: str) -> str:
        """An `llmgw` command against this fleet, from the repository root; its stdout."""
        done = subprocess.run(
            [*LLMGW, *args], capture_output=True, text=True, env=self.env, timeout=60, cwd=ROOT
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def chat(self, model: str) -> dict:
        """A chat completion through its router, not streamed: the answer."""
        import json
        import urllib.request

        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        request = urllib.request.Request(
            f"{self.http_url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.loads(r.read())


@contextmanager
def up_sim(fleet_file: Path, tmp: Path, *extra: str, ready_within: float = 60) -> Iterator[UpSim]:
    """Started, and returned once it says its simulated fleet is up; stopped with Ctrl-C."""
    nats, http = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env["LLMGW_NATS"] = f"nats://127.0.0.1:{nats}"
    log = tmp / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen(
            [*LLMGW, "up", "--sim", str(fleet_file), "--data-dir", str(tmp / "data"),
             "--port", str(nats), "--router-listen", f"127.0.0.1:{http}", *extra],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        until_logged(up, log, "simulated fleet", timeout=ready_within)
        yield UpSim(f"http://127.0.0.1:{http}", env, log)
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(30)
