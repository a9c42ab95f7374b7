"""Records a test writes by hand, with the fields it does not care about filled in: each
test names only what it is about (the phase, the reason, the port)."""

from __future__ import annotations

from typing import Any

from llmgw.bus import records


def shard(
    node: str,
    rid: str,
    phase: records.ShardPhase = "ready",
    *,
    model: str = "m",
    generation: int = 1,
    since: float = 1.0,
    **fields: Any,
) -> records.Shard:
    """An agent's shard record of replica `rid` on `node`."""
    return records.Shard(
        node=node,
        rid=rid,
        model=model,
        generation=generation,
        phase=phase,
        since=since,
        **fields,
    )
