"""docs/bucket.md documents every field of every record stored in the bucket."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from llmgw.bus import records

DOC = (Path(__file__).parent.parent / "docs" / "bucket.md").read_text()

STORED = [
    records.NodeInventory,
    records.Cpu,
    records.Memory,
    records.Gpus,
    records.Gpu,
    records.GpuProcess,
    records.GpuErrors,
    records.PortsTaken,
    records.IbAdapter,
    records.IbPort,
    records.EngineInstall,
    records.Weights,
    records.WeightsDir,
    records.HeldModel,
    records.HeldAdapter,
    records.IncompleteModel,
    records.Store,
    records.Lease,
    records.Health,
    records.Desired,
    records.Replica,
    records.ReplicaMember,
    records.Assignment,
    records.LoraRoom,
    records.AdapterAssigned,
    records.Shard,
    records.AdapterFailure,
    records.FabricHoldings,
    records.FabricModel,
    records.ModelCopy,
    records.PlacementRecord,
    records.RefusedNodes,
    records.GpuNamed,
    records.Failure,
    records.NodeOps,
    records.Rollout,
    records.Revision,
    records.ProfileRevision,
    records.Leader,
    records.Event,
    records.Scale,
    records.RouterLoad,
    records.ModelLoad,
    records.ApiKey,
    records.SecretHash,
    records.Limits,
    records.Team,
    records.AuditRecord,
]


def _documented(name: str) -> bool:
    # `name`, `name[]`, `parent.name` or `parent.name[]`
    return re.search(rf"`(?:[\w.\[\]]+\.)?{name}(?:\[\])?`", DOC) is not None


@pytest.mark.parametrize("struct", STORED, ids=lambda s: s.__name__)
def test_every_record_field_is_documented_in_bucket_md(struct) -> None:
    missing = [f.name for f in msgspec.structs.fields(struct) if not _documented(f.name)]
    assert not missing, f"docs/bucket.md does not mention {struct.__name__} fields {missing}"


def test_agent_md_example_is_a_valid_config_naming_every_key() -> None:
    from llmgw.agent import config

    text = (Path(__file__).parent.parent / "docs" / "agent.md").read_text()
    example = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    parsed = config.parse_config(example)  # refused (with the key) if the docs drift
    for section, struct in (
        ("nats", config.Nats),
        ("node", config.Node),
        ("weights", config.Weights),
        ("intervals", config.Intervals),
        ("engines", config.Engines),
        ("paths", config.Paths),
        ("metrics", config.Metrics),
    ):
        missing = [
            f.name
            for f in msgspec.structs.fields(struct)
            if not re.search(rf"^{f.name} = ", example.split(f"[{section}]")[1], re.M)
        ]
        assert not missing, f"docs/agent.md [{section}] does not show {missing}"
    assert parsed.fabrics
