"""What the router reads from a request body: the model, and the key that keeps a
conversation on one replica. The body itself is forwarded unchanged.

The affinity key must be the same for every turn of one conversation and on every router,
with no state shared between them:
- the request's `user` field, or the session header (`x-session-id` by default), when given;
- chat: the messages up to and including the first user message (the system prompt and
  the opening question stay the same while the conversation grows behind them);
- completions: the first `PROMPT_PREFIX` bytes of the prompt (a growing prompt keeps them);
- responses: the instructions and the opening of `input`, read as chat's messages (or as
  a prompt when it is a string);
- infill: the first `PROMPT_PREFIX` bytes of `input_prefix`;
- embeddings, rerank, score, pooling, classify, tokenize, audio: none (they keep no cache
  worth returning to).
A multipart/form-data body (the audio routes) names its model in its `model` field; it is
read without copying the body (router/multipart.py).
Conversations that open identically share a key; bounded load spreads them when that
makes one replica too busy (llmgw/router/balancer.py).
"""

from __future__ import annotations

import enum
import json
import operator

import msgspec

from llmgw.router import generation, multipart
from llmgw.router.table import stable_hash

PROMPT_PREFIX = 1024  # bytes of a completions prompt that decide its replica
ANCHOR_LIMIT = 64 * 1024  # at most this much of the opening messages is hashed


class BadRequest(Exception):
    """The body cannot be routed: the client gets a 400 with this message."""


class Affinity(enum.Enum):
    """What in a route's body keeps a conversation on one replica."""

    NONE = "none"
    CHAT = "chat"  # the opening messages
    PROMPT = "prompt"  # the prompt's first bytes
    RESPONSES = "responses"  # the instructions and the opening of `input`
    INFILL = "infill"  # the first bytes of `input_prefix`


class _Occurrences:
    """How many times the decoder met a field of `_Body` that is not raw JSON (msgspec
    hands each top-level occurrence of an `object` field to its `dec_hook`): a body that
    names one twice has more than `_Body` keeps (msgspec keeps the last). A decode is
    synchronous, so the difference over one is that decode's own."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def hook(self, type_: type, value: object) -> object:
        self.count += 1
        return value


_NOT_GIVEN = msgspec.UNSET


class _Body(msgspec.Struct):
    # the fields read as values (UNSET: absent): each may be named once (`_Occurrences`),
    # since which of two an engine would take is its parser's choice
    model: object = _NOT_GIVEN
    stream: object = _NOT_GIVEN
    user: object = _NOT_GIVEN
    instructions: object = _NOT_GIVEN
    input_prefix: object = _NOT_GIVEN
    # what a gateway reserves before the request runs (router/generation.py)
    max_tokens: object = _NOT_GIVEN
    max_completion_tokens: object = _NOT_GIVEN
    max_output_tokens: object = _NOT_GIVEN
    n_predict: object = _NOT_GIVEN
    n: object = _NOT_GIVEN
    n_cmpl: object = _NOT_GIVEN
    best_of: object = _NOT_GIVEN
    stream_interval: object = _NOT_GIVEN
    stream_options: object = _NOT_GIVEN
    # kept as raw JSON, read only as far as the affinity key needs; empty when absent
    messages: msgspec.Raw = msgspec.Raw(b"")
    prompt: msgspec.Raw = msgspec.Raw(b"")
    input: msgspec.Raw = msgspec.Raw(b"")


_VALUES = tuple(f for f in _Body.__struct_fields__ if f not in ("messages", "prompt", "input"))
_values = operator.attrgetter(*_VALUES)


class _Role(msgspec.Struct):
    role: object = None


_occurrences = _Occurrences()
_decode_body = msgspec.json.Decoder(_Body, dec_hook=_occurrences.hook).decode
_decode_messages = msgspec.json.Decoder(list[msgspec.Raw]).decode
_decode_role = msgspec.json.Decoder(_Role).decode


class Parsed(msgspec.Struct, frozen=True):
    model: str
    stream: bool
    affinity: int | None
    # what a gateway reserves (router/keygate.py): whether the route generates, the most one
    # answer may generate as every engine reads the body (None: the body does not say),
    # whether to reserve what the engine may generate whatever the body says (`most`), how
    # many answers it asks for, and the size in bytes of what the engine reads as its prompt
    generates: bool = False
    max_tokens: int | None = None
    most: bool = False
    answers: int = 1
    prompt_bytes: int = 0
    # a stream whose client asked for `stream_options.include_usage` itself
    usage_asked: bool = False


_FORM_FIELDS = frozenset((b"model", b"stream", b"user"))
# the routes that generate, as generation.size names them
_GENERATING = {
    Affinity.CHAT: "chat",
    Affinity.PROMPT: "completions",
    Affinity.RESPONSES: "responses",
    Affinity.INFILL: "infill",
}


def parse(
    body: bytes,
    *,
    chat: bool = False,
    embeddings: bool = False,
    session: bytes | None,
    affinity: Affinity | None = None,
    content_type: bytes | None = None,
) -> Parsed:
    """The model a body asks for, whether it streams, and its affinity key. `affinity`
    says what keeps its conversation together (by default from `chat` and `embeddings`,
    the three first routes' flags); a multipart/form-data `content_type` reads a form."""
    if affinity is None:
        affinity = Affinity.CHAT if chat else Affinity.NONE if embeddings else Affinity.PROMPT
    if multipart.is_multipart(content_type):
        assert content_type is not None
        return _parse_form(body, content_type, session)
    if not body:
        raise BadRequest("the request has no body: send a JSON object with a `model`")
    before = _occurrences.count
    try:
        parsed = _decode_body(body)
    except msgspec.ValidationError:
        raise BadRequest("the body must be a JSON object") from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        # msgspec stops at the interpreter's depth limit (about 1,000); no request nests so
        raise BadRequest("the body nests JSON too deeply to be a request") from None
    met = _occurrences.count - before
    if met > 1 and met > len(_VALUES) - _values(parsed).count(_NOT_GIVEN):
        raise BadRequest(
            f"the body names `{_repeated(body)}` twice: the router and an engine could each "
            "take a different one; send it once"
        )
    model, stream = parsed.model, parsed.stream
    if not isinstance(model, str) or not model:
        raise BadRequest("`model` is missing or not a string: set it to a name /v1/models lists")
    if stream is not _NOT_GIVEN and stream is not None and type(stream) is not bool:
        # vLLM streams for 1 or "yes", llama-server answers whole: the answer's framing, and
        # so its metering, would depend on the engine
        raise BadRequest(f"`stream` must be true or false (got {stream!r})")
    options = parsed.stream_options
    streams = stream is True
    route = _GENERATING.get(affinity)
    most, odd, answers = None, False, 1
    if route is not None:
        most, odd = generation.size(
            route,
            parsed.max_tokens,
            parsed.max_completion_tokens,
            parsed.max_output_tokens,
            parsed.n_predict,
        )
        try:
            answers = generation.answers(
                parsed.n,
                parsed.n_cmpl,
                parsed.best_of,
                parsed.prompt if affinity is Affinity.PROMPT else None,
            )
        except generation.BadCount as e:
            raise BadRequest(str(e)) from None
    interval = parsed.stream_interval
    return Parsed(
        model=model,
        stream=streams,
        affinity=None if affinity is Affinity.NONE else _affinity(parsed, affinity, session),
        generates=route is not None,
        max_tokens=most,
        # an answer the router cannot cut short, a cap it cannot read, or a stream whose
        # events may each carry many tokens (vLLM's `stream_interval`): the stream's charge
        # as it goes would not hold it
        most=most is None and (odd or not streams or interval not in (_NOT_GIVEN, None, 1)),
        answers=answers,
        # the whole body: the messages or prompt, and the tools, documents and instructions
        # that engines put in the prompt too (an estimate; the engine's usage settles it)
        prompt_bytes=len(body),
        usage_asked=isinstance(options, dict) and options.get("include_usage") is True,
    )


def _repeated(body: bytes) -> str:
    """Which field of `_VALUES` the body's top-level object names twice (a body the decoder
    found naming one twice: rare, so parsed again to say which)."""
    top: list[list[tuple[str, object]]] = []

    def pairs(items: list[tuple[str, object]]) -> dict[str, object]:
        top[:] = [items]  # the outermost object is the last one to close
        return dict(items)

    try:
        json.loads(body, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        pass
    seen: set[str] = set()
    for name, _ in top[0] if top else ():
        if name in _VALUES and name in seen:
            return name
        seen.add(name)
    return "a field"


def _parse_form(body: bytes, content_type: bytes, session: bytes | None) -> Parsed:
    try:
        fields = multipart.form_fields(body, content_type, _FORM_FIELDS)
    except multipart.FormError as e:
        raise BadRequest(f"the body is not a valid multipart/form-data form: {e}") from None
    try:
        model = fields.get(b"model", b"").decode().strip()
    except UnicodeDecodeError:
        raise BadRequest("the form's `model` field is not UTF-8 text") from None
    if not model:
        raise BadRequest("the form has no `model` field: add one naming a model /v1/models lists")
    user = fields.get(b"user", b"").strip()
    key = b"user:" + user if user else b"session:" + session if session else None
    # the audio routes generate text; their forms say no cap the router reads
    return Parsed(
        model=model,
        stream=fields.get(b"stream", b"").strip().lower() == b"true",
        affinity=stable_hash(key) if key else None,
        generates=True,
    )


def _affinity(parsed: _Body, affinity: Affinity, session: bytes | None) -> int | None:
    if isinstance(parsed.user, str) and parsed.user:
        return stable_hash(b"user:" + parsed.user.encode())
    if session:
        return stable_hash(b"session:" + session)
    if affinity is Affinity.CHAT and len(parsed.messages):
        return _opening_hash(parsed.messages)
    if affinity is Affinity.PROMPT and len(parsed.prompt):
        return stable_hash(b"prompt:" + bytes(parsed.prompt)[:PROMPT_PREFIX])
    if affinity is Affinity.RESPONSES and len(parsed.input):
        return _responses_hash(parsed)
    if affinity is Affinity.INFILL and isinstance(parsed.input_prefix, str):
        return stable_hash(b"infill:" + parsed.input_prefix.encode()[:PROMPT_PREFIX])
    return None


def _responses_hash(parsed: _Body) -> int | None:
    instructions = parsed.instructions if isinstance(parsed.instructions, str) else ""
    raw = bytes(parsed.input)
    if raw[:1] == b"[":
        opening = _opening_hash(parsed.input)
        if opening is None:
            return None
        return stable_hash(b"responses:%s\n%d" % (instructions.encode()[:ANCHOR_LIMIT], opening))
    return stable_hash(b"responses:" + (instructions.encode() + b"\n" + raw)[:ANCHOR_LIMIT])


def _opening_hash(raw: msgspec.Raw) -> int | None:
    try:
        messages = _decode_messages(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None  # not a list: the engine will say what is wrong with it
    opening: list[bytes] = []
    size = 0
    for m in messages:
        data = bytes(m)
        opening.append(data)
        size += len(data)
        if size >= ANCHOR_LIMIT:
            break
        try:
            if _decode_role(data).role == "user":
                break
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            break
    if not opening:
        return None
    return stable_hash(b"chat:" + b"\n".join(opening)[:ANCHOR_LIMIT])
