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


def test_controller_unit_verifies_and_serves_metrics_on_the_documented_port(tmp_path: Path):
    from llmgw.metrics_http import CONTROLLER_PORT

    text = _verify(DEPLOY / "llmgw-controller.service", "/opt/llmgw/bin/llmgw", tmp_path)
    assert f"--metrics-listen 0.0.0.0:{CONTROLLER_PORT}" in text


def test_prometheus_example_scrapes_every_component_on_its_documented_port():
    from llmgw.metrics_http import AGENT_PORT, CONTROLLER_PORT

    text = (DEPLOY / "prometheus.yml").read_text()
    for job, port in (("llmgw-agent", AGENT_PORT), ("llmgw-controller", CONTROLLER_PORT)):
        assert f"job_name: {job}" in text and f":{port}" in text
    assert "job_name: llmgw-router" in text and ":8080" in text


def test_grafana_dashboard_queries_only_series_the_components_export():
    import json
    import re

    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    documented = (Path(__file__).parent.parent / "docs" / "metrics.md").read_text()
    for expr in exprs:
        for name in re.findall(r"llmgw_[a-z_]+", expr):
            base = re.sub(r"_(bucket|sum|count|total)$", "", name)
            assert f"`{base}" in documented, f"{name} in the dashboard is not in docs/metrics.md"
