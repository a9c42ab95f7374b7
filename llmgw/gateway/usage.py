"""The engines' own `usage`, read from what they answer, in each route's own names:

- chat and completions: `usage.prompt_tokens`, `completion_tokens`,
  `prompt_tokens_details.cached_tokens` (a stream's comes in a chunk of its own, empty
  `choices`, before `[DONE]`, when asked for with `stream_options.include_usage`);
- responses: `usage.input_tokens`, `output_tokens`, `input_tokens_details.cached_tokens`
  (a stream's in its `response.completed` event, as `response.usage`);
- embeddings, rerank, score, pooling: `usage.prompt_tokens`, or `total_tokens` alone
  (vLLM's rerank);
- llama-server's own shape (/infill): `tokens_evaluated` and `tokens_predicted` beside the
  answer, in every event of a stream.

A client that did not ask for a stream's usage chunk must not receive it (`strip`), but
the router asks for it on every stream so that none goes unmetered. A whole answer is
read whatever its size (`Document`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

MAX_USAGE_JSON = 1 << 20  # a document parsed whole; a bigger one is searched (`Document`)
WINDOW = 64 << 10  # of a bigger one: its first and last bytes, where engines put usage


@dataclass(frozen=True, slots=True)
class Usage:
    prompt: int = 0
    completion: int = 0
    cached: int = 0

    @property
    def total(self) -> int:
        return self.prompt + self.completion


def ask_for_usage(body: dict[str, Any]) -> bool:
    """Make a streaming request ask for usage; True when the client asked for it itself
    (then its usage chunk is passed on, else stripped)."""
    options = body.get("stream_options")
    asked = isinstance(options, dict) and options.get("include_usage") is True
    if body.get("stream") and not asked:
        body["stream_options"] = {
            **(options if isinstance(options, dict) else {}),
            "include_usage": True,
        }
    return asked


def _int(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _counted(
    prompt: int | None, completion: int | None, total: int | None, cached: int | None
) -> Usage | None:
    """A usage from the counts a route names (None: none of them): the prompt's, else what
    the total leaves beside the completion (a total alone is a prompt's: rerank, score)."""
    if prompt is None and completion is None and total is None:
        return None
    completion = completion or 0
    if prompt is None:
        prompt = max(0, (total or 0) - completion)
    return Usage(prompt, completion, cached or 0)


def from_dict(usage: object) -> Usage | None:
    """A `usage` object in any route's names (the module's docstring)."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    prompt = _int(usage.get("prompt_tokens"))
    completion = _int(usage.get("completion_tokens"))
    return _counted(
        prompt if prompt is not None else _int(usage.get("input_tokens")),
        completion if completion is not None else _int(usage.get("output_tokens")),
        _int(usage.get("total_tokens")),
        _int(details.get("cached_tokens")) if isinstance(details, dict) else None,
    )


def _from_doc(doc: dict[str, Any]) -> Usage | None:
    """An answer's usage: its `usage`, its `response.usage` (a responses event), or
    llama-server's own counts beside the answer."""
    found = from_dict(doc.get("usage"))
    if found is None and isinstance(doc.get("response"), dict):
        found = from_dict(doc["response"].get("usage"))
    if found is None:
        found = _counted(
            _int(doc.get("tokens_evaluated")), _int(doc.get("tokens_predicted")), None, None
        )
    return found


class _Answer(msgspec.Struct):
    """What is read of an answer or a chunk: its usage in any route's names, and whether
    it has choices. The rest (the generated text) is skipped, not decoded into objects."""

    usage: object = None
    choices: msgspec.Raw = msgspec.Raw(b"")
    response: object = None
    tokens_predicted: object = None
    tokens_evaluated: object = None


_decode_answer = msgspec.json.Decoder(_Answer).decode

_Count = Annotated[int, msgspec.Meta(ge=0)]


class _Details(msgspec.Struct):
    cached_tokens: _Count = 0


class _Usage(msgspec.Struct):
    prompt_tokens: _Count | None = None
    completion_tokens: _Count | None = None
    total_tokens: _Count | None = None
    input_tokens: _Count | None = None
    output_tokens: _Count | None = None
    prompt_tokens_details: _Details | None = None
    input_tokens_details: _Details | None = None


class _Response(msgspec.Struct):
    usage: _Usage | None = None


class _TypedAnswer(msgspec.Struct):
    """`_Answer` as engines write it: read straight into numbers. Anything else in these
    fields (a string, a negative count) fails here and is read leniently by `_Answer`."""

    usage: _Usage | None = None
    choices: msgspec.Raw = msgspec.Raw(b"")
    response: _Response | None = None
    tokens_predicted: _Count | None = None
    tokens_evaluated: _Count | None = None


_decode_typed = msgspec.json.Decoder(_TypedAnswer).decode


def _typed_usage(typed: _TypedAnswer) -> Usage | None:
    """`usage` in the names of routes other than chat and completions (read's fast case)."""
    u = typed.usage
    if u is None and typed.response is not None:
        u = typed.response.usage
    if u is None:
        return _counted(typed.tokens_evaluated, typed.tokens_predicted, None, None)
    details = u.prompt_tokens_details or u.input_tokens_details
    return _counted(
        u.prompt_tokens if u.prompt_tokens is not None else u.input_tokens,
        u.completion_tokens if u.completion_tokens is not None else u.output_tokens,
        u.total_tokens,
        details.cached_tokens if details is not None else None,
    )


def read(data: bytes) -> tuple[Usage | None, bool]:
    """An answer's or a chunk's usage (None: it has none, or is not a JSON object), and
    whether it is a usage-only chunk (usage and no choices: the one to strip); one pass."""
    if len(data) > MAX_USAGE_JSON:
        return None, False
    try:
        typed = _decode_typed(data)
    except msgspec.ValidationError:
        typed = None  # not as engines write it: read leniently below
    except msgspec.DecodeError:
        return None, False
    if typed is not None:
        u = typed.usage
        if u is not None and u.prompt_tokens is not None and u.completion_tokens is not None:
            details = u.prompt_tokens_details  # chat and completions: the common case
            cached = details.cached_tokens if details else 0
            return Usage(u.prompt_tokens, u.completion_tokens, cached), _empty(typed.choices)
        found = _typed_usage(typed)
        return found, found is not None and _empty(typed.choices)
    try:
        doc = _decode_answer(data)
    except msgspec.DecodeError:
        return None, False
    found = _from_doc(
        {
            "usage": doc.usage,
            "response": doc.response,
            "tokens_predicted": doc.tokens_predicted,
            "tokens_evaluated": doc.tokens_evaluated,
        }
    )
    return found, found is not None and _empty(doc.choices)


def _empty(raw: msgspec.Raw) -> bool:
    """A JSON value absent or falsy (`[]`, `null`, ...), as `not doc.get("choices")`."""
    if not raw:
        return True
    value = bytes(raw).strip()
    return len(value) <= 32 and not msgspec.json.decode(value)


def of_json(data: bytes) -> Usage | None:
    """The usage of a whole (non-streamed) answer, or of one SSE chunk's JSON."""
    return read(data)[0]


def is_usage_only_chunk(data: bytes) -> bool:
    """A stream chunk that carries usage and no choices: the one to strip."""
    return read(data)[1]


# what a document's first or last bytes are searched for, in the order tried
_KEYS = (b'"usage"', b'"tokens_predicted"')
_scanner = json.JSONDecoder()


class Document:
    """One JSON document's bytes as they come (a whole answer, or a stream's event too
    long to keep), for its usage: kept whole up to MAX_USAGE_JSON bytes and parsed, and
    past that only its first and last WINDOW bytes, searched for a `usage` object (engines
    put it last, llama-server's embeddings first; a JSON string cannot hold the bytes
    `"usage"`, its quotes are escaped, so they are a key). Memory stays bounded whatever
    the size."""

    __slots__ = ("size", "_parts", "_head", "_tail")

    def __init__(self) -> None:
        self.size = 0
        self._parts: list[bytes] | None = []  # joined once at the end; None past the bound
        self._head = self._tail = b""

    def feed(self, data: bytes) -> None:
        self.size += len(data)
        if self._parts is not None:
            self._parts.append(data)
            if self.size <= MAX_USAGE_JSON:
                return
            whole = b"".join(self._parts)  # just past the bound: its ends only from now on
            self._parts = None
            self._head, self._tail = whole[:WINDOW], whole[-WINDOW:]
            return
        self._tail = (self._tail + data[-WINDOW:])[-WINDOW:]

    def usage(self) -> Usage | None:
        if self._parts is not None:
            return read(b"".join(self._parts))[0]
        return _search(self._tail, last=True) or _search(self._head, last=False)


def _search(window: bytes, *, last: bool) -> Usage | None:
    """The usage whose key is in `window` (the last of it, or the first)."""
    text = window.decode("latin-1")
    for key in _KEYS:
        k = key.decode()
        at = text.rfind(k) if last else text.find(k)
        if at < 0:
            continue
        if key == b'"tokens_predicted"':
            predicted = _value_after(text, at + len(k))
            evaluated_at = text.rfind('"tokens_evaluated"')
            evaluated = (
                _value_after(text, evaluated_at + len('"tokens_evaluated"'))
                if evaluated_at >= 0
                else None
            )
            return _counted(_int(evaluated), _int(predicted), None, None)
        return from_dict(_value_after(text, at + len(k)))
    return None


def _value_after(text: str, at: int) -> object:
    """The JSON value after the key ending at `at` (None if there is none in full)."""
    colon = text.find(":", at, at + 64)
    if colon < 0 or text[at:colon].strip():
        return None
    start = colon + 1
    while start < len(text) and text[start] in " \t\r\n":
        start += 1
    try:
        return _scanner.raw_decode(text, start)[0]
    except ValueError:
        return None
