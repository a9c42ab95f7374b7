"""The router's Prometheus metrics (`GET /metrics`), through prometheus_client.

Labels are the catalog's model id and the replica (its id, or a static endpoint's URL):
never anything a client chose, so a client sending random model names cannot grow the
label set without bound (those are counted under model="").
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

disable_created_metrics()  # `_created` series double the output and nobody graphs them

CONTENT_TYPE = CONTENT_TYPE_LATEST.encode()

# time to first byte: from a few ms (a cached prompt) to minutes (a long prefill in a queue)
_TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
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
        self.in_flight = Gauge(
            "llmgw_router_in_flight",
            "Requests being proxied now",
            ["model", "replica"],
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
