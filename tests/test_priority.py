"""Priority classes bound to keys and teams, and the rules of who waits: a request's class
(lower only), the order a router's queue lets requests go (class, fair share between teams
in tokens, first come), the split of an engine between routers, and `llmgw key|team
--priority/--weight` against a real nats-server."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_gateway_keys import llmgw

from llmgw.bus import keys, records
from llmgw.bus.client import Bus
from llmgw.bus.server import EmbeddedNats
from llmgw.gateway.table import Identity
from llmgw.priority import Priority, Standing, asked, lowered
from llmgw.router.queue import ModelQueue, Waiter
from llmgw.router.share import handing_over, split, water_fill

C, S, X = Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE
async_test = pytest.mark.anyio


# --- a request's class ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "body", "want"),
    [
        (None, b'{"model": "m"}', None),
        (b"sheddable", b"{}", X),
        (b" Critical ", b"{}", C),
        (None, b'{"model": "m", "service_tier": "flex"}', X),
        (None, b'{"service_tier": "priority"}', C),
        (None, b'{"service_tier": "default"}', S),
        (None, b'{"service_tier": "auto"}', None),
        (None, b'{"service_tier": "scale"}', None),
        (b"urgent", b'{"service_tier": "turbo"}', None),  # unknown: ignored
        (b"critical", b'{"service_tier": "flex"}', X),  # both: the lower
        (b"sheddable", b'{"service_tier": "priority"}', X),
        (None, b'{"service_tier": 3}', None),
        (None, b'{"service_tier": ', None),  # broken: the engine says what is wrong
    ],
)
def test_a_request_asks_for_a_class_by_header_or_service_tier(header, body, want) -> None:
    assert asked(header, body) == want


def test_a_request_lowers_its_class_and_never_raises_it() -> None:
    assert [lowered(S, a) for a in (None, C, S, X)] == [S, S, S, X]
    assert [lowered(X, a) for a in (None, C, S, X)] == [X, X, X, X]
    assert [lowered(C, a) for a in (None, C, S, X)] == [C, C, S, X]


def _identity(key_priority=None, team: records.Team | None = None) -> Identity:
    key = records.ApiKey(name="k", team=team.team if team else None, priority=key_priority)
    return Identity(key, team)


def test_a_key_s_class_is_its_own_else_its_team_s_else_standard() -> None:
    batch = records.Team(team="batch", priority="sheddable", weight=3)
    assert _identity().standing.priority is S
    assert _identity(team=batch).standing.priority is X
    assert _identity("critical", batch).standing.priority is C
    s = _identity(team=batch).standing
    assert (s.team, s.weight, s.key) == ("batch", 3, "k")
    assert _identity().standing.weight == 1


# --- the order of a router's queue --------------------------------------------------------------


def _queue(served: dict[str, int]) -> ModelQueue:
    return ModelQueue("m", lambda team, model: served.get(team, 0))


async def _waiter(team: str, priority: Priority = S, weight: int = 1, tokens: int = 0) -> Waiter:
    return Waiter(Standing(priority, team, weight, team), priority, None, tokens, 0.0)


def _let_go(q: ModelQueue) -> Waiter:
    w = q.peek()
    assert w is not None
    q.pop(w)
    return w


@async_test
async def test_the_queue_lets_go_by_class_then_fewest_tokens_served_then_first_come() -> None:
    served = {"a": 5000, "b": 100}
    q = _queue(served)
    first_b, second_b = await _waiter("b"), await _waiter("b")
    for w in (await _waiter("x", X), await _waiter("a"), first_b, second_b, await _waiter("c", C)):
        q.push(w)
    order = [_let_go(q) for _ in range(5)]
    assert [w.standing.team for w in order] == ["c", "b", "b", "a", "x"]
    assert order[1] is first_b and order[2] is second_b


@async_test
async def test_fair_share_is_tokens_served_over_the_team_s_weight() -> None:
    served = {"light": 1000, "heavy": 1500}
    q = _queue(served)
    q.push(await _waiter("light", weight=1))
    q.push(await _waiter("heavy", weight=2))  # 1500 / 2 < 1000 / 1: its turn
    assert _let_go(q).standing.team == "heavy"


@async_test
async def test_a_team_that_starts_waiting_again_does_not_bank_its_idle_time() -> None:
    served = {"busy": 10_000, "idle": 0}
    q = _queue(served)
    q.push(await _waiter("busy"))
    q.push(await _waiter("idle"))  # lifted to busy's counter: they are even now
    assert q.counter("idle") == q.counter("busy")
    served["busy"] += 10  # busy is served a little more: idle goes first, once
    assert _let_go(q).standing.team == "idle"


@async_test
async def test_prompts_running_count_for_their_team_until_served() -> None:
    q = _queue({})
    q.push(await _waiter("b"))
    q.started("a", 300)  # one of a's runs: its prompt is charged while it does
    q.push(await _waiter("a"))
    assert _let_go(q).standing.team == "b"
    q.ended("a", 300)
    assert q.counter("a") == 0


@async_test
async def test_requests_gone_from_the_queue_are_never_let_go_and_it_stays_small() -> None:
    q = _queue({})
    waiting = [await _waiter("a") for _ in range(200)]
    for w in waiting:
        q.push(w)
    for w in waiting[:-1]:
        q.drop(w)
    assert q.depth == 1 and len(q._bands[S]["a"]) < 64
    assert _let_go(q) is waiting[-1]
    assert q.peek() is None and q.depth == 0
    await asyncio.sleep(0)


# --- an engine split between routers -------------------------------------------------------------


def _one(weight=None):
    return lambda team: (weight or {}).get(team, 1)


def test_routers_asking_alike_split_an_engine_evenly_and_the_shares_sum_to_it() -> None:
    got = split(4, {"ra": {(S, ""): 6}, "rb": {(S, ""): 6}}, _one())
    assert got == {"ra": 2, "rb": 2}
    for capacity in range(0, 13):
        got = split(capacity, {"a": {(S, ""): 5}, "b": {(S, ""): 2}, "c": {}}, _one())
        assert sum(got.values()) == capacity


def test_critical_demand_anywhere_is_served_before_standard_elsewhere() -> None:
    got = split(4, {"ra": {(S, "web"): 10}, "rb": {(C, "ops"): 3}}, _one())
    assert got == {"ra": 1, "rb": 3}


def test_teams_share_by_weight_across_routers_whatever_router_they_reach() -> None:
    # team a sends all its requests to ra, team b to rb; b weighs twice a
    demands = {"ra": {(S, "a"): 100}, "rb": {(S, "b"): 100}}
    assert split(6, demands, _one({"b": 2})) == {"ra": 2, "rb": 4}
    # a team asking less than its part gets what it asks; the rest goes to the other
    assert water_fill({"a": 1, "b": 100}, {"a": 1, "b": 1}, 10) == {"a": 1, "b": 9}


def test_what_nobody_asks_for_is_shared_by_every_live_router() -> None:
    # ra asks for 2 of 8: it has them, and each of the three a third of the 6 left
    assert split(8, {"ra": {(S, ""): 2}, "rb": {}, "rc": {}}, _one()) == {"ra": 4, "rb": 2, "rc": 2}
    assert split(3, {"ra": {}, "rb": {}, "rc": {}}, _one()) == {"ra": 1, "rb": 1, "rc": 1}


def test_every_router_computes_the_same_split_from_the_same_records() -> None:
    demands = {"ra": {(S, "a"): 3, (X, "b"): 9}, "rb": {(S, "a"): 1}, "rc": {(X, "b"): 2}}
    shuffled = dict(reversed(list(demands.items())))
    for salt in range(20):
        assert split(5, demands, _one(), salt) == split(5, shuffled, _one(), salt)


def test_places_held_past_a_share_are_waited_for_only_by_the_routers_whose_shares_grew() -> None:
    """rb holds 3 of a 6-slot engine where its share is now 1 (rc's demand grew); ra's share
    did not move: ra keeps using its 2 whole (each of its requests that ends is replaced at
    once), rc waits for the 2 places rb holds past its share."""
    shares = {"ra": 2, "rb": 1, "rc": 3}
    held = {"ra": 2, "rb": 3, "rc": 1}
    assert handing_over(shares, held) == {"ra": 0, "rb": 0, "rc": 2}
    # what all may use, plus what is held past the shares, is the engine's capacity
    waits = handing_over(shares, held)
    assert sum(n - waits[r] for r, n in shares.items()) + 2 == 6


def test_the_routers_short_of_the_most_get_the_first_places_to_free() -> None:
    shares = {"ra": 3, "rb": 0, "rc": 2, "rd": 1}
    held = {"ra": 1, "rb": 3, "rc": 1, "rd": 1}  # rb holds 3 past its share
    waits = handing_over(shares, held)
    assert waits == {"ra": 2, "rb": 0, "rc": 1, "rd": 0}  # rc (short 1) waits out its 1 first
    held["rb"] = 1  # rb handed back 2
    assert handing_over(shares, held) == {"ra": 0, "rb": 0, "rc": 1, "rd": 0}
    held["rb"] = 0
    assert handing_over(shares, held) == dict.fromkeys(shares, 0)
    # every router computes the same from the same records, in whatever order it holds them
    for salt in range(10):
        assert handing_over(dict(reversed(list(shares.items()))), held, salt) == handing_over(
            shares, held, salt
        )


def test_a_router_whose_share_did_not_move_keeps_using_it_while_another_hands_places_back():
    """Through the router's flow control, fed the three routers' records: ra's share of a
    6-slot engine stays 2 while rb holds 2 past its new share of 1 for rc. ra sends into
    its 2 (it waited for rb's hand-back too, before: a place idled at each of its ends)."""
    from llmgw import catalog
    from llmgw.bus import records
    from llmgw.router.balancer import Balancer
    from llmgw.router.flow import FlowControl
    from llmgw.router.inflight import InFlight
    from llmgw.router.peers import Peers
    from llmgw.router.table import EndpointTable

    url = "http://127.0.0.1:9"
    table = EndpointTable()
    table.set_static([catalog.Model(id="m", served_name="m", endpoints=[url])])
    route = table.route("m")
    assert route is not None
    (engine,) = route.backends
    engine.capacity = 6
    flow = FlowControl(table, Balancer(), InFlight())
    flow.peers = Peers("ra")

    def record(router: str, asks: int, holds: int) -> records.RouterLoad:
        load = records.ModelLoad(demand={"standard": {router: asks}}, engines={url: holds})
        return records.RouterLoad(router=router, seq=1, at=0.0, models={"m": load})

    for router, asks, holds in (("ra", 2, 2), ("rb", 1, 3), ("rc", 3, 1)):
        flow.peers.saw(router, record(router, asks, holds))
    flow.reshare()
    assert engine.share == 2
    flow.peers = Peers("rc")
    for router, asks, holds in (("ra", 2, 2), ("rb", 1, 3), ("rc", 3, 1)):
        flow.peers.saw(router, record(router, asks, holds))
    flow.reshare()
    assert engine.share == 1  # rc waits for the 2 rb holds past its share
    flow.peers.saw("rb", record("rb", 1, 1))  # rb handed them back
    flow.reshare()
    assert engine.share == 3


# --- the CLI ---------------------------------------------------------------------------------------


@async_test
async def test_key_and_team_commands_set_a_class_and_a_weight(
    nats_server: EmbeddedNats, bus: Bus
) -> None:
    url = nats_server.url
    made = llmgw("team", "create", "batch", "--priority", "sheddable", "--weight", "3", url=url)
    assert made.returncode == 0, made.stderr
    assert "priority: sheddable; weight: 3" in made.stdout
    key = llmgw("key", "create", "k", "--team", "batch", url=url)
    assert key.returncode == 0, key.stderr
    ops = llmgw("key", "create", "ops", "--priority", "critical", url=url)
    assert ops.returncode == 0, ops.stderr

    def read(name: str, type_):
        return bus.get(name, lambda b: records.decode(b, type_))

    team = await read(keys.team("batch"), records.Team)
    assert team is not None and (team.value.priority, team.value.weight) == ("sheddable", 3)
    k = await read(keys.apikey("k"), records.ApiKey)
    assert k is not None and k.value.priority is None  # its team's
    assert (await read(keys.apikey("ops"), records.ApiKey)).value.priority == "critical"

    assert llmgw("key", "set", "k", "--priority", "standard", url=url).returncode == 0
    assert (
        llmgw("team", "set", "batch", "--weight", "5", "--priority", "none", url=url).returncode
        == 0
    )
    assert (await read(keys.apikey("k"), records.ApiKey)).value.priority == "standard"
    team = await read(keys.team("batch"), records.Team)
    assert (team.value.priority, team.value.weight) == (None, 5)
    shown = json.loads(llmgw("team", "show", "batch", "--json", url=url).stdout)
    assert (shown["priority"], shown["weight"]) == (None, 5)
    assert json.loads(llmgw("key", "show", "k", "--json", url=url).stdout)["priority"] == "standard"

    bad = llmgw("key", "set", "k", "--priority", "urgent", url=url)
    assert bad.returncode == 2 and "critical" in bad.stderr
    zero = llmgw("team", "set", "batch", "--weight", "0", url=url)
    assert zero.returncode == 2 and "1<=x" in zero.stderr


# --- what an engine says it can take -----------------------------------------------------------


def test_an_engine_s_figures_are_read_from_its_slots_or_its_prometheus_text() -> None:
    from llmgw.router.report import running_waiting, slots_listed

    assert slots_listed(b'[{"id": 0, "is_processing": true}, {"id": 1}]') == 2
    assert slots_listed(b'{"error": "not found"}') is None
    assert slots_listed(b"[]") is None and slots_listed(b"[1, 2]") is None
    vllm = (
        b"# HELP vllm:num_requests_running x\n"
        b'vllm:num_requests_running{engine="0",model_name="m"} 24.0\n'
        b'vllm:num_requests_running{engine="1",model_name="m"} 8.0\n'
        b'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        b"vllm:num_requests_waiting_total 99\n"  # another name that begins the same
    )
    assert running_waiting(vllm) == (32, 3)
    llama = b"llamacpp:requests_processing 4\nllamacpp:requests_deferred 0\n"
    assert running_waiting(llama) == (4, 0)
    assert running_waiting(b"# nothing of ours\nother_metric 1\n") is None


def test_an_engine_that_makes_requests_wait_can_take_what_it_runs_and_one_more_when_it_frees():
    from llmgw.router.report import refine
    from llmgw.router.table import Backend

    b = Backend("r1", "m", "h", 1, capacity=256)
    refine(b, running=40, waiting=7)  # its KV cache is full at 40
    assert b.slots == 40
    refine(b, running=40, waiting=0)  # it ran all it had and made none wait
    assert b.slots == 41
    refine(b, running=12, waiting=0)  # not full: nothing learned
    assert b.slots == 41
    b.reported = 255
    refine(b, running=255, waiting=0)
    assert b.reported is None and b.slots == 256  # back to its profile's
