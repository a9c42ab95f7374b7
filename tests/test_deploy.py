"""The shipped systemd unit is one systemd accepts without a warning."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).parent.parent / "deploy"
UNIT = DEPLOY / "llmgw-agent.service"


def _verify(unit_path: Path, binary: str, tmp_path: Path) -> str:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here")
    text = unit_path.read_text()
    assert f"ExecStart={binary} " in text
    # verify checks that ExecStart exists: point it at an executable that does
    unit = tmp_path / unit_path.name
    unit.write_text(text.replace(binary, sys.executable))
    out = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr
    return text


def test_router_unit_waits_longer_than_the_routers_grace_before_killing_it(tmp_path: Path):
    text = (DEPLOY / "llmgw-router.service").read_text()
    grace = float(text.split("--shutdown-grace ")[1].split()[0])
    stop = float(text.split("TimeoutStopSec=")[1].split()[0])
    assert stop > grace, "systemd would SIGKILL the router before its streams finish"
    _verify(DEPLOY / "llmgw-router.service", "/opt/llmgw/bin/llmgw", tmp_path)


def test_agent_unit_verifies_cleanly(tmp_path: Path) -> None:
    text = _verify(UNIT, "/opt/llmgw/bin/llmgw-agent", tmp_path)
    assert "Restart=on-failure" in text and "KillMode=mixed" in text
    # docs/agent.md: a config problem (exit 78, EX_CONFIG) is not restarted
    from llmgw.agent.service import EX_CONFIG

    assert f"RestartPreventExitStatus={EX_CONFIG}" in text.splitlines()
