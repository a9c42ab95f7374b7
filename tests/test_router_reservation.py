"""What a keyed request reserves before it runs, read from its body as the engines read it
(router/generation.py): never less than what llama-server or vLLM would generate from the
same body (as the fake engine reads it, llmgw/sim/engine_params.py, after their code), odd
forms of numbers, fields the engines rank differently, `n` and lists of prompts included;
and bodies that name a field twice refused."""

from __future__ import annotations

import json

import pytest

from llmgw.gateway.gateway import DEFAULT_MAX_TOKENS, Gateway
from llmgw.router.keygate import UNKNOWN_CONTEXT, GatewayGate
from llmgw.router.request import Affinity, BadRequest, Parsed, parse
from llmgw.sim import engine_params

CONTEXT = 4096  # the model's, as its catalog says it

ROUTES = {
    "chat": Affinity.CHAT,
    "completions": Affinity.PROMPT,
    "responses": Affinity.RESPONSES,
    "infill": Affinity.INFILL,
}

# what hostile tenants sent (issue 36) and forms engines take beside plain integers
BODIES = [
    {"max_tokens": 5, "max_completion_tokens": "3000"},  # vLLM: 3,000; llama-server: 5
    {"max_tokens": 5, "n_predict": 3000},  # llama-server: 3,000; vLLM: 5
    {"max_tokens": 5, "max_completion_tokens": 3000.0},
    {"max_completion_tokens": 10, "max_tokens": 2000},
    {"max_tokens": 1e3},
    {"max_tokens": 100.7},  # llama-server cuts it to 100; vLLM refuses it
    {"max_tokens": True},
    {"max_tokens": 2**32 + 100},  # llama-server wraps it to 100, vLLM takes it
    {"max_tokens": -1},  # llama-server: until the context is full
    {"max_tokens": 0},
    {"max_tokens": None},
    {"max_tokens": " 3_000 "},
    {"max_tokens": "5", "n_predict": "3000"},
    {},
    {"max_output_tokens": 50, "max_tokens": 3000},
    {"max_tokens": 3000},
    {"n_predict": 500, "max_tokens": 5},
    {"n": 4, "max_tokens": 100},
    {"n_cmpl": 3, "max_tokens": 100},
    {"n": 2.0, "max_tokens": 10},
    {"prompt": ["one", "two", [1, 2, 3]], "max_tokens": 100},
    {"prompt": [1, 2, 3], "max_tokens": 100},
]


class _NoCounter:
    async def add(self, subject: str, delta: int, msg_id: str | None = None) -> int:
        raise AssertionError("nothing is charged here")


def _gate(context: int | None = CONTEXT) -> GatewayGate:
    return GatewayGate(Gateway("r", _NoCounter()), lambda model: context)


def _parse(body: dict, route: str, **fields: object) -> Parsed:
    full = {"model": "m", "messages": [], "prompt": "p", "input": "i", **body, **fields}
    return parse(json.dumps(full).encode(), session=None, affinity=ROUTES[route])


def _generated(kind: str, route: str, body: dict) -> int | None:
    """What `kind` generates at most from `body` on a model of CONTEXT (None: it refuses)."""
    full = {"prompt": "p", **body}
    try:
        cap = engine_params.cap(kind, route, full)
        answers = engine_params.choices(kind, full)
    except engine_params.Refused:
        return None
    prompt = full.get("prompt")
    prompts = len(prompt) if route == "completions" and isinstance(prompt, list) else 1
    if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
        prompts = 1
    return answers * prompts * min(cap or CONTEXT, CONTEXT)


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("body", BODIES, ids=[json.dumps(b) for b in BODIES])
def test_a_whole_answer_reserves_at_least_what_either_engine_generates(body, route):
    gate = _gate()
    try:
        parsed = _parse(body, route)
    except BadRequest:
        pytest.fail(f"{body} refused")
    _, reserved = gate._reservation(parsed, "m")
    kinds = ("llama-server",) if route == "infill" else ("llama-server", "vllm")
    for kind in kinds:
        generated = _generated(kind, route, body)
        if generated is not None:
            assert reserved >= generated, (kind, body, reserved, generated)


def test_a_cap_read_alike_by_both_engines_reserves_just_that_and_what_is_unread_the_context():
    gate = _gate()
    exact = _parse({"max_tokens": 300, "n": 2}, "chat")
    assert gate._reservation(exact, "m")[1] == 600
    assert gate._reservation(_parse({"max_tokens": 1e3}, "chat"), "m")[1] == 1000
    for odd in ({"max_tokens": "300"}, {"max_tokens": 300.5}, {"max_tokens": -1}, {}):
        assert gate._reservation(_parse(odd, "chat"), "m")[1] == CONTEXT, odd
    # a model whose catalog does not say its context: a bound all the same, never small
    assert _gate(None)._reservation(_parse({}, "chat"), "m")[1] == UNKNOWN_CONTEXT
    # a cap past the context is the context
    assert gate._reservation(_parse({"max_tokens": 10**6}, "chat"), "m")[1] == CONTEXT
    # the prompt: every byte of the body the engine reads (4 a token)
    body = _parse({"max_tokens": 1}, "chat", tools=[{"type": "function", "x": "y" * 400}])
    assert gate._reservation(body, "m")[0] >= 100


def test_a_stream_that_says_no_cap_reserves_the_default_unless_its_events_batch_tokens():
    """A stream is charged as its events come and ended at a limit: it need not reserve
    the context, unless it asks vLLM to put many tokens in one event (`stream_interval`)
    or gives a cap the router does not read."""
    gate = _gate()
    plain = _parse({}, "chat", stream=True)
    assert gate._reservation(plain, "m")[1] == DEFAULT_MAX_TOKENS
    batched = _parse({"stream_interval": 50}, "chat", stream=True)
    assert gate._reservation(batched, "m")[1] == CONTEXT
    odd = _parse({"max_tokens": "5"}, "chat", stream=True)
    assert gate._reservation(odd, "m")[1] == CONTEXT
    capped = _parse({"max_tokens": 7, "stream_interval": 50}, "chat", stream=True)
    assert gate._reservation(capped, "m")[1] == 7


def test_routes_that_generate_nothing_reserve_only_their_prompt():
    gate = _gate()
    body = json.dumps({"model": "m", "query": "q" * 400, "documents": ["d" * 400]}).encode()
    rerank = parse(body, session=None, affinity=Affinity.NONE)
    prompt, generated = gate._reservation(rerank, "m")
    assert generated == 0 and prompt >= 200  # query and documents are the prompt


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "a", "messages": [], "model": "b"}',
        b'{"model": "a", "max_tokens": 5, "max_tokens": 5000}',
        b'{"model": "a", "n": 1, "n": 50}',
        b'{"model": "a", "stream": false, "stream": true}',
        b'{"model": "a", "n_predict": 5, "messages": [], "n_predict": -1}',
    ],
)
def test_a_body_naming_a_field_twice_is_refused(body):
    with pytest.raises(BadRequest, match="twice"):
        parse(body, session=None, affinity=Affinity.CHAT)


def test_names_repeated_as_values_or_in_nested_objects_are_no_repeat():
    body = {
        "model": "m",
        "messages": [{"role": "model", "content": "model"}, {"role": "user", "content": "n"}],
        "tools": [{"function": {"parameters": {"model": 1, "n": 2, "max_tokens": 3}}}],
        "n": 1,
        "max_tokens": 3,
    }
    parsed = parse(json.dumps(body).encode(), session=None, affinity=Affinity.CHAT)
    assert parsed.model == "m" and parsed.max_tokens == 3


@pytest.mark.parametrize("n", ['"2"', "true", "0", "-3", "2.5", "[2]"])
def test_a_count_of_answers_in_a_form_the_engines_read_apart_is_refused(n):
    body = b'{"model": "m", "messages": [], "n": %s}' % n.encode()
    with pytest.raises(BadRequest, match="`n` must be a whole number"):
        parse(body, session=None, affinity=Affinity.CHAT)
