"""docs/reliability.md cannot go stale silently: every cluster fault test has measured runs,
every test the fault catalogue names exists, a test of the fault suites whose name says it
injects a fault has a row, and the page is what tools/reliability_table.py renders."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CLUSTER_FAULTS = "tests/test_cluster_faults.py"
# The suites that inject faults and bad inputs, whose fault tests the catalogue describes.
FAULT_SUITES = (
    "tests/test_bus.py",
    "tests/test_tls.py",
    "tests/test_agent.py",
    "tests/test_controller.py",
    "tests/test_intent_kept.py",
    "tests/test_operations_e2e.py",
    "tests/test_partition.py",
    "tests/test_weights_*.py",
    "tests/test_router*.py",
)
# Words of a test's name that say it injects a fault or a bad input.
FAULT_WORDS = frozenset(
    "garbage garbled malformed spoof lying forged refuse refuses refused killed crash crashed "
    "crashing outage truncated stuck unreadable insane stalled bad fifo fifos untrusted "
    "unmapped hostile".split()
)
FAULT_PHRASES = re.compile(
    r"cut_off|over_the_limit|does_not_decode|any_bytes|cannot_reach|deeply_nested|not_nats|"
    r"not_a_token|stops_moving|server_restart|stays_down|takes_over|is_missing|missing_"
)
FIX = "then run `.venv/bin/python tools/reliability_table.py`"


def _tool():
    spec = importlib.util.spec_from_file_location(
        "reliability_table", REPO / "tools" / "reliability_table.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tests_in(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test_")
    ]


def _says_fault(name: str) -> bool:
    return bool(set(name.split("_")) & FAULT_WORDS) or bool(FAULT_PHRASES.search(name))


def test_every_cluster_fault_test_has_measured_runs_and_no_other_does():
    tool = _tool()
    wanted = {f"{CLUSTER_FAULTS}::{n}" for n in _tests_in(REPO / CLUSTER_FAULTS)}
    measured = {m.test for m in tool.load_measured()}
    assert wanted - measured == set(), (
        f"no measured runs for {sorted(wanted - measured)}: run them with "
        f"LLMGW_RELIABILITY_LOG=/tmp/faults.jsonl and pass --measured /tmp/faults.jsonl to "
        "tools/reliability_table.py"
    )
    assert measured - wanted == set(), (
        f"{tool.MEASURED} has runs of tests that are gone: {sorted(measured - wanted)}; "
        "remove them there, " + FIX
    )


def test_every_test_the_catalogue_names_exists_once():
    tool = _tool()
    named = [f.test for f in tool.load_faults()] + tool.load_not_faults()
    missing = []
    for test in named:
        path, _, name = test.partition("::")
        if not (REPO / path).is_file() or name not in _tests_in(REPO / path):
            missing.append(test)
    assert not missing, f"{tool.FAULTS} names tests that do not exist: {missing}; fix it, {FIX}"
    twice = sorted({t for t in named if named.count(t) > 1})
    assert not twice, f"{tool.FAULTS} names these more than once: {twice}"


def test_every_test_of_the_fault_suites_named_as_a_fault_has_a_row():
    tool = _tool()
    described = {f.test for f in tool.load_faults()} | set(tool.load_not_faults())
    paths = sorted({p for pattern in FAULT_SUITES for p in REPO.glob(pattern)})
    assert len(paths) >= 7, paths
    undescribed = [
        f"{p.relative_to(REPO)}::{name}"
        for p in paths
        for name in _tests_in(p)
        if _says_fault(name) and f"{p.relative_to(REPO)}::{name}" not in described
    ]
    assert not undescribed, (
        f"these tests read like fault tests but have no row in docs/reliability.md: "
        f"{undescribed}; describe each in {tool.FAULTS} (or list it under [not_faults]), {FIX}"
    )


def test_the_page_is_what_the_tool_renders():
    tool = _tool()
    page = (REPO / "docs" / "reliability.md").read_text(encoding="utf-8")
    assert page == tool.render(tool.load_faults(), tool.load_measured()), (
        f"docs/reliability.md is stale or edited by hand: {FIX}"
    )


def _run(test: str, writes: float | None, **fields) -> dict:
    return {
        "test": test,
        "measured_on": "2026-01-02",
        "cores": 2,
        "fault": "`docker kill`",
        "undo": "`docker start`",
        "bound_s": 30.0,
        "recovered_s": [["writes via the server hit", writes], ["agents' heartbeats", 5.0]],
        "rejoined_s": 0.4,
        "chats": 10,
        "chats_ok": 10,
        "keys": 18,
        "acked": 100,
        "replicas": 2,
        **fields,
    }


def test_a_log_replaces_the_runs_of_its_tests_and_the_page_shows_their_range(tmp_path):
    tool = _tool()
    log = tmp_path / "faults.jsonl"
    runs = [_run("t.py::test_a", 4.6), _run("t.py::test_a", 8.5), _run("t.py::test_b", None)]
    log.write_text("".join(json.dumps(r) + "\n" for r in runs))
    old = [tool.Measured(**_run("t.py::test_a", 1.0)), tool.Measured(**_run("t.py::test_c", 2))]
    merged = tool.merge(old, tool.read_log(log))
    assert [(m.test, dict(m.recovered_s)["writes via the server hit"]) for m in merged] == [
        ("t.py::test_a", 4.6),
        ("t.py::test_a", 8.5),
        ("t.py::test_b", None),
        ("t.py::test_c", 2),
    ]
    page = tool.render([], merged)
    assert "writes via the server hit: 4.6–8.5 s; agents' heartbeats: 5.0 s (2 runs)" in page
    assert "all 200 acknowledged writes read back" in page
    # a run that did not recover says so, and claims nothing about loss
    assert "writes via the server hit: none within 30 s" in page
    assert "not checked: it did not recover" in page


def test_a_log_row_with_an_unknown_field_is_refused_naming_file_and_line(tmp_path):
    tool = _tool()
    log = tmp_path / "faults.jsonl"
    log.write_text(json.dumps(_run("t.py::test_a", 1.0)) + "\n" + json.dumps(_run("x", 1, y=1)))
    with pytest.raises(tool.TableError, match=rf"{log}, line 2: .*unknown field `y`"):
        tool.read_log(log)
