"""Glue between the agent's config and the weights scan (llmgw.agent.discovery.weights)."""

from __future__ import annotations

import threading
from pathlib import Path

from llmgw.agent.config import AgentConfig
from llmgw.agent.discovery.weights.mounts import read_mount_table
from llmgw.agent.discovery.weights.scan import FileCheckCache, carry_over_timed_out, scan_weights
from llmgw.bus import records


class WeightsScanner:
    """One scan at a time (a hung NFS mount blocks a thread; a second scan would pile up),
    with header checks cached across scans so a repeat costs one stat per file."""

    def __init__(self) -> None:
        self._cache = FileCheckCache()
        self._lock = threading.Lock()

    def __call__(
        self, cfg: AgentConfig, node: str, previous: records.Weights | None
    ) -> records.Weights:
        with self._lock:
            mounts = read_mount_table(Path(cfg.paths.procfs))  # every scan: mounts change
            scanned = scan_weights(
                [Path(d) for d in cfg.weights.dirs],
                Path(cfg.weights.fetch_dir),
                mounts,
                node,
                configured=bool(cfg.weights.dirs),
                shared_overrides=cfg.weights.shared,
                deadline_s=cfg.weights.scan_timeout,
                cache=self._cache,
            )
            return carry_over_timed_out(previous, scanned)
