"""A JetStream cluster of real nats-server processes on this host (loopback ports), and the
process-level faults the tests and bench/chaos.py inject into it: SIGKILL one server (or
all), SIGSTOP and SIGCONT it, start it again on its store and ports.

Each server has its own store, client, route and monitoring port, a cluster name, and
routes to all the others (as nats/cluster-1.conf, on loopback). A server started alone
has no JetStream meta leader until a second one joins: JetStream answers nothing (or 503)
until then. `sync_interval` goes into every server's jetstream block (None: the server's
default, two minutes).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from cluster_helpers import healthy_at

from llmgw.bus.server import find_nats_server, free_port


@dataclass
class LocalServer:
    name: str
    store: Path
    port: int = field(default_factory=free_port)
    route_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    paused: bool = False

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.running and self.process is not None else None

    def jsz(self, **query: str) -> dict | None:
        """The server's /jsz monitoring page (None: no answer)."""
        q = "&".join(f"{k}={v}" for k, v in query.items())
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.http_port}/jsz?{q}", timeout=1
            ) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def healthy(self) -> bool:
        return healthy_at(self.http_port)


class LocalCluster:
    def __init__(
        self, root: Path, size: int = 3, *, sync_interval: str | None = None, name: str = "c"
    ) -> None:
        self.servers = [LocalServer(f"s{i}", root / f"s{i}") for i in range(size)]
        routes = ", ".join(f'"nats-route://127.0.0.1:{s.route_port}"' for s in self.servers)
        sync = f"\n  sync_interval: {sync_interval}" if sync_interval else ""
        for s in self.servers:
            s.store.mkdir(parents=True)
            (s.store / "server.conf").write_text(
                f'server_name: "{s.name}"\nhost: "127.0.0.1"\nport: {s.port}\n'
                f"http_port: {s.http_port}\n"
                f'jetstream {{\n  store_dir: "{s.store / "js"}"{sync}\n}}\n'
                f'cluster {{ name: "{name}"\n host: "127.0.0.1"\n port: {s.route_port}\n'
                f" routes: [{routes}] }}\n"
            )

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(s.url for s in self.servers)

    def named(self, name: str) -> LocalServer:
        return next(s for s in self.servers if s.name == name)

    def index(self, name: str) -> int:
        return next(i for i, s in enumerate(self.servers) if s.name == name)

    def by_port(self, port: int) -> LocalServer:
        return next(s for s in self.servers if s.port == port)

    def start(self, i: int) -> None:
        """Start server `i` (again: on its store and ports), until it accepts clients;
        its JetStream may not be ready."""
        s = self.servers[i]
        with open(s.store / "server.log", "ab") as log:
            s.process = subprocess.Popen(
                [str(find_nats_server()), "-c", str(s.store / "server.conf")],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C of the test run is not also the servers'
            )
        s.paused = False
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", s.port), timeout=0.2).close()
                return
            except OSError:
                if time.monotonic() > deadline or s.process.poll() is not None:
                    raise RuntimeError(f"nats-server {s.name} did not start") from None
                time.sleep(0.05)

    def start_all(self, timeout: float = 60.0) -> LocalCluster:
        for i in range(len(self.servers)):
            self.start(i)
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Until every running server answers /healthz; RuntimeError with its log if not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(s.healthy() for s in self.servers if s.running):
                return
            time.sleep(0.1)
        sick = [s for s in self.servers if s.running and not s.healthy()]
        tails = "\n".join(f"--- {s.name}\n{self.log_tail(s)}" for s in sick)
        raise RuntimeError(f"the NATS cluster did not become healthy in {timeout:.0f}s:\n{tails}")

    def log_tail(self, s: LocalServer, lines: int = 30) -> str:
        try:
            text = (s.store / "server.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # --- faults ---------------------------------------------------------------------------

    def kill(self, i: int) -> None:
        """SIGKILL server `i`: what it had not synced to disk is lost with it."""
        s = self.servers[i]
        if s.process is not None and s.process.poll() is None:
            if s.paused:
                os.kill(s.process.pid, signal.SIGCONT)  # a stopped process dies only when run
            s.process.kill()
            s.process.wait()
        s.paused = False

    def kill_all(self) -> None:
        """SIGKILL every server at once (a power loss of the whole cluster)."""
        running = [s for s in self.servers if s.process is not None and s.process.poll() is None]
        for s in running:
            assert s.process is not None
            os.kill(s.process.pid, signal.SIGKILL)
        for s in running:
            assert s.process is not None
            s.process.wait()
            s.paused = False

    def pause(self, i: int) -> None:
        """SIGSTOP server `i`: its connections stay open and nothing answers."""
        s = self.servers[i]
        assert s.process is not None
        os.kill(s.process.pid, signal.SIGSTOP)
        s.paused = True

    def resume(self, i: int) -> None:
        s = self.servers[i]
        assert s.process is not None
        os.kill(s.process.pid, signal.SIGCONT)
        s.paused = False

    def stop(self) -> None:
        """Stop every server (SIGTERM, SIGKILL after 5 s); what a fixture calls at the end."""
        for s in self.servers:
            if s.process is not None and s.process.poll() is None:
                if s.paused:
                    os.kill(s.process.pid, signal.SIGCONT)
                s.process.terminate()
        for s in self.servers:
            if s.process is not None:
                try:
                    s.process.wait(5)
                except subprocess.TimeoutExpired:
                    s.process.kill()
                    s.process.wait()
            s.paused = False

    # --- who leads ------------------------------------------------------------------------

    def stream_leader(self, stream: str) -> str | None:
        """The server that leads `stream`, as a running server's /jsz says (None: none
        known, or no server answers)."""
        for s in self.servers:
            if not s.running or s.paused:
                continue
            page = s.jsz(streams="true")
            for account in (page or {}).get("account_details") or []:
                for detail in account.get("stream_detail") or []:
                    if detail.get("name") == stream:
                        leader = (detail.get("cluster") or {}).get("leader")
                        if leader:
                            return leader
        return None
