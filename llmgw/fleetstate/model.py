"""The typed read model of the fleet: what `llmgw status --json` and the fleet page's
document encode, and what `llmgw status` renders as text.

Built from the one decoder layer's tables by `llmgw.fleetstate.build.fleet`, never by hand,
so every reader answers "is model X ready, and if not why" the same way. Sizes are bytes;
shown in GB (10^9 bytes, as the catalog's `gpu_memory_gb` and placement's explanations)
everywhere a person reads them. Times are unix seconds of the clock that wrote them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from llmgw.bus import records
from llmgw.fleetstate.decode import Unreadable

# a node the controller has not judged yet (no health.<node>): just registered, or no
# controller has run since
UNJUDGED = "unjudged"
NodePhase = Literal["ready", "unreachable", "lost", "unjudged"]
# the operator's intent about a node, as one state (records.NodeOps.state)
OpsState = records.NodeOpsState


class Process(msgspec.Struct, kw_only=True):
    pid: int
    name: str
    used_bytes: int | None  # None: NVML cannot tell
    own: bool  # one of llmgw's engines


class Allocation(msgspec.Struct, kw_only=True):
    """What llmgw gave a GPU to: a replica, and what its profile asked of it."""

    model: str
    replica: str
    # the profile's gpu_memory_gb, or the whole GPU when it asked none; a shared replica's:
    # its allotment (ReplicaMember.gpu_bytes)
    bytes: int
    whole: bool
    # a shared replica (share_gpus), one of several on the GPU; what its engine holds there
    # and whether that outgrew its allotment by more than the margin, as its shard record
    # says (llmgw/allotment.py; None: not said yet). An engine outgrown is not stopped.
    shared: bool = False
    used_bytes: int | None = None
    outgrown: bool = False


class GpuState(msgspec.Struct, kw_only=True):
    """One GPU. `used_bytes` (None: not reported) is the sum of the three parts after it:
    llmgw's engines, other processes (as NVML lists them), and memory no process listed
    accounts for (the driver's own, processes in another namespace)."""

    index: int
    name: str
    uuid: str
    total_bytes: int
    used_bytes: int | None
    own_bytes: int
    foreign_bytes: int
    unaccounted_bytes: int
    processes: list[Process]
    allocated: Allocation | None  # the replica given it whole (not shared)
    out_of_service: bool
    # the shared replicas on it and their allotments; what they take (an allotment, or
    # what an engine that outgrew it holds), and what one more could still be given:
    # total - allotted - others' memory - headroom (llmgw.allotment.room, placement's rule;
    # below 0 when others grew under them). None: no shared replica may go here (it is
    # given whole, or out of service).
    shared: list[Allocation] = []
    allotted_bytes: int = 0
    left_bytes: int | None = None
    # a MIG device (a GPU of its own): its profile, its parent's UUID (`index` is the
    # parent's) and its slices of the parent
    mig_profile: str = ""
    parent_uuid: str = ""
    mig_slices: int = 0


class Ops(msgspec.Struct, kw_only=True):
    """The operator's intent about a node (`ops.<node>`)."""

    state: OpsState
    cordoned: bool  # nothing new is placed there (draining included)
    drain: bool
    reason: str
    gpus_out: list[str]
    taints: list[str]
    # the newest ops.<node> does not read: what is read instead, and why (docs/bucket.md)
    unreadable: str = ""


class Engine(msgspec.Struct, kw_only=True):
    name: str
    version: str


class NodeState(msgspec.Struct, kw_only=True):
    id: str
    inventory: bool  # False: only the operator's ops.<node> names it (yet, or any more)
    hostname: str = ""
    address: str = ""
    phase: NodePhase = UNJUDGED
    phase_since: float | None = None  # when the controller recorded the phase
    phase_reason: str = ""
    heartbeat_at: float | None = None  # the agent's clock
    ram_total_bytes: int = 0
    ram_available_bytes: int = 0
    cpu_count: int = 0
    cpu_model: str = ""
    gpu_status: str = ""
    gpu_detail: str = ""
    gpus: list[GpuState] = []
    gpus_free: int = 0  # neither allocated, nor shared, nor out of service
    engines: list[Engine] = []
    ib: list[str] = []  # "mlx5_0:ib-a up"
    weights: str = ""  # "2 model(s) in /models", or why none are looked for
    from_config: list[str] = []
    labels: dict[str, list[str]] = {}  # what node selectors may ask for
    taints: list[str] = []  # "name (agent)", "name (operator)"
    running: list[str] = []  # "<model> <rid> <shard phase>"
    ops: Ops | None = None
    # the agent's /metrics endpoint could not serve (a port taken): the node still serves
    metrics_error: str | None = None
    fabric: str = ""  # the fabric it is shown under ("": on none)


class Member(msgspec.Struct, kw_only=True):
    node: str
    rank: int
    node_phase: NodePhase
    node_since: float | None = None


class ShardState(msgspec.Struct, kw_only=True):
    node: str
    phase: str
    reason: str = ""
    restarts: int = 0
    gave_up: bool = False
    output_tail: list[str] = []
    # a shared engine: what it holds on its GPU, what it was given, and whether it outgrew
    # that by more than the margin (records.Shard; it is not stopped for it)
    gpu_used_bytes: int | None = None
    gpu_allotted_bytes: int = 0
    gpu_outgrown: bool = False


class ReplicaState(msgspec.Struct, kw_only=True):
    rid: str
    profile: str
    phase: str  # the controller's (records.ReplicaPhase)
    endpoint: str | None
    nodes: list[str]
    members: list[Member]
    shards: list[ShardState]
    # what a router sends requests to: the one rule, llmgw/fleetstate/serving.py
    serving: bool
    # the replica's phase, and why it does not serve when it does not: "ready, node n1
    # unreachable for 20 s", "ready, engine on n1 starting" (its agent restarts it)
    state: str
    why: str = ""  # going away: why
    failure: str = ""  # failed: the failed shard's node, reason and restarts
    # what its engine (rank 0's) said of its own load at its node's last heartbeats
    load: records.EngineLoad | None = None


class Placement(msgspec.Struct, kw_only=True):
    """The controller's latest decision for a model (`placement.<model>`)."""

    desired: int
    placed: int
    unplaced: int
    waiting: int
    judged: int
    blocked: str
    frozen: bool  # nothing placed or removed until the model's intent reads again
    explanation: str
    refused: list[records.RefusedNodes]
    decided_at: float


class ModelState(msgspec.Struct, kw_only=True):
    """One model: what is asked, what serves, and why not."""

    id: str
    served_name: str
    in_catalog: bool
    mode: Literal["fixed", "autoscaled"]
    desired: int  # the count asked for (the autoscaler's, for an autoscaled model)
    ready: int  # replicas serving (ready, on nodes that are ready)
    serving: list[str]  # the nodes they serve on
    # "" when `ready` >= `desired`; else the first reasons a person needs
    why_not: str
    replicas: list[ReplicaState]
    placement: Placement | None = None
    rollout: records.Rollout | None = None
    autoscale: records.Scale | None = None
    unreadable: list[str] = []  # this model's keys whose newest value does not read


class Skipped(msgspec.Struct, kw_only=True):
    values: int  # values left out, not decoding or not believed
    keys: list[str]  # the first of their keys


class Fleet(msgspec.Struct, kw_only=True):
    """The whole read model: `llmgw status --json` is this, encoded."""

    bucket: str
    now: float
    models: dict[str, ModelState]  # by catalog id, sorted
    nodes: dict[str, NodeState]  # by node id, sorted
    fabrics: dict[str, records.FabricHoldings]
    unreadable: list[Unreadable]  # every key whose newest value does not read
    skipped: Skipped
