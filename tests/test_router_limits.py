"""A router process cannot be locked out by idle connections: it raises its open-file limit
to the hard one, holds client connections below it with a reserve for its own engine
connections and probes, and closes the oldest idle connection to make room."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from router_helpers import SERVED, fake_engines

from llmgw.bus.server import free_port

LLMGW = [sys.executable, "-m", "llmgw.cli"]


def _limit_files(n: int):
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    return preexec


def test_probes_are_served_while_thousands_of_idle_connections_are_held(tmp_path):
    idle = 2000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < idle + 512:
        pytest.skip(f"this process may open only {hard} files")
    if soft < idle + 512:
        resource.setrlimit(resource.RLIMIT_NOFILE, (idle + 512, hard))
    with fake_engines(tmp_path) as fleet:
        engine = fleet.start()
        cat = tmp_path / "static.toml"
        cat.write_text(
            f'[[models]]\nid = "tiny"\nserved_name = "{SERVED}"\nendpoints = ["{engine.url}"]\n'
        )
        port = free_port()
        log_path = tmp_path / "router.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [*LLMGW, "--log-level", "INFO", "router", "--catalog", str(cat)]
                + ["--listen", f"127.0.0.1:{port}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_limit_files(1024),  # as under `ulimit -n 1024`, hard limit too
            )
        held: list[socket.socket] = []
        try:
            deadline = time.monotonic() + 20
            while "router listening" not in log_path.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.05)
            assert "open-file limit 1024: holds 384 client connections" in log_path.read_text()
            for _ in range(idle):  # connected, and never a byte
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            time.sleep(0.5)
            served = 0
            for i in range(20):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
                    served += r.status == 200
                body = json.dumps(
                    {"model": SERVED, "messages": [{"role": "user", "content": f"q{i}"}]}
                ).encode()
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    data=body,
                    headers={"content-type": "application/json"},
                )
                with urllib.request.urlopen(req, timeout=10) as r:
                    served += r.status == 200
            assert served == 40
            assert "Too many open files" not in log_path.read_text()
        finally:
            for s in held:
                s.close()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0, log_path.read_text()
