"""The chaos run of bench/chaos.py, 3 minutes of it: a 3-server cluster, 2 controllers, 2
routers, 4 agents with fake engines and streamed load through both routers, under seeded
random faults (docs/reliability.md, "The chaos run"). It asserts what holds whatever the
machine's speed: every failed request explained by a fault, none sent to two engines, the
fleet whole again after every fault, no duplicate replica, no leaked engine, no key that
does not read, nothing left running. The times it reports are the bench's to judge."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_three_minute_chaos_run_explains_every_failure_and_leaves_nothing_behind(tmp_path):
    report_path = tmp_path / "chaos.json"
    done = subprocess.run(
        [sys.executable, "bench/chaos.py", "--minutes", "3", "--seed", "7"]
        + ["--report", str(report_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=840,
    )
    artifacts = os.environ.get("LLMGW_TEST_ARTIFACTS")
    if artifacts and report_path.exists():
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(report_path, Path(artifacts) / "chaos-ci.json")
    assert report_path.exists(), done.stdout[-6000:] + done.stderr[-6000:]
    report = json.loads(report_path.read_text())
    goals = report["goals"]
    assert report["ok"] > 100 and report["faults"], done.stdout[-3000:]
    assert goals["no failure unexplained"], report["unexplained"][:10]
    assert goals["no request sent to two engines"], report["sent_twice"][:10]
    never = [f for f in report["faults"] if f["ready"] is None]
    assert not never, never
    assert goals["no duplicate replica"] and goals["no leaked engine"], report["leaked"]
    assert goals["no unreadable key"], report["unreadable"]
    assert report["left_running"] == []
