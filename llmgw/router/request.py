"""What the router reads from a request body: the model, and the key that keeps a
conversation on one replica. The body itself is forwarded unchanged.

The affinity key must be the same for every turn of one conversation and on every router,
with no state shared between them:
- the request's `user` field, or the session header (`x-session-id` by default), when given;
- chat: the messages up to and including the first user message (the system prompt and
  the opening question stay the same while the conversation grows behind them);
- completions: the first `PROMPT_PREFIX` bytes of the prompt (a growing prompt keeps them);
- embeddings: none (an embedding keeps no cache worth returning to).
Conversations that open identically share a key; bounded load spreads them when that
makes one replica too busy (llmgw/router/balancer.py).
"""

from __future__ import annotations

import msgspec

from llmgw.router.table import stable_hash

PROMPT_PREFIX = 1024  # bytes of a completions prompt that decide its replica
ANCHOR_LIMIT = 64 * 1024  # at most this much of the opening messages is hashed


class BadRequest(Exception):
    """The body cannot be routed: the client gets a 400 with this message."""


class _Body(msgspec.Struct):
    model: object = None
    stream: object = None
    user: object = None
    # kept as raw JSON, read only as far as the affinity key needs; empty when absent
    messages: msgspec.Raw = msgspec.Raw(b"")
    prompt: msgspec.Raw = msgspec.Raw(b"")


class _Role(msgspec.Struct):
    role: object = None


_decode_body = msgspec.json.Decoder(_Body).decode
_decode_messages = msgspec.json.Decoder(list[msgspec.Raw]).decode
_decode_role = msgspec.json.Decoder(_Role).decode


class Parsed(msgspec.Struct, frozen=True):
    model: str
    stream: bool
    affinity: int | None


def parse(body: bytes, *, chat: bool, embeddings: bool, session: bytes | None) -> Parsed:
    if not body:
        raise BadRequest("the request has no body: send a JSON object with a `model`")
    try:
        parsed = _decode_body(body)
    except msgspec.ValidationError:
        raise BadRequest("the body must be a JSON object") from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        # msgspec stops at the interpreter's depth limit (about 1,000); no request nests so
        raise BadRequest("the body nests JSON too deeply to be a request") from None
    if not isinstance(parsed.model, str) or not parsed.model:
        raise BadRequest("`model` is missing or not a string: set it to a name /v1/models lists")
    return Parsed(
        model=parsed.model,
        stream=parsed.stream is True,
        affinity=None if embeddings else _affinity(parsed, chat, session),
    )


def _affinity(parsed: _Body, chat: bool, session: bytes | None) -> int | None:
    if isinstance(parsed.user, str) and parsed.user:
        return stable_hash(b"user:" + parsed.user.encode())
    if session:
        return stable_hash(b"session:" + session)
    if chat and len(parsed.messages):
        return _opening_hash(parsed.messages)
    if not chat and len(parsed.prompt):
        return stable_hash(b"prompt:" + bytes(parsed.prompt)[:PROMPT_PREFIX])
    return None


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
