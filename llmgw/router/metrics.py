"""The router's Prometheus metrics (`GET /metrics`), through prometheus_client.

Labels are the catalog's model id and the replica (its id, or a static endpoint's URL):
never anything a client chose, so a client sending random model names cannot grow the
label set without bound (those are counted under model="").
"""

from __future__ import annotations

import bisect
import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from llmgw.priority import Priority
from llmgw.router.inflight import InFlight
from llmgw.router.queue import ModelQueue
from llmgw.router.table import EndpointTable

disable_created_metrics()  # `_created` series double the output and nobody graphs them

CONTENT_TYPE = CONTENT_TYPE_LATEST.encode()

# time to first byte: from a few ms (a cached prompt) to minutes (a long prefill in a queue)
_TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# a wait in the router's queue: none (most requests, while engines have room) to its bound
_WAIT_BUCKETS = (0.001, *_TTFB_BUCKETS[:-2])


class Queues(Protocol):
    """The router's queue (router/flow.py), as /metrics reads it."""

    queues: Mapping[str, ModelQueue]


class RouterMetrics:
    def __init__(self, in_flight: InFlight | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # llmgw_router_in_flight is read from the one in-flight account at each scrape
        self.flights = in_flight or InFlight()
        r.register(_InFlightCollector(self.flights))
        self.requests = Counter(
            "llmgw_router_requests",
            "Requests answered, by model, replica and HTTP status",
            ["model", "replica", "code"],
            registry=r,
        )
        self.errors = Counter(
            "llmgw_router_errors",
            "Requests that failed, by kind: connect, upstream, client_disconnect, "
            "unknown_model, no_replica, bad_request, too_large",
            ["model", "replica", "kind"],
            registry=r,
        )
        self.overruns = Counter(
            "llmgw_router_body_overruns",
            "Answers a handler wrote past their declared Content-Length: a bug, refused "
            "(the connection is closed, never the body cut quietly to fit)",
            registry=r,
        )
        self.ttfb = Histogram(
            "llmgw_router_time_to_first_byte_seconds",
            "From the request to the engine's first body byte relayed",
            ["model", "replica"],
            buckets=_TTFB_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "llmgw_router_retries",
            "Requests sent to a second engine after the first could not be reached",
            ["model"],
            registry=r,
        )
        self.ejections = Counter(
            "llmgw_router_ejections",
            "Times an engine was ejected after failing repeatedly",
            ["model", "replica"],
            registry=r,
        )
        self.endpoints = Gauge(
            "llmgw_router_endpoints",
            "Engines that take new requests, by model",
            ["model"],
            registry=r,
        )

        self.queue_wait = WaitHistogram()
        r.register(self.queue_wait)
        self.queue_refused = Counter(
            "llmgw_router_queue_refused",
            "Requests the router's queue refused, by model, class, team and reason "
            "(queue_timeout, queue_full, router_shutting_down)",
            ["model", "class", "team", "reason"],
            registry=r,
        )

        self._replicas: dict[tuple[str, str], ReplicaSeries] = {}
        self._held: Callable[[], Mapping[str, int]] = dict

    def held_from(self, held: Callable[[], Mapping[str, int]]) -> None:
        """`llmgw_router_held{model}`: requests held for a cold model now (router/hold.py),
        read from `held()` at every scrape; Dynamo's dashboards call queued requests at the
        router the key metric of a fleet."""
        self._held = held
        self.registry.register(_HeldCollector(lambda: self._held()))

    def tokens_from(self, tokens: Callable[[], Mapping[tuple[str, str], list[int]]]) -> None:
        """`llmgw_router_tokens_total{model,team,kind}`: tokens the engines' usage counted
        for keyed requests, read from the gateway's tally at every scrape. Team names come
        from the bucket (a key's record), models from the catalog: never from a client."""
        self.registry.register(_TokensCollector(tokens))

    def gateway_from(
        self,
        streams: Callable[[], Mapping[str, int]],
        unreadable: Callable[[], Mapping[tuple[str, str], int]],
    ) -> None:
        """`llmgw_router_streams_missing{stream}` (1: the gateway's adds found no such
        stream) and `llmgw_router_unreadable_keys{family,reading}` (keys of `apikeys.*` and
        `teams.*` whose newest value does not read), read at every scrape."""
        self.registry.register(_GatewayCollector(streams, unreadable))

    def queue_from(self, flow: Queues, table: EndpointTable) -> None:
        """`llmgw_router_queued{model,class,team}` (requests waiting for room now), and each
        engine's `llmgw_router_engine_capacity` and this router's `llmgw_router_engine_share`
        of it, read at every scrape."""
        self.registry.register(_QueueCollector(flow, table))

    # the router's queue tells these (router/flow.py's Waits)
    def waited(self, model: str, priority: Priority, team: str, seconds: float) -> None:
        self.queue_wait.observe((model, priority, team), seconds)

    def refused(self, model: str, priority: Priority, team: str, reason: str) -> None:
        self.queue_refused.labels(model, priority.label, team, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def replica(self, model: str, replica: str) -> ReplicaSeries:
        """One replica's series, looked up once (label lookups cost more than the rest of
        the bookkeeping of a request)."""
        key = (model, replica)
        series = self._replicas.get(key)
        if series is None:
            series = self._replicas[key] = ReplicaSeries(self, model, replica)
        return series

    def forget_except(self, alive: set[tuple[str, str]]) -> None:
        """Drop the series of replicas that are gone and idle: replica ids are new at every
        placement, and a router that runs for months must not keep them all."""
        for key in [k for k in self._replicas if k not in alive and not self.flights.busy(*k)]:
            self._replicas.pop(key).remove()
        self.flights.forget_except(alive)


class ReplicaSeries:
    __slots__ = ("_m", "model", "replica", "ttfb", "_codes", "_errors")

    def __init__(self, metrics: RouterMetrics, model: str, replica: str) -> None:
        self._m = metrics
        self.model = model
        self.replica = replica
        self.ttfb = metrics.ttfb.labels(model, replica)
        self._codes: dict[int, object] = {}
        self._errors: dict[str, object] = {}

    def answered(self, status: int) -> None:
        child = self._codes.get(status)
        if child is None:
            child = self._codes[status] = self._m.requests.labels(
                self.model, self.replica, str(status)
            )
        child.inc()

    def failed(self, kind: str) -> None:
        child = self._errors.get(kind)
        if child is None:
            child = self._errors[kind] = self._m.errors.labels(self.model, self.replica, kind)
        child.inc()

    def remove(self) -> None:
        m, labels = self._m, (self.model, self.replica)
        for metric in (m.ttfb, m.ejections):
            with contextlib.suppress(KeyError):
                metric.remove(*labels)
        for code in self._codes:
            m.requests.remove(*labels, str(code))
        for kind in self._errors:
            m.errors.remove(*labels, kind)


class _InFlightCollector:
    """Requests in flight per replica, as the account has them at the scrape."""

    def __init__(self, flights: InFlight) -> None:
        self._flights = flights

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "llmgw_router_in_flight", "Requests being proxied now", labels=["model", "replica"]
        )
        for (model, replica), count in sorted(self._flights.by_replica().items()):
            g.add_metric([model, replica], count)
        yield g


class _HeldCollector:
    """Held requests per model, as they are at the scrape (no bookkeeping on the request
    path)."""

    def __init__(self, held: Callable[[], Mapping[str, int]]) -> None:
        self._held = held

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "llmgw_router_held",
            "Requests held for a model with no ready replica (a cold start), waiting for one",
            labels=["model"],
        )
        for model, count in sorted(self._held().items()):
            g.add_metric([model], count)
        yield g


class _TokensCollector:
    def __init__(self, tokens: Callable[[], Mapping[tuple[str, str], list[int]]]) -> None:
        self._tokens = tokens

    def collect(self) -> Iterator[CounterMetricFamily]:
        c = CounterMetricFamily(
            "llmgw_router_tokens",
            'Tokens of keyed requests, from the engines\' own usage, by model, team ("": '
            "a key with no team) and kind (prompt, completion, cached)",
            labels=["model", "team", "kind"],
        )
        for (team, model), counts in sorted(self._tokens().items()):
            for kind, n in zip(("prompt", "completion", "cached"), counts, strict=True):
                c.add_metric([model, team, kind], n)
        yield c


class _GatewayCollector:
    def __init__(
        self,
        streams: Callable[[], Mapping[str, int]],
        unreadable: Callable[[], Mapping[tuple[str, str], int]],
    ) -> None:
        self._streams = streams
        self._unreadable = unreadable

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "llmgw_router_streams_missing",
            "1 for each of the gateway's streams this router's adds found missing (the "
            "operator makes them: `llmgw key ls` or `llmgw up`); limited keys then get what "
            "--limits-offline says",
            labels=["stream"],
        )
        for stream, missing in sorted(self._streams().items()):
            g.add_metric([stream], missing)
        yield g
        u = GaugeMetricFamily(
            "llmgw_router_unreadable_keys",
            "Keys of apikeys.* and teams.* whose newest value does not read, by family and "
            "what the router reads instead (kept: its last good value; refused: none was "
            "read, so the key, or the team's keys, are refused)",
            labels=["family", "reading"],
        )
        for (family, reading), n in sorted(self._unreadable().items()):
            u.add_metric([family, reading], n)
        yield u


class _QueueCollector:
    def __init__(self, flow: Queues, table: EndpointTable) -> None:
        self._flow = flow
        self._table = table

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "llmgw_router_queued",
            "Requests waiting in the router's queue for room at their model's engines, by "
            "model, priority class and team",
            labels=["model", "class", "team"],
        )
        for model, q in sorted(self._flow.queues.items()):
            for (cls, team), n in sorted(q.queued.items()):
                g.add_metric([model, cls.label, team], n)
        yield g
        capacity = GaugeMetricFamily(
            "llmgw_router_engine_capacity",
            "Requests an engine takes at once: its profile's parallel slots, or what the "
            "engine itself says (only engines whose capacity is known)",
            labels=["model", "replica"],
        )
        share = GaugeMetricFamily(
            "llmgw_router_engine_share",
            "Of an engine's capacity, what this router may have there at once (its part of "
            "the split between the routers sending to it)",
            labels=["model", "replica"],
        )
        for b in sorted(self._table.backends(), key=lambda b: (b.model, b.id)):
            if b.routable and b.slots is not None:
                capacity.add_metric([b.model, b.id], b.slots)
            if b.routable and b.share is not None:
                share.add_metric([b.model, b.id], b.share)
        yield capacity
        yield share


class WaitHistogram:
    """`llmgw_router_queue_wait_seconds{model,class,team}`: every request's wait in the
    router's queue. Kept as plain counts (a request that went at once adds one to a list,
    no lock and no label lookup: it is every request's path) and rendered as a Prometheus
    histogram at each scrape."""

    name = "llmgw_router_queue_wait_seconds"

    def __init__(self, buckets: tuple[float, ...] = _WAIT_BUCKETS) -> None:
        self.bounds = buckets
        # (model, class, team) -> [count per bucket (the last: past every bound), sum]
        self._counts: dict[tuple[str, Priority, str], list[float]] = {}

    def observe(self, key: tuple[str, Priority, str], seconds: float) -> None:
        counts = self._counts.get(key)
        if counts is None:
            if len(self._counts) >= 100_000:  # a bound on label sets, as a scrape's
                self._counts.clear()
            counts = self._counts[key] = [0.0] * (len(self.bounds) + 2)
        if seconds <= 0.0:
            counts[0] += 1
            return
        counts[bisect.bisect_left(self.bounds, seconds)] += 1
        counts[-1] += seconds

    def collect(self) -> Iterator[HistogramMetricFamily]:
        h = HistogramMetricFamily(
            self.name,
            "How long requests waited in the router's queue for room at their model's engines "
            "(0 for those that went at once), by model, priority class and team",
            labels=["model", "class", "team"],
        )
        for (model, cls, team), counts in sorted(self._counts.items()):
            cumulative, total = [], 0.0
            for bound, n in zip((*self.bounds, math.inf), counts[:-1], strict=True):
                total += n
                cumulative.append((_le(bound), total))
            h.add_metric([model, cls.label, team], cumulative, counts[-1])
        yield h


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))
