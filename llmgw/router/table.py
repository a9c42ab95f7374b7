"""Which engines serve which model: the router's endpoint table. Pure, no I/O.

Fed the bucket's records (`catalog.*`, `replicas.*.*`, `shards.*.*`, `health.*`,
`placement.*`, and for autoscaled models `desired.*` and `scale.*`) as they change, or a catalog file's static endpoints for a router-only run,
it answers `route(served_name)`: the model, its engines that may take a new request, and
why there are none when there are none.

An engine takes new requests when its replica serves: the one rule, which `llmgw status`,
the fleet page and the autoscaler ask too, is `llmgw.fleetstate.serving` (its phase not
going away, no member on a node declared unreachable or lost, every member's shard ready
under its own key, rank 0's endpoint known). The controller's own `ready` is not waited
for: engines keep serving while the control plane is away, and so does the router.

Owners come from keys, never from values: `shards.node05.r1` is node05's shard of r1
whatever its body says. Values are decoded by the one decoder layer
(llmgw/fleetstate/decode.py): one that does not read is logged; the last good value of a
family an operator or the controller writes (catalog, replicas, health, desired, ...) is
kept (their engines still run), a garbled shard counts as absent.
"""

from __future__ import annotations

import hashlib
import logging
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from llmgw import catalog
from llmgw.bus import keys, records
from llmgw.fleetstate.decode import FleetRecords
from llmgw.fleetstate.serving import serving
from llmgw.router.upstream import authority

log = logging.getLogger(__name__)

# the families the table keeps (what `route` reads)
ROUTED_FAMILIES = frozenset(
    {
        keys.CATALOG,
        keys.REPLICAS,
        keys.SHARDS,
        keys.HEALTH,
        keys.PLACEMENT,
        keys.DESIRED,
        keys.SCALE,
    }
)


def stable_hash(data: bytes) -> int:
    """A 64-bit hash that is the same in every process (Python's hash() is not): routers
    that never talk must still agree where a prefix goes."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass(eq=False)
class Backend:
    """One engine the router sends requests to: a replica's API endpoint, or a static URL.
    Its balancing state lives here and survives every rebuild of the table."""

    id: str  # the replica id, or the static URL: the same on every router
    model: str
    host: str
    port: int
    tls: bool = False
    path_prefix: str = ""  # a static endpoint's base path ("http://h:8000/api" -> "/api")
    # the `authorization: Bearer ...` line this engine takes, if any: the fleet's key for a
    # placed replica, its own model's key file for a static endpoint (never the fleet's)
    auth: bytes = b""
    routable: bool = True  # the table's verdict: ready, current, not on a lost node
    in_flight: int = 0
    failures: int = 0  # consecutive
    ejections: int = 0  # how often in a row it was ejected: the next ejection lasts longer
    ejected_until: float = 0.0
    probe_ok: bool = True  # the engine's own /health, probed in the background
    # what it can take at once: its profile's parallel slots (llama-server -np, vLLM
    # --max-num-seqs), and what the engine itself says (router/report.py), which wins
    capacity: int | None = None
    reported: int | None = None
    # this router's part of it (router/flow.py): requests it may have there at once; None:
    # no bound known, every request goes straight to the engine
    share: int | None = None
    id_hash: int = field(init=False)
    host_header: bytes = field(init=False)

    def __post_init__(self) -> None:
        self.id_hash = stable_hash(self.id.encode())
        self.host_header = self.address.encode()

    @property
    def address(self) -> str:
        """host:port, as the Host header says it ([v6]:port)."""
        return authority(self.host, self.port)

    def available(self, now: float) -> bool:
        """Takes new requests: routable, not ejected, and its /health answers."""
        return self.routable and self.probe_ok and now >= self.ejected_until

    @property
    def slots(self) -> int | None:
        """What it can take at once, as best known (None: not known)."""
        return self.reported if self.reported is not None else self.capacity

    @property
    def room(self) -> bool:
        """This router may send it one more request now."""
        return self.share is None or self.in_flight < self.share


@dataclass
class Route:
    model: str  # catalog id
    served_name: str
    backends: list[Backend]  # routable ones
    why_none: str = ""  # filled when `backends` is empty


def bearer(key: str | None) -> bytes:
    """The header line that sends `key` to an engine ("" without one)."""
    return b"authorization: Bearer %s\r\n" % key.encode() if key else b""


class EndpointTable:
    def __init__(
        self,
        engine_key: str | None = None,
        static_key: Callable[[catalog.Model], str | None] = lambda model: None,
    ) -> None:
        self._fleet_auth = bearer(engine_key)  # for the fleet's own engines only
        self._static_key = static_key
        # the one decoder layer (llmgw/fleetstate/decode.py): the families routing reads,
        # typed, with the last good catalog entry, replica, placement... kept
        self.records = FleetRecords(families=ROUTED_FAMILIES)
        self.skipped = self.records.skipped
        self.models: dict[str, catalog.Model] = self.records.catalog
        self.replicas: dict[tuple[str, str], records.Replica] = {}  # (model, rid)
        self.shards: dict[tuple[str, str], records.Shard] = self.records.shards  # (node, rid)
        self.health: dict[str, str] = {}  # node -> phase
        self.placements: dict[str, records.PlacementRecord] = self.records.placements
        # autoscaled models (router/hold.py): `desired.<model>` says auto, `scale.<model>`
        # how long its last replica took to load
        self.desired: dict[str, records.Desired] = self.records.desired
        self.scales: dict[str, records.Scale] = self.records.scales
        self.synced = True  # False until a bucket follower has read the bucket once
        self._backends: dict[str, Backend] = {}
        self._routes: dict[str, Route] = {}
        self._dirty = True
        self._ambiguous_logged: set[str] = set()

    # --- feeding it ---------------------------------------------------------------------

    def apply(self, key: str, data: bytes | None, revision: int = 0) -> None:
        """One bucket change: `data` None means the key is gone."""
        family = self.records.apply(key, data, revision)
        if family == keys.REPLICAS:
            model, rid = key.split(".")[1:]
            _put(self.replicas, (model, rid), self.records.replicas.get(rid))
        elif family == keys.HEALTH:
            node = key.split(".")[1]
            h = self.records.health.get(node)
            _put(self.health, node, None if h is None else h.phase)
        if family is not None:
            self._dirty = True

    def set_static(self, models: list[catalog.Model]) -> None:
        """A router-only run: models with `endpoints` from a catalog file, no bucket."""
        self.models.clear()
        self.models.update((m.id, m) for m in models)
        self._dirty = True

    # --- asking it ----------------------------------------------------------------------

    def route(self, served_name: str) -> Route | None:
        """The model clients call `served_name`; None if no model is called that."""
        if self._dirty:
            self.rebuild()
        return self._routes.get(served_name)

    def context(self, model_id: str) -> int | None:
        """The most one request to `model_id` may hold, prompt and answers (the largest
        `context` of its profiles); None when a profile leaves it to the engine or the model
        runs from fixed endpoints."""
        model = self.models.get(model_id)
        if model is None or not model.profiles:
            return None
        contexts = [p.context for p in model.profiles]
        return None if None in contexts else max(c for c in contexts if c is not None)

    def served_names(self) -> list[str]:
        """Names with an engine to send to (what /v1/models lists)."""
        if self._dirty:
            self.rebuild()
        return sorted(n for n, r in self._routes.items() if r.backends)

    def autoscaled(self, model_id: str) -> bool:
        """Whether `model_id`'s count follows its load: a request for it while no replica
        is ready is held (router/hold.py) instead of refused."""
        desired = self.desired.get(model_id)
        model = self.models.get(model_id)
        return (
            desired is not None
            and desired.auto
            and model is not None
            and model.autoscale is not None
        )

    def hold_bounds(self, model_id: str) -> tuple[int, float]:
        """The model's own hold bounds from its autoscale policy: (requests, seconds), 0
        where it leaves them to the router's settings."""
        model = self.models.get(model_id)
        policy = model.autoscale if model is not None else None
        return (policy.hold_max, policy.hold_timeout) if policy is not None else (0, 0.0)

    def load_seconds(self, model_id: str) -> float:
        """How long the model's last replica took from placed to ready; 0: not measured."""
        scale = self.scales.get(model_id)
        return scale.load_s if scale is not None else 0.0

    def cold_names(self) -> list[str]:
        """Autoscaled models with no engine to send to: listed by /v1/models as cold."""
        if self._dirty:
            self.rebuild()
        return sorted(
            n for n, r in self._routes.items() if not r.backends and self.autoscaled(r.model)
        )

    def known_names(self) -> list[str]:
        if self._dirty:
            self.rebuild()
        return sorted(self._routes)

    def backends(self) -> list[Backend]:
        """Every engine the table knows, routable or not (what the prober checks)."""
        if self._dirty:
            self.rebuild()
        return list(self._backends.values())

    def rebuild(self) -> None:
        self._dirty = False
        routes: dict[str, Route] = {}
        seen: dict[str, Backend] = {}
        for model_id in sorted(self.models):
            model = self.models[model_id]
            if model.served_name in routes:
                if model.served_name not in self._ambiguous_logged:
                    self._ambiguous_logged.add(model.served_name)
                    log.warning(
                        "router: served name %r belongs to models %s and %s; requests go to %s",
                        model.served_name,
                        routes[model.served_name].model,
                        model_id,
                        routes[model.served_name].model,
                    )
                continue
            if model.endpoints:
                backends = [self._static(model, url, seen) for url in model.endpoints]
                routes[model.served_name] = Route(model_id, model.served_name, backends)
                continue
            backends, notes = [], []
            for (mid, rid), replica in sorted(self.replicas.items()):
                if mid != model_id:
                    continue
                b, why = self._placed(replica, seen)
                if b is not None:
                    backends.append(b)
                else:
                    notes.append(f"{rid} {why}")
            route = Route(model_id, model.served_name, backends)
            if not backends:
                route.why_none = self._why_none(model_id, notes)
            routes[model.served_name] = route
        for gone in set(self._backends) - set(seen):
            self._backends[gone].routable = False  # in-flight requests still finish
        self._backends = seen
        self._routes = routes

    # --- internals ------------------------------------------------------------------------

    def _backend(self, seen: dict[str, Backend], new: Backend) -> Backend:
        """The Backend already known under this id (keeping its in-flight count and health),
        unless it now points elsewhere."""
        old = self._backends.get(new.id)
        b = old if old is not None and _same_place(old, new) else new
        b.capacity = new.capacity  # the profile's, which a catalog change may change
        b.routable = True
        seen[b.id] = b
        return b

    def _static(self, model: catalog.Model, url: str, seen: dict[str, Backend]) -> Backend:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        new = Backend(
            url,
            model.id,
            parts.hostname or "",
            port,
            tls=tls,
            path_prefix=parts.path.rstrip("/"),
            auth=bearer(self._static_key(model)),
        )
        return self._backend(seen, new)

    def _placed(
        self, replica: records.Replica, seen: dict[str, Backend]
    ) -> tuple[Backend | None, str]:
        """The replica's API engine if it serves (llmgw/fleetstate/serving.py), else why not."""
        verdict = serving(replica, self.shards, self.health)
        if verdict.address is None:
            return None, verdict.why.says() if verdict.why else ""
        backend = Backend(
            replica.rid,
            replica.model,
            *verdict.address,
            auth=self._fleet_auth,
            capacity=self._parallel(replica),
        )
        return self._backend(seen, backend), ""

    def _parallel(self, replica: records.Replica) -> int | None:
        """The parallel slots of the profile the replica was placed with (None: not said)."""
        model = self.models.get(replica.model)
        profile = model.profile(replica.profile) if model is not None else None
        return profile.parallel if profile is not None else None

    def _why_none(self, model_id: str, notes: list[str]) -> str:
        placed = self.placements.get(model_id)
        parts = []
        if notes:
            parts.append(f"{len(notes)} replica(s), none ready: " + "; ".join(notes[:5]))
        if placed is not None and placed.explanation:
            parts.append(placed.explanation)
        if not parts:
            if placed is None or placed.desired == 0:
                parts.append(
                    f"no replica is placed: `llmgw place {model_id} --replicas N` asks for some"
                )
            else:
                parts.append(f"{placed.placed}/{placed.desired} replica(s) placed, none ready yet")
        if not self.synced:
            parts.insert(0, "the router has not read the fleet's state from NATS yet")
        return "; ".join(parts)


# what makes two Backends the same engine (the rest is balancing state)
_place = operator.attrgetter("model", "host", "port", "tls", "path_prefix", "auth")


def _same_place(a: Backend, b: Backend) -> bool:
    return _place(a) == _place(b)


def _put(table: dict, k, value) -> None:
    if value is None:
        table.pop(k, None)
    else:
        table[k] = value
