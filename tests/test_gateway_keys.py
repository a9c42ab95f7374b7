"""API keys and teams: secrets kept only as salted hashes, the key table a router builds from
its watch (authenticate, authorize, models), `llmgw key|team`, and revocation and expiry on
every router, also one cut off from NATS."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import anyio
import msgspec
import pytest
from links import ProxyLink
from test_cli_names import catalog_entries
from waiting import until

from llmgw.bus import keys, records
from llmgw.bus.client import Bus, NatsSettings
from llmgw.bus.server import EmbeddedNats
from llmgw.gateway import credentials
from llmgw.gateway.follow import follow
from llmgw.gateway.gateway import Gateway, GatewaySettings
from llmgw.gateway.refusals import Refusal
from llmgw.gateway.table import Identity, KeyTable

pytestmark = pytest.mark.anyio


def llmgw(*args: str, url: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmgw.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"LLMGW_NATS": url, "PATH": "/usr/bin:/bin"},
    )


def _key(name: str, secret: str, **kw: object) -> records.ApiKey:
    return records.ApiKey(name=name, secrets=[credentials.hash_secret(secret, 0.0)], **kw)


# --- secrets -------------------------------------------------------------------------------


def test_a_secret_carries_its_key_name_and_only_its_hash_is_kept() -> None:
    secret = credentials.new_secret("alice")
    assert secret.startswith("llmgw-alice-") and len(secret) == len("llmgw-alice-") + 64
    assert credentials.name_of(secret) == "alice"
    stored = credentials.hash_secret(secret, 1.0)
    assert secret not in records.encode(stored).decode()
    assert secret.rsplit("-", 1)[1] not in records.encode(stored).decode()
    assert credentials.matches(stored, secret, 2.0)
    assert not credentials.matches(stored, credentials.new_secret("alice"), 2.0)
    # two hashes of one secret differ (salted): the bucket cannot tell equal secrets apart
    assert credentials.hash_secret(secret).sha256 != stored.sha256


def test_a_secret_in_grace_stops_working_when_its_grace_ends() -> None:
    secret = credentials.new_secret("k")
    stored = msgspec.structs.replace(credentials.hash_secret(secret, 0.0), valid_until=100.0)
    assert credentials.matches(stored, secret, 99.0)
    assert not credentials.matches(stored, secret, 100.0)


@pytest.mark.parametrize(
    "text",
    ["", "Bearer", "sk-abc", "llmgw-alice-xyz", "llmgw-" + "a" * 300, "llmgw-a.b-" + "0" * 64],
)
def test_what_is_not_shaped_like_a_secret_names_no_key(text: str) -> None:
    assert credentials.name_of(text) is None


# --- the table -------------------------------------------------------------------------------


def _table(*values: records.ApiKey | records.Team, clock=lambda: 1000.0) -> KeyTable:
    table = KeyTable(clock=clock, serve_known_for=60)
    for v in values:
        key = keys.apikey(v.name) if isinstance(v, records.ApiKey) else keys.team(v.team)
        table.apply(key, v)
    return table


def test_without_keys_the_table_asks_for_none_and_with_one_it_asks_everyone() -> None:
    table = _table()
    assert not table.enabled
    secret = credentials.new_secret("alice")
    table.apply(keys.apikey("alice"), _key("alice", secret))
    assert table.enabled
    assert isinstance(table.authenticate(f"Bearer {secret}"), Identity)
    for header in (
        None,
        "",
        "Bearer ",
        f"Basic {secret}",
        "Bearer " + credentials.new_secret("alice"),
    ):
        refusal = table.authenticate(header)
        assert isinstance(refusal, Refusal) and refusal.status == 401, header
        body = json.loads(refusal.body())["error"]
        assert body["code"] == "invalid_api_key" and body["type"] == "invalid_request_error"
    table.apply(keys.apikey("alice"), None)
    assert not table.enabled


def test_a_wrong_secret_is_refused_alike_whether_its_key_exists_or_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing in a refusal tells a key's name exists: the same answer, after the same work
    (SHA-256 digests, counted), for a wrong secret of an existing key (one secret, or
    several in rotation), of a missing one, and of one whose record does not read."""
    rotating = [credentials.hash_secret(credentials.new_secret("carol"), 0.0) for _ in range(3)]
    table = _table(
        _key("alice", credentials.new_secret("alice")),
        records.ApiKey(name="carol", secrets=rotating),
    )
    table.apply_raw(keys.apikey("dave"), b'{"name": "dave", "limits": "none"}', 1)
    digests: list[str] = []
    digest = credentials._digest

    def counted(salt: bytes, secret: str) -> bytes:
        digests.append(secret)
        return digest(salt, secret)

    monkeypatch.setattr(credentials, "_digest", counted)

    def refused(name: str) -> tuple[int, bytes]:
        digests.clear()
        refusal = table.authenticate("Bearer " + credentials.new_secret(name))
        assert isinstance(refusal, Refusal) and refusal.status == 401
        return len(digests), refusal.body()

    alice, carol, bob, dave = (refused(n) for n in ("alice", "carol", "bob", "dave"))
    assert alice == carol == bob == dave
    assert alice[0] > 0 and b"alice" not in alice[1]


def test_a_revoked_or_expired_key_is_refused_by_the_clock_at_request_time() -> None:
    now = [1000.0]
    secret = credentials.new_secret("k")
    table = _table(_key("k", secret, expires_at=1010.0), clock=lambda: now[0])
    assert isinstance(table.authenticate(f"Bearer {secret}"), Identity)
    now[0] = 1010.0
    refusal = table.authenticate(f"Bearer {secret}")
    assert isinstance(refusal, Refusal) and "expired" in refusal.message
    table.apply(keys.apikey("k"), _key("k", secret, revoked_at=900.0))
    refusal = table.authenticate(f"Bearer {secret}")
    assert isinstance(refusal, Refusal) and refusal.status == 401 and "revoked" in refusal.message


def test_a_model_outside_the_list_is_403_naming_the_models_allowed_and_models_lists_only_them() -> (
    None
):
    secret = credentials.new_secret("k")
    table = _table(
        _key("k", secret, team="ml", models=["a", "b", "c"]),
        records.Team(team="ml", models=["b", "c", "d"]),
    )
    identity = table.authenticate(f"Bearer {secret}")
    assert isinstance(identity, Identity)
    assert table.authorize(identity, "b") is None
    refusal = table.authorize(identity, "a")  # the key lists it, its team does not
    assert refusal is not None and refusal.status == 403
    error = json.loads(refusal.body())["error"]
    assert error["allowed_models"] == ["b", "c"] and "b, c" in error["message"]
    assert table.visible(identity, ["a", "b", "c", "d"]) == ["b", "c"]


def test_a_cut_off_table_serves_known_keys_for_its_stated_time_then_refuses_with_503() -> None:
    now = [1000.0]
    secret = credentials.new_secret("k")
    table = _table(_key("k", secret), clock=lambda: now[0])
    table.cut_off()
    now[0] += 60  # serve_known_for
    assert isinstance(table.authenticate(f"Bearer {secret}"), Identity)
    now[0] += 1
    refusal = table.authenticate(f"Bearer {secret}")
    assert isinstance(refusal, Refusal) and refusal.status == 503
    table.caught_up()
    assert isinstance(table.authenticate(f"Bearer {secret}"), Identity)


def test_a_key_record_naming_another_key_is_not_believed() -> None:
    from llmgw.bus import trust

    with pytest.raises(trust.SpoofedRecord):
        trust.check(keys.apikey("alice"), records.ApiKey(name="bob"))
    with pytest.raises(trust.RecordRejected):
        trust.check(keys.team("ml"), records.Team(team="ml", limits=records.Limits(rpm=-1)))


# --- the CLI against a real nats-server --------------------------------------------------------


def _bucket_values(nats_server: EmbeddedNats) -> str:
    """Every stored message of every stream, as text (the bucket, the counters, the audit)."""
    store = nats_server.data_dir / "jetstream"
    return "\n".join(p.read_bytes().decode("latin-1") for p in store.rglob("*") if p.is_file())


async def test_key_create_prints_the_secret_alone_on_the_last_line_and_stores_none(
    nats_server: EmbeddedNats, bus: Bus
) -> None:
    url = nats_server.url
    await catalog_entries(bus, ("m1", "m1"), ("m2", "m2"))
    team = llmgw("team", "create", "ml", "--tpm", "20000", url=url)
    assert team.returncode == 0, team.stderr
    out = llmgw(
        "key",
        "create",
        "alice",
        "--team",
        "ml",
        "--models",
        "m1,m2",
        "--expires",
        "30d",
        "--rpm",
        "10",
        "--tpm",
        "1000",
        "--tokens-per-day",
        "5000",
        "--max-parallel",
        "2",
        url=url,
    )
    assert out.returncode == 0, out.stderr
    secret = out.stdout.splitlines()[-1]
    assert credentials.name_of(secret) == "alice"
    # what stays open once keys exist is said where they are made
    assert "the fleet page's view of the fleet" in out.stdout and "/metrics stay open" in out.stdout
    entry = await bus.get(keys.apikey("alice"), lambda b: records.decode(b, records.ApiKey))
    assert entry is not None
    k = entry.value
    assert (k.team, k.models) == ("ml", ["m1", "m2"])
    assert k.limits == records.Limits(rpm=10, tpm=1000, tokens_per_day=5000, max_parallel=2)
    assert k.expires_at is not None and 29.9 * 86400 < k.expires_at - time.time() < 30.1 * 86400
    assert credentials.matches(k.secrets[0], secret, time.time())

    again = llmgw("key", "create", "alice", url=url)
    assert again.returncode == 1 and "llmgw key rotate alice" in again.stderr
    no_team = llmgw("key", "create", "bob", "--team", "nope", url=url)
    assert no_team.returncode == 1 and "llmgw team create nope" in no_team.stderr

    rotated = llmgw("key", "rotate", "alice", "--grace", "1h", url=url)
    assert rotated.returncode == 0, rotated.stderr
    new = rotated.stdout.splitlines()[-1]
    entry = await bus.get(keys.apikey("alice"), lambda b: records.decode(b, records.ApiKey))
    assert entry is not None
    table = _table(entry.value, clock=time.time)
    assert isinstance(table.authenticate(f"Bearer {new}"), Identity)
    assert isinstance(table.authenticate(f"Bearer {secret}"), Identity)  # in its grace
    old = next(s for s in entry.value.secrets if s.valid_until)
    assert 3590 < old.valid_until - time.time() < 3610

    shown = json.loads(llmgw("key", "show", "alice", "--json", url=url).stdout)
    assert shown["state"] == "active" and shown["secrets"] == 2
    listed = json.loads(llmgw("team", "show", "ml", "--json", url=url).stdout)
    assert listed["keys"] == ["alice"] and listed["limits"] == {"tpm": 20000}

    for s in (secret, new):
        assert s not in _bucket_values(nats_server)
        assert s.rsplit("-", 1)[1] not in _bucket_values(nats_server)


# --- every router hears a revocation within a second ------------------------------------------


async def _router(settings: NatsSettings) -> AsyncIterator[tuple[Bus, Gateway]]:
    bus = await Bus.connect(settings, give_up_after=5)
    gateway = Gateway("r", _NoCounter(), settings=GatewaySettings(serve_known_for=3600))
    async with anyio.create_task_group() as tg:
        tg.start_soon(follow, bus, gateway)
        try:
            yield bus, gateway
        finally:
            tg.cancel_scope.cancel()
    await bus.close()


class _NoCounter:
    async def add(self, subject: str, delta: int, msg_id: str | None = None) -> int:
        raise AssertionError("no limits in these tests")


async def _answers(gateway: Gateway, secret: str) -> int:
    admitted = await gateway.admit(authorization=f"Bearer {secret}", model="m")
    return admitted.status if isinstance(admitted, Refusal) else 200


async def test_a_revoked_key_fails_within_a_second_on_every_router_also_one_cut_off_meanwhile(
    nats_server: EmbeddedNats, nats_settings: NatsSettings, caplog: pytest.LogCaptureFixture
) -> None:
    import contextlib

    out = llmgw("key", "create", "alice", url=nats_server.url)
    secret = out.stdout.splitlines()[-1]
    link = ProxyLink(nats_server.port)
    await link.start()
    cut_settings = NatsSettings(urls=(link.url,), name="cut", healthy_after=1.0)
    async with contextlib.AsyncExitStack() as stack:
        _, a = await stack.enter_async_context(
            contextlib.asynccontextmanager(_router)(nats_settings)
        )
        b_bus, b = await stack.enter_async_context(
            contextlib.asynccontextmanager(_router)(cut_settings)
        )
        await until(lambda: _ok(a, secret), timeout=10)
        await until(lambda: _ok(b, secret), timeout=10)

        await link.cut()
        await until(lambda: _async(not b_bus.connected), timeout=10)
        revoked = llmgw("key", "revoke", "alice", url=nats_server.url)
        assert revoked.returncode == 0, revoked.stderr
        start = time.monotonic()
        await until(lambda: _refused(a, secret), timeout=5)
        assert time.monotonic() - start < 1.0
        # cut off: it could not hear of it, and serves the key it knows (for serve_known_for)
        assert await _answers(b, secret) == 200
        await link.heal()
        await until(lambda: _async(b_bus.connected), timeout=10)
        start = time.monotonic()
        await until(lambda: _refused(b, secret), timeout=5)
        assert time.monotonic() - start < 1.0
    # no log line of either router (debug ones included) carries the secret
    assert caplog.records and not [r for r in caplog.records if secret[-64:] in r.getMessage()]


async def _async(value: bool) -> bool:
    return value


async def _ok(g: Gateway, secret: str) -> bool:
    return await _answers(g, secret) == 200


async def _refused(g: Gateway, secret: str) -> bool:
    return await _answers(g, secret) == 401


async def test_key_and_team_set_change_only_what_they_are_given(
    nats_server: EmbeddedNats, bus: Bus
) -> None:
    url = nats_server.url
    await catalog_entries(bus, ("a", "a"), ("b", "b"))
    assert llmgw("team", "create", "ml", "--rpm", "100", "--tpm", "5000", url=url).returncode == 0
    made = llmgw("key", "create", "k", "--team", "ml", "--rpm", "10", "--tpm", "99", url=url)
    assert made.returncode == 0, made.stderr
    changed = llmgw(
        "key", "set", "k", "--rpm", "none", "--models", "a,b", "--model-rpm", "3", url=url
    )
    assert changed.returncode == 0, changed.stderr
    team = llmgw("team", "set", "ml", "--tpm", "none", "--max-parallel", "4", url=url)
    assert team.returncode == 0, team.stderr
    k = await bus.get(keys.apikey("k"), lambda b: records.decode(b, records.ApiKey))
    t = await bus.get(keys.team("ml"), lambda b: records.decode(b, records.Team))
    assert k is not None and t is not None
    assert k.value.limits == records.Limits(tpm=99)
    assert k.value.model_limits == records.Limits(rpm=3) and k.value.models == ["a", "b"]
    assert t.value.limits == records.Limits(rpm=100, max_parallel=4)
    bad = llmgw("key", "set", "k", "--rpm", "0", url=url)
    assert bad.returncode == 2 and "'none' removes the limit" in bad.stderr
    missing = llmgw("key", "revoke", "nobody", url=url)
    assert missing.returncode == 1
    assert "key 'nobody' does not exist (`llmgw key ls` lists them)" in missing.stderr
    no_team = llmgw("team", "set", "nobody", "--rpm", "1", url=url)
    assert "team 'nobody' does not exist (`llmgw team ls` lists them)" in no_team.stderr
    listed = json.loads(llmgw("key", "ls", "--team", "ml", "--json", url=url).stdout)
    assert [x["name"] for x in listed] == ["k"]


async def test_a_duration_without_its_unit_is_refused_naming_the_units(
    nats_server: EmbeddedNats, bus: Bus
) -> None:
    """`--expires 90` was read as 90 seconds, silently; 0 (none at all) needs no unit."""
    url = nats_server.url
    out = llmgw("key", "create", "alice", "--expires", "90", url=url)
    assert out.returncode == 2, out.stderr
    assert "--expires '90': a number needs its unit: 90s, 90m, 90h, 90d or 90w" in out.stderr
    assert await bus.get(keys.apikey("alice"), lambda b: b) is None
    retention = llmgw("audit", "--retention", "90", url=url)
    assert retention.returncode == 2 and "a number needs its unit" in retention.stderr
    assert llmgw("key", "create", "alice", "--expires", "90d", url=url).returncode == 0
    rotated = llmgw("key", "rotate", "alice", "--grace", "0", url=url)
    assert rotated.returncode == 0, rotated.stderr


def test_readers_of_the_whole_bucket_see_keys_and_teams_as_not_theirs() -> None:
    from llmgw.controller.view import View

    secret = credentials.new_secret("alice")
    view = View()
    for key, value in (
        (keys.apikey("alice"), _key("alice", secret)),
        (keys.team("ml"), records.Team(team="ml")),
    ):
        assert view.apply(key, records.encode(value), 1) is None  # ignored, not a failure
        assert keys.parse(key) is None and keys.parse_gateway(key) is not None


async def test_a_controller_leads_beside_keys_and_teams_in_the_bucket(
    bus: Bus, nats_settings: NatsSettings
) -> None:
    from llmgw.controller.loop import Controller, ControllerSettings

    await bus.put(keys.apikey("alice"), _key("alice", credentials.new_secret("alice")))
    await bus.put(keys.team("ml"), records.Team(team="ml"))
    settings = ControllerSettings(unreachable_after=2, lost_after=30, leader_ttl=1, tick=0.05)
    controller_bus = await Bus.connect(nats_settings, give_up_after=5)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(Controller(controller_bus, settings).run)
            await until(lambda: bus.get_raw(keys.leader()), timeout=10)
            await bus.put(keys.apikey("bob"), _key("bob", credentials.new_secret("bob")))
            await anyio.sleep(0.5)  # it sees the new key while it leads, and goes on
            assert await bus.get_raw(keys.leader()) is not None
            tg.cancel_scope.cancel()
    finally:
        await controller_bus.close()
