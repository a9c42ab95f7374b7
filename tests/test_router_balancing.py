"""The router's pure parts: what a request's affinity key is, how engines are ranked and
chosen, how failures eject them (time passed in, no sleeps)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from llmgw.router.balancer import Balancer, BalancerSettings, load_cap
from llmgw.router.request import BadRequest, parse
from llmgw.router.table import Backend


def _chat(messages, **extra) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


def _key(body: bytes, *, chat=True, embeddings=False, session=None):
    return parse(body, chat=chat, embeddings=embeddings, session=session).affinity


def test_every_turn_of_a_conversation_has_the_same_key_and_others_differ():
    system = {"role": "system", "content": "be brief"}
    first = {"role": "user", "content": "what is NATS?"}
    turns = [
        [system, first],
        [
            system,
            first,
            {"role": "assistant", "content": "a bus"},
            {"role": "user", "content": "and?"},
        ],
    ]
    assert _key(_chat(turns[0])) == _key(_chat(turns[1]))
    other = [system, {"role": "user", "content": "what is JetStream?"}]
    assert _key(_chat(other)) != _key(_chat(turns[0]))
    # user and session outrank the messages
    assert _key(_chat(other, user="ann")) == _key(_chat(turns[0], user="ann"))
    assert _key(_chat(other), session=b"s1") == _key(_chat(turns[1]), session=b"s1")
    assert _key(_chat(other), session=b"s1") != _key(_chat(other), session=b"s2")


def test_completions_key_on_their_prompt_prefix_and_embeddings_have_none():
    long = "x" * 5000
    a = json.dumps({"model": "m", "prompt": long + " turn one"}).encode()
    b = json.dumps({"model": "m", "prompt": long + " turn one and two"}).encode()
    assert _key(a, chat=False) == _key(b, chat=False)
    assert _key(json.dumps({"model": "m", "input": "x"}).encode(), embeddings=True) is None


@pytest.mark.parametrize(
    "body, why",
    [
        (b"", "no body"),
        (b"{", "not valid JSON"),
        (b"[]", "JSON object"),
        (b'"m"', "JSON object"),
        (b'{"messages": []}', "`model`"),
        (b'{"model": ""}', "`model`"),
        (b'{"model": ["m"]}', "`model`"),
        # vLLM streams for "yes" or 1, llama-server does not: the framing must be plain
        (b'{"model": "m", "stream": "yes"}', "`stream` must be true or false"),
        (b'{"model": "m", "stream": 1}', "`stream` must be true or false"),
    ],
)
def test_bodies_that_cannot_be_routed_say_why(body, why):
    with pytest.raises(BadRequest, match=why):
        parse(body, chat=True, embeddings=False, session=None)


def test_odd_fields_are_left_for_the_engine_to_judge():
    parsed = parse(
        b'{"model": "m", "messages": "not a list", "stream": null}',
        chat=True,
        embeddings=False,
        session=None,
    )
    assert parsed.model == "m" and parsed.stream is False and parsed.affinity is None


def _fleet(n: int) -> list[Backend]:
    return [Backend(f"r{i}", "m", "127.0.0.1", 18000 + i) for i in range(n)]


def test_least_in_flight_takes_the_idlest_and_breaks_ties_at_random():
    b = Balancer(BalancerSettings(affinity_load_factor=0))
    fleet = _fleet(3)
    fleet[0].in_flight, fleet[1].in_flight, fleet[2].in_flight = 3, 1, 2
    assert b.pick(fleet, None, now=0) is fleet[1]
    fleet[0].in_flight = 1
    picks = Counter(b.pick(fleet, None, now=0).id for _ in range(200))
    assert set(picks) == {"r0", "r1"}


def test_affinity_ranking_is_the_same_in_every_balancer_and_moves_little():
    key = 0x1234_5678_9ABC_DEF0
    fleet = _fleet(8)
    first, second = Balancer(), Balancer()
    assert first.rank(fleet, key) == second.rank(fleet, key)
    # rendezvous hashing: removing an engine moves only the keys it held
    keys = range(2000)
    before = {k: first.pick(fleet, k * 7919, now=0).id for k in keys}
    after = {k: first.pick(fleet[:-1], k * 7919, now=0).id for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "r7" for k in moved)
    assert 150 < len(moved) < 350  # about 1/8 of the keys


def test_bounded_load_spills_a_busy_key_in_rank_order():
    b = Balancer(BalancerSettings(affinity_load_factor=1.25))
    fleet = _fleet(4)
    key = 42
    order = b.rank(fleet, key)
    assert b.pick(fleet, key, now=0) is order[0]
    order[0].in_flight = 3  # average with this request: 1; cap ceil(1.25) = 2 -> full
    assert b.pick(fleet, key, now=0) is order[1]
    order[1].in_flight = 2
    assert b.pick(fleet, key, now=0) is order[2]
    assert load_cap(0, 4, 1.25) == 1 and load_cap(8, 4, 1.25) == 3


def test_repeated_failures_eject_for_a_growing_time_and_all_ejected_means_try_anyway():
    b = Balancer(BalancerSettings(eject_after=3, eject_base=2, eject_cap=60))
    fleet = _fleet(2)
    bad = fleet[0]
    assert not b.failed(bad, 100.0, "refused") and not b.failed(bad, 100.0, "refused")
    assert b.failed(bad, 100.0, "refused")
    assert bad.ejected_until == 102.0
    assert all(b.pick(fleet, None, now=101.0) is fleet[1] for _ in range(20))
    for _ in range(3):
        b.failed(bad, 103.0, "refused")
    assert bad.ejected_until == 107.0  # 4 s: doubled
    now = 110.0
    for _ in range(8):  # ejected again and again: 8, 16, 32, then the 60 s cap
        for _ in range(3):
            b.failed(bad, now, "refused")
        duration = bad.ejected_until - now
        now = bad.ejected_until + 1
    assert duration == 60.0
    b.failed(fleet[1], 300.0, "x")
    for _ in range(2):
        b.failed(fleet[1], 300.0, "x")
    # both ejected: panic, the router tries them rather than refusing
    assert b.pick(fleet, None, now=300.5) in fleet
    b.succeeded(bad, 1000.0)
    assert bad.failures == 0 and bad.ejections == 0


def test_an_excluded_or_unroutable_engine_is_never_picked():
    b = Balancer()
    fleet = _fleet(2)
    assert b.pick(fleet, 7, now=0, exclude=fleet[0]) is fleet[1]
    fleet[1].routable = False
    assert b.pick(fleet, 7, now=0, exclude=fleet[0]) is None
