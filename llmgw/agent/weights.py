"""Glue between the agent's config and the weights scan (llmgw.agent.discovery.weights)."""

from __future__ import annotations

from llmgw.agent.config import AgentConfig
from llmgw.bus import records


def scan_node_weights(
    cfg: AgentConfig, node: str, previous: records.Weights | None
) -> records.Weights:
    return records.Weights()  # wired to the scan when it lands
