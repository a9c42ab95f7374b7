"""Port moves: a replica whose engine could not start because another program took its
port after placement is given another port, not left failed.

Placement never assigns a port an agent reports taken, but a program can start listening
between placement and launch. The agent then refuses the launch and says why in its shard
record (`refused` PORT_IN_USE, with the `port` it was given); the controller, which alone
writes replicas and assignments, gives that member the next free port above it and
rewrites the replica, and the assignment derived from it follows. The shard's port is
compared with the member's, so a refusal already answered moves nothing twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from llmgw.bus.records import PORT_IN_USE, REPLICA_GOING, Replica, ReplicaMember
from llmgw.controller.placement.nodes import NodeState
from llmgw.controller.placement.snapshot import Snapshot


@dataclass(frozen=True, slots=True)
class PortMove:
    replica: Replica  # as rewritten, its reason saying why
    why: str  # "port 18000 on node05 was taken by another program, moved to 18001"


_MOVED = " (port moved: "  # the latest move is said after the reason it was placed for


def move_taken_ports(snapshot: Snapshot, nodes: dict[str, NodeState]) -> list[PortMove]:
    """Every member whose shard was refused its port because another program holds it,
    given the next free port on its node (which is then used). A member with no free port
    left stays as it is: its agent tries the port again, with a growing delay."""
    moves: list[PortMove] = []
    for replica in sorted(snapshot.replicas, key=lambda r: r.rid):
        if replica.phase in REPLICA_GOING:
            continue
        members = list(replica.members)
        moved: list[tuple[str, int, int]] = []
        for i, m in enumerate(members):
            shard = snapshot.shards.get((m.node, replica.rid))
            node = nodes.get(m.node)
            if shard is None or node is None or not _refused_for(shard.refused, shard.port, m):
                continue
            new = node.free_port_after(m.port, *snapshot.port_range)
            if new is None:
                continue
            node.used_ports.add(new)
            members[i] = msgspec.structs.replace(m, port=new)
            moved.append((m.node, m.port, new))
        if not moved:
            continue
        why = "; ".join(
            f"port {old} on {node} was taken by another program, moved to {new}"
            for node, old, new in moved
        )
        placed_for = replica.reason.split(_MOVED)[0]
        reason = f"{placed_for}{_MOVED}{why})" if placed_for else f"port moved: {why}"
        moves.append(
            PortMove(msgspec.structs.replace(replica, members=members, reason=reason), why)
        )
    return moves


def _refused_for(refused: str, port: int, member: ReplicaMember) -> bool:
    return refused == PORT_IN_USE and port == member.port != 0
