"""A real nats-server whose one user may publish anything but what a test denies it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmgw.bus.server import find_nats_server, free_port


@contextmanager
def nats_denying(tmp_path: Path, deny: str, user: str = "u") -> Iterator[str]:
    """A JetStream nats-server (store under `tmp_path`) whose user `user` (password "pw")
    may not publish to `deny`; yields the URL that logs in as that user."""
    port = free_port()
    config = tmp_path / "nats.conf"
    config.write_text(
        f'port: {port}\nhost: "127.0.0.1"\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        f'authorization {{ users: [ {{ user: "{user}", password: "pw", permissions: {{\n'
        f'  publish: {{ allow: ">", deny: "{deny}" }} }} }} ] }}\n'
    )
    proc = subprocess.Popen(
        [str(find_nats_server()), "-c", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"nats://{user}:pw@127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait()
