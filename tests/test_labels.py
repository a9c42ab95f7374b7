"""Node labels and taints: what a node's inventory says of it, what its agent config adds,
and how a profile's selector and tolerations read them (llmgw/labels.py)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from llmgw import labels
from llmgw.bus import records
from llmgw.sim.bare import inventory


def test_discovered_labels_come_from_the_inventory_alone():
    inv = inventory("n1", gpus=2, fabrics=["ib-a", "ib-b"], engines=("vllm", "llama-server"))
    inv.engines[0].version = "0.11.2"
    inv.engines[1].version = "9439 (47f6423ed)"
    got = labels.discovered_labels(inv)
    assert got == {
        "node": {"n1"},
        "gpu.count": {"2"},
        "gpu.model": {"H100-80GB-HBM3"},
        "fabric": {"ib-a", "ib-b"},
        "engine": {"vllm", "llama-server"},
        "vllm.version": {"0.11.2"},
        "llama-server.version": {"9439"},
    }


def test_a_selector_value_matches_any_of_a_labels_values_and_bang_excludes():
    node = labels.node_labels(inventory("n1", fabrics=["ib-a", "ib-b"]))
    assert labels.unmatched({"fabric": "ib-b"}, node) is None
    assert labels.unmatched({"fabric": "ib-c"}, node) == ("fabric", "ib-c", False)
    assert labels.unmatched({"node": "!n2", "pool": "!x"}, node) is None  # absent: not x
    assert labels.unmatched({"node": "!n1"}, node) == ("node", "n1", True)
    assert labels.untolerated(frozenset({"b", "a"}), ["a"]) == "b"
    assert labels.untolerated(frozenset({"a"}), ["a"]) is None


def test_the_agent_config_labels_and_taints_reach_the_inventory_and_are_checked(tmp_path):
    from llmgw.agent.config import ConfigError, parse_config

    cfg = parse_config(
        '[node]\ngpus = false\nlabels = { rack = "r12", pool = "research" }\n'
        'taints = ["gpu-flaky"]\n[paths]\nllama_search_dirs = []\n'
    )
    assert cfg.node.labels == {"rack": "r12", "pool": "research"}
    assert {"node.labels", "node.taints"} <= set(cfg.overrides())
    with pytest.raises(ConfigError, match=r"key 'node.labels.rack id': 'rack id' is not a label"):
        parse_config('[node]\nlabels = { "rack id" = "r12" }\n', Path("/etc/llmgw/agent.toml"))
    with pytest.raises(ConfigError, match=r"key 'node.taints': 'a b' is not a label name"):
        parse_config('[node]\ntaints = ["a b"]\n')

    from llmgw.agent.inventory import Identity, discover

    inv = discover(cfg, Identity(node="n1", hostname="n1", address="127.0.0.1"), 0.0)
    assert (inv.labels, inv.taints) == ({"rack": "r12", "pool": "research"}, ["gpu-flaky"])
    configured = labels.node_labels(msgspec.structs.replace(inv, labels={"node": "alias"}))
    assert configured["node"] == {"alias"}  # what is written wins


def test_a_node_ops_record_names_its_node_and_asks_for_nothing_by_default():
    assert not records.NodeOps(node="n1").unschedulable
    assert records.NodeOps(node="n1", state="draining").unschedulable
