"""A shared engine against its allotment: what it holds on its GPU, as NVML says, and
whether it has outgrown what it was given by more than the margin.

Placement gives a shared replica `gpu_memory_gb` of one GPU (its member's `gpu_bytes`) and
the adapters size the engine to it (docs/engines.md), but an engine can still grow past it
(llama-server's compute buffers at a larger batch, a vLLM whose CUDA graphs take more than
profiled). Its neighbours on the GPU then find less than they were promised. What it holds
is the memory NVML lists for the processes of its group (`GpuProcess.engine`, which is the
shard's `pid`): vLLM's workers, not its leader, hold the memory.

An engine over its allotment is named (its shard record's `gpu_outgrown`, written by its
agent with `held_to_allotment`; `outgrown` from the bucket), never stopped: stopping it
would drop the requests it serves, and memory it took is given back only by a restart the
operator chooses (a smaller context, or a larger gpu_memory_gb).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec

from llmgw.bus.records import Gpu, NodeInventory, Replica, Shard

GB = 1_000_000_000
# An engine is over when it holds more than its allotment plus this: a tenth of it, and at
# least 1 GB (the CUDA context and allocator rounding move by hundreds of MB)
MARGIN_FRACTION = 0.10
MARGIN_MIN_BYTES = GB
# What a shared GPU keeps free beside the allotments: the driver's own reservation (0.55 GB
# on an idle H100) and room for the allocator's rounding. Each engine's CUDA context is
# inside its allotment (the adapters size the engine to fit: docs/engines.md).
SHARE_HEADROOM = GB


def margin(allotted: int) -> int:
    return max(int(allotted * MARGIN_FRACTION), MARGIN_MIN_BYTES)


def is_over(used: int, allotted: int) -> bool:
    """Whether an engine holding `used` bytes has outgrown an allotment of `allotted`."""
    return used > allotted + margin(allotted)


def taken(allotted: int, used: int | None) -> int:
    """What a shared replica takes of its GPU: its allotment, or what its engine holds when
    it outgrew that (its shard record's `gpu_used_bytes`): its neighbours lose that much."""
    return max(allotted, used or 0)


def room(total: int, allotted: int, held: int) -> int:
    """Bytes one more shared replica could be given on a GPU of `total` bytes: less what
    llmgw allotted there (`taken`, summed), what other programs hold (NVML) and
    SHARE_HEADROOM. Placement's rule (controller/placement/nodes.py) and what `llmgw
    status`, the page and the metrics call "left"; below 0 when others grew under them."""
    return total - allotted - held - SHARE_HEADROOM


def engine_bytes(gpu: Gpu, engine_pid: int) -> int:
    """What the engine whose group is `engine_pid` holds on `gpu`, as NVML lists it."""
    return sum(p.used_bytes or 0 for p in gpu.processes if p.engine == engine_pid)


@dataclass(frozen=True, slots=True)
class Outgrown:
    """A shared engine holding more of its GPU than it was given, beyond the margin."""

    node: str
    rid: str
    model: str
    pid: int
    gpu: str  # UUID
    used_bytes: int
    allotted_bytes: int

    def text(self) -> str:
        return (
            f"{self.model} {self.rid} on {self.node}: engine pid {self.pid} holds "
            f"{self.used_bytes / GB:.1f} GB of GPU {self.gpu}, given "
            f"{self.allotted_bytes / GB:g} GB (margin {margin(self.allotted_bytes) / GB:.1f} "
            "GB); not stopped"
        )


def outgrown(
    inventories: Mapping[str, NodeInventory],
    replicas: Iterable[Replica],
    shards: Mapping[tuple[str, str], Shard],
) -> list[Outgrown]:
    """Every running shared engine over its allotment, from the bucket's records alone:
    the replica's allotment, the shard's engine pid, the node's GPU processes."""
    out = []
    for replica in replicas:
        for member in replica.members:
            if not member.gpu_bytes:
                continue
            shard = shards.get((member.node, replica.rid))
            inv = inventories.get(member.node)
            if shard is None or shard.pid is None or inv is None:
                continue
            for gpu in inv.gpus.devices:
                if gpu.uuid not in member.gpus:
                    continue
                used = engine_bytes(gpu, shard.pid)
                if is_over(used, member.gpu_bytes):
                    out.append(
                        Outgrown(
                            member.node,
                            replica.rid,
                            replica.model,
                            shard.pid,
                            gpu.uuid,
                            used,
                            member.gpu_bytes,
                        )
                    )
    return out


def held_to_allotment(shard: Shard, gpu: Gpu, allotted: int) -> Shard | None:
    """`shard` with what its engine holds on `gpu` against `allotted`, or None when its
    record says that already: the used memory within a GB of what it says, and the same
    verdict. Memory merely drifting does not rewrite the record."""
    if shard.pid is None:
        return None
    used = engine_bytes(gpu, shard.pid)
    over = is_over(used, allotted)
    said = shard.gpu_used_bytes
    if said is not None and abs(said - used) < GB and over == shard.gpu_outgrown:
        if shard.gpu_allotted_bytes == allotted:
            return None
    return msgspec.structs.replace(
        shard, gpu_used_bytes=used, gpu_allotted_bytes=allotted, gpu_outgrown=over
    )
