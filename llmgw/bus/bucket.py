"""The llmgw bucket: opened, created when missing, never silently recreated.

A component told not to create it (an agent) waits for it instead, saying who makes it.

A bucket that exists is checked against what the operator configured (replicas, history)
and said about when it differs: recreating it would lose its contents. JetStream that does
not answer yet (a cluster electing its leader, short of a majority) is waited for like any
outage; a JetStream request that permissions refuse also answers nothing, and is said at
once instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from nats.aio.client import Client
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from . import classify
from .backoff import Backoff
from .connection import Connection, server_info, server_url
from .errors import (
    Absent,
    BucketNotMade,
    BusError,
    BusRefused,
    BusUnavailable,
    JetStreamNotReady,
    NotABucket,
    Unanswered,
)
from .settings import BucketSettings

log = logging.getLogger(__name__)

# Values are state, not data: a whole node inventory is a few KB. The cap keeps one value
# (with its headers) under nats-server's default max_payload of 1 MiB, and bounds what a
# reader accepts from a writer it does not control.
MAX_VALUE_BYTES = 1_000_000


async def open_bucket(
    conn: Connection, bucket: BucketSettings, deadline: float | None
) -> tuple[KeyValue, int]:
    """`ensure_bucket`, waiting for JetStream like for any outage (until `deadline`), and
    saying what it waits for. A JetStream request that permissions refused also answers
    nothing: that is said at once instead of waited on."""
    settings = conn.settings
    backoff = Backoff(base=settings.backoff_base, cap=min(settings.backoff_cap, 5.0))
    said_at: float | None = None
    while True:
        conn.denied = None
        try:
            return await ensure_bucket(conn.nc, bucket, timeout=settings.connect_timeout)
        except BucketNotMade as e:
            delay = backoff.next_delay()
            if deadline is not None and time.monotonic() + delay > deadline:
                raise
            said_at = _say_waiting(said_at, "%s: waiting for it", e)
            await asyncio.sleep(delay)
        except JetStreamNotReady as e:
            denied = conn.denied
            if denied is not None and denied.creates_stream:
                raise BusError(
                    f"bucket {bucket.name} does not exist and this identity may not create it "
                    f"({denied.text}): start a controller (or `llmgw up`) first, or check the "
                    "NATS permissions (docs/security.md)"
                ) from None
            if denied is not None and denied.jetstream:
                raise BusError(
                    f"NATS refused this identity a JetStream request ({denied.text}): "
                    "check the NATS permissions (docs/security.md)"
                ) from None
            delay = backoff.next_delay()
            if deadline is not None and time.monotonic() + delay > deadline:
                raise JetStreamNotReady(
                    e.url,
                    e.detail,
                    "a NATS cluster serves JetStream once a majority of its servers is up and "
                    "has elected a leader: check each server's /healthz",
                ) from None
            said_at = _say_waiting(
                said_at, "JetStream not ready on %s: waiting (%s)", e.url, e.detail
            )
            await asyncio.sleep(delay)


def _say_waiting(said_at: float | None, message: str, *args: object) -> float | None:
    """Say what start-up waits for at most every 30 s (at debug meanwhile): when it was
    last said."""
    now = time.monotonic()
    if said_at is None or now - said_at >= 30:
        log.warning(message, *args)
        return now
    log.debug(message, *args)
    return said_at


async def ensure_bucket(
    nc: Client, settings: BucketSettings, *, timeout: float = 5.0
) -> tuple[KeyValue, int]:
    """Open the bucket, creating it if missing; never silently recreate one that differs.
    Returns it with the largest value llmgw writes to or accepts from it. JetStream not
    answering within `timeout` (or answering 503) raises JetStreamNotReady: the caller waits.
    """
    # short answers while starting; the bucket itself is used with the default timeout
    js = nc.jetstream(timeout=timeout)
    doing = f"opening bucket {settings.name}"
    try:
        max_value = await _open_or_create(nc, js, settings, doing)
        return await classify.answer(nc.jetstream().key_value(settings.name), doing), max_value
    except BusUnavailable as e:
        if not e.jetstream_silent:
            raise
        if not server_info(nc).get("jetstream"):  # the INFO of a server with it says so
            raise BusError(
                f"NATS at {server_url(nc)} has no JetStream, which llmgw's bucket needs: "
                "enable it in the server's config (`jetstream { store_dir: ... }`, nats/dev.conf)"
            ) from None
        what = {
            Unanswered.TIMEOUT: "no answer",
            # "JetStream system temporarily unavailable"
            Unanswered.JETSTREAM_UNAVAILABLE: e.detail,
        }.get(e.why) or "nothing answers JetStream requests yet"
        raise JetStreamNotReady(server_url(nc), f"{what} while {doing}") from None


async def _open_or_create(nc: Client, js: Any, settings: BucketSettings, doing: str) -> int:
    cluster = server_info(nc).get("cluster")
    try:
        await classify.answer(js.key_value(settings.name), doing)
    except Absent:
        if not settings.create:
            raise BucketNotMade(settings.name, server_url(nc)) from None
        replicas = settings.replicas or 1
        if cluster and replicas == 1:
            _warn_r1(settings.name, cluster, "creating it with replicas=1")
        config = KeyValueConfig(
            bucket=settings.name,
            history=settings.history or 1,
            replicas=replicas,
            max_value_size=MAX_VALUE_BYTES,
            description="llmgw: inventory, weights, desired state, assignments (docs/bucket.md)",
        )
        try:
            await classify.answer(js.create_key_value(config), doing)
            log.info(
                "created bucket %s (replicas=%d, history=%d)",
                settings.name,
                replicas,
                settings.history or 1,
            )
            return MAX_VALUE_BYTES
        except BusRefused as e:
            if e.err_code == classify.REPLICAS_NEED_A_CLUSTER:
                raise BusError(
                    f"bucket {settings.name} cannot be created with replicas={replicas}: NATS "
                    f"at {server_url(nc)} is a single server, not a cluster; leave "
                    "--bucket-replicas unset (or 1), or give the cluster's URLs"
                ) from None
            if e.code != 400:  # a bad request: another component created it first
                raise
            await classify.answer(js.key_value(settings.name), doing)
    except NotABucket as e:
        raise BusError(
            f"stream KV_{settings.name} exists but is not a KV bucket: pick another --bucket"
        ) from e
    info = await classify.answer(js.stream_info(f"KV_{settings.name}"), doing)
    problems = []
    if settings.replicas is not None and info.config.num_replicas != settings.replicas:
        problems.append(f"replicas={info.config.num_replicas} (configured {settings.replicas})")
    if settings.history is not None and info.config.max_msgs_per_subject != settings.history:
        problems.append(
            f"history={info.config.max_msgs_per_subject} (configured {settings.history})"
        )
    if problems:
        raise BusError(
            f"bucket {settings.name} exists with {', '.join(problems)}; llmgw does not recreate it "
            f"(that would lose its contents): change the setting to match, or edit the bucket with "
            f"`nats kv edit {settings.name}`"
        )
    if cluster and (info.config.num_replicas or 1) == 1 and settings.replicas is None:
        _warn_r1(settings.name, cluster, "it has replicas=1")
    # a bucket made by another tool may allow bigger values; llmgw still keeps to its own cap
    bucket_max = info.config.max_msg_size or -1
    return MAX_VALUE_BYTES if bucket_max <= 0 else min(bucket_max, MAX_VALUE_BYTES)


def _warn_r1(bucket: str, cluster: str, what: str) -> None:
    log.warning(
        "bucket %s on NATS cluster %s: %s, so it lives on ONE server of the cluster, and losing "
        "that server stops the whole control plane; give every component --bucket-replicas 3 "
        "(LLMGW_BUCKET_REPLICAS; nats.bucket_replicas in the agent config), and raise an "
        "existing bucket with `nats stream edit KV_%s --replicas 3`",
        bucket,
        cluster,
        what,
        bucket,
    )
