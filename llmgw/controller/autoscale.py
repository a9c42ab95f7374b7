"""The autoscaler: how many replicas a model asks for, from the load its routers see. Pure,
no I/O, time passed in.

Each router writes its own load per model in `load.<router>` (in flight, held for a
replica, requests started, time to first token). The leader sums the routers whose key
still moves (`LoadSum`; a router that stopped writing is gone and so is its load: it is
never counted twice, since every router counts only what it sent), and for each model
that `desired.<model>` says is autoscaled, `Scaler.step` turns the summed load into a
count, as the catalog's `autoscale` policy says:

- wanted = what is in flight and waiting, over `target_in_flight` per replica (plus one
  while the slowest first token is over `ttft_target_ms`, or while the engines themselves
  say they are saturated: more than `engine_queue_per_replica` requests queued in them per
  replica, or the fullest one's KV cache above `kv_cache_full`; `EngineSaturation`, from
  the engines' /metrics on their nodes' heartbeats), within min..max_replicas;
- up, when every sample of the last `scale_up_after` seconds wanted more (the stable
  window), or at once when the load wants twice the replicas there are (the panic
  window: a burst is answered within a pass, as Knative's 200% panic threshold does);
- down, only when every sample of the last `scale_down_after` seconds wanted fewer, and
  the count has not changed for that long: at steady load it changes at most once per
  window, and a replica removed drains first (placement's own removal);
- to zero after `idle_unload_after` seconds without a request, and back from zero at once
  when a router holds a request for it (a cold start).

Every change comes with its figures: "3 -> 5: 14 in flight over 3 replicas, target 2, for
30 s". A controller that takes over starts from the count the previous leader wrote, with
empty windows: it places nothing beyond that count until its own windows have filled.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from llmgw.bus import records
from llmgw.catalog import Autoscale
from llmgw.fleetstate.serving import serving

# a router whose load key has not moved for this long is gone (it writes every second)
LOAD_STALE_AFTER_S = 5.0
# panic: the load asks for this many times the replicas there are
PANIC_RATIO = 2.0


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """One model's load, summed over the routers whose load is current."""

    in_flight: float = 0.0
    waiting: int = 0
    ttft_ms: float = 0.0  # the slowest router's
    routers: int = 0  # routers that reported this model
    active: bool = False  # a request was seen since the last sum (or is in flight now)
    engines: EngineSaturation = field(default_factory=lambda: EngineSaturation())


@dataclass(frozen=True, slots=True)
class EngineSaturation:
    """What a model's ready engines say of themselves (records.EngineLoad on their nodes'
    leases), summed: requests queued inside them, and the fullest KV cache."""

    engines: int = 0  # engines that reported
    waiting: int = 0
    kv_cache: float = 0.0


def engine_saturation(
    leases: Mapping[str, records.Lease],
    health: Mapping[str, records.Health],
    replicas: Mapping[str, records.Replica],
    shards: Mapping[tuple[str, str], records.Shard],
) -> dict[str, EngineSaturation]:
    """Per model, from the leases of ready nodes, for replicas that serve (the router's
    rule, fleetstate/serving.py). A lease speaks only for the node its key names, and only
    of a replica placed on that node for that model: a node cannot add load to another's
    replicas, or to a model it does not serve."""
    per: dict[str, EngineSaturation] = {}
    phases = {node: h.phase for node, h in health.items()}
    for node, lease in leases.items():
        if not lease.engines:
            continue
        h = health.get(node)
        if h is None or h.phase != "ready":
            continue  # a silent node's last word is not today's load
        for e in lease.engines[: records.MAX_LEASE_ENGINES]:
            r = replicas.get(e.rid)
            if r is None or r.model != e.model or not serving(r, shards, phases).ok:
                continue
            if not any(m.node == node for m in r.members):
                continue
            have = per.get(e.model, EngineSaturation())
            per[e.model] = EngineSaturation(
                engines=have.engines + 1,
                waiting=have.waiting + (e.waiting or 0),
                kv_cache=max(have.kv_cache, e.kv_cache or 0.0),
            )
    return per


class LoadSum:
    """The routers' `load.<router>` records, summed per model. A router's record counts
    while its key keeps moving (judged by this controller's clock, as leases are)."""

    def __init__(self, stale_after: float = LOAD_STALE_AFTER_S) -> None:
        self.stale_after = stale_after
        self._seen: dict[str, tuple[int, float]] = {}  # router -> (seq, when it moved)
        self._requests: dict[tuple[str, str], int] = {}  # (router, model) -> last count

    def saw(self, router: str, load: records.RouterLoad | None, now: float) -> None:
        if load is None:
            self._seen.pop(router, None)
            return
        seen = self._seen.get(router)
        if seen is None or seen[0] != load.seq:
            self._seen[router] = (load.seq, now)

    def current(self, loads: Mapping[str, records.RouterLoad], now: float) -> list[str]:
        """The routers whose load counts now."""
        return sorted(
            r for r in loads if r in self._seen and now - self._seen[r][1] <= self.stale_after
        )

    def sum(self, loads: Mapping[str, records.RouterLoad], now: float) -> dict[str, ModelLoad]:
        per: dict[str, ModelLoad] = {}
        for router in self.current(loads, now):
            for model, m in loads[router].models.items():
                before = self._requests.get((router, model))
                self._requests[(router, model)] = m.requests
                started = before is not None and m.requests != before
                have = per.get(model, ModelLoad())
                per[model] = ModelLoad(
                    in_flight=have.in_flight + m.in_flight,
                    waiting=have.waiting + m.waiting,
                    ttft_ms=max(have.ttft_ms, m.ttft_ms),
                    routers=have.routers + 1,
                    active=have.active or started or m.in_flight > 0 or m.waiting > 0,
                )
        return per


@dataclass(frozen=True, slots=True)
class FleetShort:
    """The fleet places fewer than the count already asks: the count goes no higher. Its
    data is the placement record's decision (counts, and the refusals' profile and reason,
    not their observed numbers); the explanation is only what is shown."""

    placed: int
    desired: int
    refused: tuple[tuple[str, str], ...]  # (profile, reason) of each group of refused nodes
    explanation: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class Limit:
    """What held the count back, as data: the policy's bound, or the fleet. Compared as
    data; `text` renders it for `scale.<model>.limited`."""

    max_replicas: int | None = None
    fleet: FleetShort | None = None

    @property
    def text(self) -> str:
        if self.fleet is not None:
            f = self.fleet
            return f"the fleet, which places {f.placed} of {f.desired}: {f.explanation}"
        return f"max_replicas {self.max_replicas}" if self.max_replicas is not None else ""


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int
    wanted: int  # what the load alone asks for, within the policy's bounds
    reason: str = ""  # set when the count changed
    limit: Limit | None = None  # what held the count back

    @property
    def limited(self) -> str:
        """What held the count back, as `scale.<model>.limited` says it."""
        return self.limit.text if self.limit is not None else ""


@dataclass
class Scaler:
    """One model's windows. Made when a controller starts leading, from the count in
    `scale.<model>` (or what runs), so a takeover continues where the last leader was."""

    replicas: int
    started: float  # when this controller began judging it (monotonic)
    last_active: float = field(default=0.0)
    changed_at: float = field(default=float("-inf"))
    samples: deque[tuple[float, int]] = field(default_factory=deque)  # (when, wanted)
    # the limit this controller last wrote (data); UNSAID: none yet since it took over
    written: Limit | None | object = field(default=None)

    def __post_init__(self) -> None:
        self.last_active = self.started  # a fresh leader gives every model its full idle time

    def step(
        self, policy: Autoscale, load: ModelLoad, now: float, fleet_short: FleetShort | None = None
    ) -> Decision:
        """`fleet_short`: why the fleet places fewer than the count already asked; the count
        then goes no higher (it says so in `limited`)."""
        if load.active:
            self.last_active = now
        wanted = _wanted(policy, load, self.replicas)
        self.samples.append((now, wanted))
        horizon = max(policy.scale_up_after, policy.scale_down_after)
        while self.samples and self.samples[0][0] < now - horizon - 1.0:
            self.samples.popleft()
        decision = self._decide(policy, load, wanted, now)
        if fleet_short and decision.replicas > self.replicas > 0:
            decision = Decision(self.replicas, wanted, "", Limit(fleet=fleet_short))
        if decision.replicas != self.replicas:
            self.replicas = decision.replicas
            self.changed_at = now
        return decision

    def _decide(self, policy: Autoscale, load: ModelLoad, wanted: int, now: float) -> Decision:
        have = self.replicas
        figures = _figures(load, have, policy)
        limited = (
            Limit(max_replicas=policy.max_replicas)
            if _raw(policy, load, have) > policy.max_replicas
            else None
        )
        if have == 0:
            if load.waiting > 0 or load.in_flight > 0:
                return Decision(wanted, wanted, f"0 -> {wanted}: cold start, {figures}", limited)
            if policy.idle_unload_after == 0:  # never idles out: the floor holds
                return Decision(wanted, wanted, f"0 -> {wanted}: min_replicas {wanted}")
            return Decision(0, 0)
        idle = now - self.last_active
        if policy.idle_unload_after > 0 and idle >= policy.idle_unload_after:
            return Decision(
                0,
                0,
                f"{have} -> 0: no request for {idle:.0f} s "
                f"(idle_unload_after {policy.idle_unload_after:g})",
            )
        if wanted >= PANIC_RATIO * have:
            return Decision(wanted, wanted, f"{have} -> {wanted}: {figures} (panic)", limited)
        up = self._held(now, policy.scale_up_after, min)
        if up is not None and up > have:
            return Decision(
                up, wanted, f"{have} -> {up}: {figures}, for {policy.scale_up_after:g} s", limited
            )
        down = self._held(now, policy.scale_down_after, max)
        if down is not None and down < have and now - self.changed_at >= policy.scale_down_after:
            return Decision(
                down, wanted, f"{have} -> {down}: {figures}, for {policy.scale_down_after:g} s"
            )
        return Decision(have, wanted, "", limited)

    def _held(self, now: float, window: float, pick) -> int | None:
        """The count every sample of the last `window` seconds asked at least (min) or at
        most (max); None until this controller has judged the model that long."""
        if now - self.started < window:
            return None
        inside = [w for t, w in self.samples if t >= now - window]
        return pick(inside) if inside else None


def _fleet_short(rec: records.PlacementRecord | None) -> FleetShort | None:
    if rec is None or rec.placed >= rec.desired or not rec.refused:
        return None
    return FleetShort(
        rec.placed,
        rec.desired,
        tuple((g.profile, g.reason) for g in rec.refused),
        rec.explanation,
    )


_UNSAID = object()  # a Scaler's `written` before this controller wrote any limit


def _same_limit(scaler: Scaler, old: records.Scale, limit: Limit | None) -> bool:
    """Whether the stored record already says `limit`: compared as data with what this
    controller last wrote (a limit's text embeds the fleet's observed numbers, which move by
    themselves); before it wrote any, only an absent limit is known to be the same."""
    if limit is None or not old.limited:
        return limit is None and not old.limited
    return scaler.written is not _UNSAID and scaler.written == limit


def _raw(policy: Autoscale, load: ModelLoad, have: int) -> int:
    demand = load.in_flight + load.waiting
    raw = math.ceil(demand / policy.target_in_flight - 1e-9) if demand > 0 else 0
    if policy.ttft_target_ms > 0 and load.in_flight > 0 and load.ttft_ms > policy.ttft_target_ms:
        raw = max(raw, have + 1)  # answers are slow to start: one more than now
    if have > 0 and _saturated(policy, load.engines, have):
        raw = max(raw, have + 1)  # the engines queue or run out of KV cache: one more
    return raw


def _queued(policy: Autoscale, e: EngineSaturation, have: int) -> bool:
    return (
        policy.engine_queue_per_replica > 0 and e.waiting > policy.engine_queue_per_replica * have
    )


def _kv_full(policy: Autoscale, e: EngineSaturation) -> bool:
    return policy.kv_cache_full > 0 and e.kv_cache > policy.kv_cache_full


def _saturated(policy: Autoscale, e: EngineSaturation, have: int) -> bool:
    return e.engines > 0 and (_queued(policy, e, have) or _kv_full(policy, e))


def _wanted(policy: Autoscale, load: ModelLoad, have: int) -> int:
    return max(policy.min_replicas, min(policy.max_replicas, _raw(policy, load, have)))


def _figures(load: ModelLoad, have: int, policy: Autoscale) -> str:
    text = f"{load.in_flight:.3g} in flight"
    if load.waiting:
        text += f" and {load.waiting} waiting"
    text += f" over {have} replica{'s' if have != 1 else ''}, target {policy.target_in_flight:g}"
    if policy.ttft_target_ms > 0 and load.ttft_ms > policy.ttft_target_ms:
        text += f", first token in {load.ttft_ms:.0f} ms (target {policy.ttft_target_ms:g})"
    e = load.engines
    if e.engines and _queued(policy, e, have):
        text += (
            f", {e.waiting} queued in the engines (over "
            f"{policy.engine_queue_per_replica:g} a replica)"
        )
    if e.engines and _kv_full(policy, e):
        text += f", an engine's KV cache {e.kv_cache:.0%} full (over {policy.kv_cache_full:.0%})"
    return text


def with_adapters(
    summed: Mapping[str, ModelLoad], bases: Mapping[str, str]
) -> dict[str, ModelLoad]:
    """Each model's load with what of its LoRA adapters' its own does not count (`bases`:
    adapter id -> base id): a router counts an adapter's request in flight under its base's
    engines already, and under the adapter too; one held for an adapter (loaded nowhere, or
    its base cold) only under the adapter."""
    out = dict(summed)
    for aid, base in bases.items():
        a = summed.get(aid)
        if a is None:
            continue
        have = out.get(base, ModelLoad())
        out[base] = dataclasses.replace(
            have,
            waiting=have.waiting + a.waiting,
            ttft_ms=max(have.ttft_ms, a.ttft_ms),
            routers=max(have.routers, a.routers),
            active=have.active or a.active,
        )
    return out


def autoscaled(desired: records.Desired | None, policy: Autoscale | None) -> bool:
    """Whether a model's count is the autoscaler's: `llmgw place --auto`, and a policy."""
    return desired is not None and desired.auto and policy is not None


def scaled_text(desired: records.Desired, model: object | None, scale: records.Scale | None) -> str:
    """What `placement.<model>.scaled` says: the autoscaler's latest change and its figures."""
    if not desired.auto:
        return ""
    if getattr(model, "autoscale", None) is None:
        held = f" at {scale.replicas}" if scale is not None else ""
        return (
            f"autoscaled, but the catalog entry has no autoscale policy: the count is "
            f"held{held}; add [models.autoscale] or `llmgw place MODEL --replicas N`"
        )
    if scale is None:
        return "autoscaled: no decision yet"
    return scale.reason + (f"; held back by {scale.limited}" if scale.limited else "")


class Autoscaler:
    """The leader's autoscaling state across passes: the routers' load, a Scaler per
    autoscaled model, and how long each model's last replica took to become ready."""

    def __init__(self, stale_after: float = LOAD_STALE_AFTER_S) -> None:
        self.loads = LoadSum(stale_after)
        self.scalers: dict[str, Scaler] = {}
        self.load_s: dict[str, float] = {}
        # the routers' loads as last summed, LoRA adapters' own included (their placement
        # reads them: controller/adapters.py)
        self.summed: dict[str, ModelLoad] = {}

    def reset(self) -> None:
        """A new leadership: windows start empty, counts come from `scale.<model>`."""
        self.scalers.clear()

    def loaded(self, model: str, seconds: float) -> None:
        """A replica of `model` became ready `seconds` after it was placed."""
        self.load_s[model] = max(0.0, seconds)

    def decide(
        self,
        *,
        catalog: Mapping[str, object],
        desired: Mapping[str, records.Desired],
        scales: Mapping[str, records.Scale],
        loads: Mapping[str, records.RouterLoad],
        placed: Mapping[str, int],
        placements: Mapping[str, records.PlacementRecord],
        now: float,
        wall: float,
        engines: Mapping[str, EngineSaturation] | None = None,
        adapters: Mapping[str, str] | None = None,
    ) -> dict[str, records.Scale]:
        """The `scale.<model>` records to write: those whose count, reason or measured load
        time changed. `placed` is each model's replicas counted toward its desired count;
        `engines`: what the engines themselves say (`engine_saturation`); `adapters`: LoRA
        adapter id -> its base id, whose load it adds to (a request for an adapter is one
        for its base's replicas: one held for an adapter wakes a base scaled to zero)."""
        self.summed = self.loads.sum(loads, now)
        summed = with_adapters(self.summed, adapters or {})
        engines = engines or {}
        out: dict[str, records.Scale] = {}
        for model, want in desired.items():
            entry = catalog.get(model)
            policy = getattr(entry, "autoscale", None)
            if not autoscaled(want, policy):
                self.scalers.pop(model, None)
                continue
            old = scales.get(model)
            scaler = self.scalers.get(model)
            if scaler is None:
                start = old.replicas if old is not None else placed.get(model, 0)
                start = min(policy.max_replicas, start)
                if start > 0:
                    start = max(policy.min_replicas, start)
                scaler = self.scalers[model] = Scaler(start, now, written=_UNSAID)
            load = summed.get(model, ModelLoad())
            if model in engines:
                load = dataclasses.replace(load, engines=engines[model])
            before = scaler.replicas
            d = scaler.step(policy, load, now, _fleet_short(placements.get(model)))
            load_s = self.load_s.get(model, old.load_s if old else 0.0)
            if (
                old is not None
                and old.replicas == d.replicas
                and old.load_s == load_s
                and _same_limit(scaler, old, d.limit)
            ):
                continue
            out[model] = records.Scale(
                model=model,
                replicas=d.replicas,
                wanted=d.wanted,
                in_flight=math.ceil(load.in_flight),
                waiting=load.waiting,
                routers=load.routers,
                ttft_ms=load.ttft_ms,
                reason=d.reason or (old.reason if old else f"starts at {d.replicas}"),
                limited=d.limited,  # rendered here, at the edge
                changed_at=wall if (old is None or d.replicas != before) else old.changed_at,
                load_s=load_s,
            )
            scaler.written = d.limit
        return out

    def cold_waiting(self, loads: Mapping[str, records.RouterLoad], now: float) -> bool:
        """A router holds a request for an autoscaled model at zero: decide now, not at the
        next tick."""
        for router in self.loads.current(loads, now):
            for model, m in loads[router].models.items():
                s = self.scalers.get(model)
                if m.waiting > 0 and (s is None or s.replicas == 0):
                    return True
        return False
