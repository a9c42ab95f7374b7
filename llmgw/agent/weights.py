"""Glue between the agent's config and the weights scan (llmgw.agent.discovery.weights)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from llmgw.agent.config import AgentConfig
from llmgw.agent.discovery.weights.mounts import read_mount_table
from llmgw.agent.discovery.weights.scan import FileCheckCache, carry_over_timed_out, scan_weights
from llmgw.bus import records


class WeightsScanner:
    """One scan at a time (a hung NFS mount blocks a thread; a second scan would pile up),
    with header checks cached across scans so a repeat costs one stat per file. While a scan
    runs, `scanning()` says which weights directory it is in and for how long, so a scan
    stuck inside a filer can be reported without waiting for it."""

    def __init__(
        self, scan: Callable[..., records.Weights] = scan_weights, clock=time.monotonic
    ) -> None:
        self._scan = scan
        self._clock = clock
        self._cache = FileCheckCache()
        self._lock = threading.Lock()
        self._turn: tuple[Path, float] | None = None  # directory, when its turn began

    def scanning(self) -> tuple[str, float] | None:
        """(weights directory, seconds since the scan reached it) while a scan runs."""
        turn = self._turn
        return None if turn is None else (str(turn[0]), self._clock() - turn[1])

    def _on_dir(self, directory: Path) -> None:
        self._turn = (directory, self._clock())

    def __call__(
        self, cfg: AgentConfig, node: str, previous: records.Weights | None
    ) -> records.Weights:
        with self._lock:
            first = cfg.weights.dirs[0] if cfg.weights.dirs else cfg.weights.fetch_dir
            self._turn = (Path(first), self._clock())
            try:
                mounts = read_mount_table(Path(cfg.paths.procfs))  # every scan: mounts change
                scanned = self._scan(
                    [Path(d) for d in cfg.weights.dirs],
                    Path(cfg.weights.fetch_dir),
                    mounts,
                    node,
                    configured=bool(cfg.weights.dirs),
                    shared_overrides=cfg.weights.shared,
                    deadline_s=cfg.weights.scan_timeout,
                    cache=self._cache,
                    on_dir=self._on_dir,
                )
            finally:
                self._turn = None
            return carry_over_timed_out(previous, scanned)


def stuck_scan(previous: records.Weights, directory: str, seconds: float) -> records.Weights:
    """What was last known, with `directory` marked as the place a scan has been stuck for
    `seconds` (a hung filer blocks inside one file operation, where no deadline reaches)."""
    stuck = records.WeightsDir(
        path=directory, status="timeout", detail=f"scan of {directory} running for {seconds:.0f} s"
    )
    dirs = [d for d in previous.dirs if d.path != directory]
    at = next((i for i, d in enumerate(previous.dirs) if d.path == directory), len(dirs))
    return msgspec.structs.replace(previous, dirs=[*dirs[:at], stuck, *dirs[at:]])
