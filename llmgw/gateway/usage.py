"""The engines' own `usage`, read from what they answer: a whole response's JSON, or the
last chunk of a stream asked for with `stream_options.include_usage`.

A stream's usage comes in a chunk of its own (empty `choices`) just before `[DONE]`; a
client that did not ask for it must not receive it (`strip`), but the router asks for it
on every stream so that none goes unmetered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

MAX_USAGE_JSON = 1 << 20  # a whole answer read for its usage: bigger is not parsed


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


def _int(value: object) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


def from_dict(usage: object) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
    return Usage(_int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")), cached)


class _Answer(msgspec.Struct):
    """What is read of an answer or a chunk: its usage, and whether it has choices. The
    rest (the generated text) is skipped, not decoded into objects."""

    usage: object = None
    choices: msgspec.Raw = msgspec.Raw(b"")


_decode_answer = msgspec.json.Decoder(_Answer).decode

_Count = Annotated[int, msgspec.Meta(ge=0)]


class _Details(msgspec.Struct):
    cached_tokens: _Count = 0


class _Usage(msgspec.Struct):
    prompt_tokens: _Count = 0
    completion_tokens: _Count = 0
    prompt_tokens_details: _Details | None = None


class _TypedAnswer(msgspec.Struct):
    """`_Answer` as engines write it: read straight into numbers. Anything else in these
    fields (a string, a negative count) fails here and is read leniently by `_Answer`."""

    usage: _Usage | None = None
    choices: msgspec.Raw = msgspec.Raw(b"")


_decode_typed = msgspec.json.Decoder(_TypedAnswer).decode


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
        if u is None:
            return None, False
        details = u.prompt_tokens_details
        found = Usage(u.prompt_tokens, u.completion_tokens, details.cached_tokens if details else 0)
        return found, _empty(typed.choices)
    try:
        doc = _decode_answer(data)
    except msgspec.DecodeError:
        return None, False
    found = from_dict(doc.usage)
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
