"""The agent's Prometheus metrics (`GET /metrics` with `metrics.listen` in agent.toml).

Engines by phase and their restarts are read from the shard records the agent last wrote,
when scraped (nothing is counted between scrapes); weights scans are timed as they end, and
a scan still running says for how long (a hung filer shows as a number that keeps growing).
Labels are phases and the catalog's model ids and replica ids of this node's engines: a
handful per node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from llmgw.bus import records

disable_created_metrics()  # `_created` series double the output and nobody graphs them

# a scan of local disks takes milliseconds (bench/weights_scan.py); a filer, seconds
_SCAN_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class AgentMetrics:
    def __init__(
        self,
        node: Callable[[], str | None],
        shards: Callable[[], list[records.Shard]],
        scanning: Callable[[], tuple[str, float] | None],
    ) -> None:
        """`node()` is this node's id (None before discovery), `shards()` the records of its
        engines as last written, `scanning()` the weights scan running now (its directory and
        seconds so far)."""
        self.registry = CollectorRegistry()
        self.scan_seconds = Histogram(
            "llmgw_agent_weights_scan_seconds",
            "How long a weights scan took (every configured directory and the fetch dir)",
            buckets=_SCAN_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(EngineCollector(node, shards, scanning))


class EngineCollector(Collector):
    def __init__(self, node, shards, scanning) -> None:
        self._node = node
        self._shards = shards
        self._scanning = scanning

    def collect(self) -> Iterator[GaugeMetricFamily]:
        node = self._node()
        if node is not None:
            yield _info(node)
        shards = self._shards()
        engines = GaugeMetricFamily(
            "llmgw_agent_engines",
            "Engines of this node, by the phase last reported",
            labels=["phase"],
        )
        phases = Counter(s.phase for s in shards)
        for phase in records.ShardPhase.__args__:  # type: ignore[attr-defined]
            engines.add_metric([phase], phases[phase])
        yield engines
        restarts = GaugeMetricFamily(
            "llmgw_agent_engine_restarts",
            "Times the agent restarted an engine after it exited, in its current assignment "
            "generation (from its shard record)",
            labels=["model", "replica"],
        )
        for s in sorted(shards, key=lambda s: s.rid):
            restarts.add_metric([s.model, s.rid], s.restarts)
        yield restarts
        running = self._scanning()
        yield GaugeMetricFamily(
            "llmgw_agent_weights_scan_running_seconds",
            "How long the weights scan running now has run (0: none runs)",
            value=running[1] if running else 0.0,
        )


def _info(node: str) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "llmgw_agent_node", "1, labelled with this agent's node id", labels=["node"]
    )
    family.add_metric([node], 1)
    return family
