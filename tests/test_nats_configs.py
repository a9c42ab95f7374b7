"""The shipped nats-server configs are valid for the nats-server the wheel installs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from llmgw.bus.server import find_nats_server

CONFIGS = sorted((Path(__file__).parent.parent / "nats").glob("*.conf"))


def test_there_are_configs_to_check() -> None:
    assert CONFIGS


@pytest.mark.parametrize("conf", CONFIGS, ids=lambda p: p.name)
def test_nats_config_is_valid(conf: Path) -> None:
    out = subprocess.run(
        [str(find_nats_server()), "-t", "-c", str(conf)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=conf.parent,
    )
    assert out.returncode == 0, out.stderr + out.stdout
