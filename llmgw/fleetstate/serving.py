"""Whether a replica serves: the one rule the router's table, the read model (`llmgw
status`, the fleet page) and the autoscaler ask. Pure, no I/O.

A replica serves, and a router sends it new requests, when every one of these holds (each
a way an engine could otherwise be sent work it will not do):
- its phase is not draining, failed, gave-up or stopped (records.REPLICA_MAY_SERVE): the
  controller's `ready` is not waited for, since engines keep serving while the control
  plane is away, and the shards say it first;
- no member is on a node the controller declared lost (its replicas are placed elsewhere).
  A node declared unreachable still serves: its agent has not been heard from, but its
  engine is asked directly (an agent restarted or cut off from NATS leaves it serving), and
  each router's own health checks and retries judge the engine itself (router/probe.py,
  balancer.py). Refusing it cost every request in flight across an agent's restart;
- every member's shard, under that member's own key (`shards.<node>.<rid>`), is `ready`:
  an engine the agent restarts after a crash is not, whatever the replica's phase says;
- rank 0's endpoint (the API's) is known and is a host and a port.
Status used to count a replica ready from its phase and nodes while the router also
required its shards: after an engine crash it said 1/1 ready while the router answered 503.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from llmgw.bus import records

# node phases a replica serves on (a node no controller has judged yet has no health record)
SERVES_ON = frozenset({"ready", "unreachable"})

NotServingWhy = Literal["phase", "node", "no-shard", "shard", "no-endpoint"]


@dataclass(frozen=True, slots=True)
class NotServing:
    """Why a replica takes no requests, as data: the first rule it fails, and the node and
    phase (the replica's, the node's or the shard's) it failed on."""

    why: NotServingWhy
    node: str = ""
    phase: str = ""

    def says(self) -> str:
        """What a person reads after the replica's id: "r1 engine on a starting"."""
        if self.why == "phase":
            return self.phase
        if self.why == "node":
            return f"node {self.node} {self.phase}"
        if self.why == "no-shard":
            return f"no engine reported on {self.node} yet"
        if self.why == "shard":
            return f"engine on {self.node} {self.phase}"
        return "ready, but its endpoint is not known"


@dataclass(frozen=True, slots=True)
class Serving:
    """The verdict: `address` (host, port) of its API engine when it serves, else `why`."""

    address: tuple[str, int] | None
    why: NotServing | None

    @property
    def ok(self) -> bool:
        return self.why is None


def serving(
    replica: records.Replica,
    shards: Mapping[tuple[str, str], records.Shard],
    node_phases: Mapping[str, str],
) -> Serving:
    """The rule (module doc). `shards` by (node, rid), `node_phases` by node (a node
    without one is not judged yet: it serves)."""
    if replica.phase not in records.REPLICA_MAY_SERVE:
        return Serving(None, NotServing("phase", phase=replica.phase))
    endpoint = None
    for m in replica.members:
        phase = node_phases.get(m.node)
        if phase is not None and phase not in SERVES_ON:
            return Serving(None, NotServing("node", m.node, phase))
        shard = shards.get((m.node, replica.rid))
        if shard is None:
            return Serving(None, NotServing("no-shard", m.node))
        if shard.phase != "ready":
            return Serving(None, NotServing("shard", m.node, shard.phase))
        if m.rank == 0:
            endpoint = shard.endpoint
    address = host_port(endpoint) if endpoint else None
    if address is None:
        return Serving(None, NotServing("no-endpoint"))
    return Serving(address, None)


def host_port(endpoint: str) -> tuple[str, int] | None:
    """'10.0.0.5:18000' or '[fe80::1]:18000' -> (host, port); None if it is not one."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    port_n = int(port)
    if not 0 < port_n < 65536:
        return None
    return host.strip("[]"), port_n
