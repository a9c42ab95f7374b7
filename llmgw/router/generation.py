"""How much a request may make an engine generate, read from its body the way llama-server
and vLLM read it: what a gateway reserves before the request runs (router/keygate.py).

The engines read the same fields differently (checked in their code, late 2026):
- One answer's cap. vLLM's chat takes `max_completion_tokens`, else `max_tokens`; its
  completions `max_tokens` (16 when absent); its responses `max_output_tokens`; absent or
  null, the rest of the context. It reads them with pydantic's lax ints: "100", " 1_000",
  1e3, 100.0 and true are numbers to it, 100.5 and "1e3" are refused, -5 is taken.
  llama-server takes `n_predict`, else `max_completion_tokens`, else `max_tokens` (its
  responses route moves `max_output_tokens` into `max_tokens`), with nlohmann::json: a
  float is cut to an int, a bool is 0 or 1, a 64-bit integer wraps to 32 bits, a string is
  skipped for the next field, and -1 (its default) generates until the context is full.
- How many answers. `n` (vLLM's choices, or its beam width), `n_cmpl` then `n`
  (llama-server), `best_of` (older vLLM completions), and each prompt of a completions'
  list of prompts, each generated alone.

So a cap is read only in the one form both read alike, a JSON integer from 1 to 2**31-1
(or a float with no fraction), and as the larger of the two engines' picks. A cap in any
other form is odd: the gateway then reserves what the engine may generate (the model's
context), never a small number. A count of answers in another form is refused.
"""

from __future__ import annotations

import msgspec

MAX_INT = 2**31 - 1  # both engines hold these counts in 32 bits

_decode_items = msgspec.json.Decoder(list[msgspec.Raw]).decode


class BadCount(ValueError):
    """A count of answers (`n`, `n_cmpl`, `best_of`) in a form the router will not guess."""


def _plain(value: object) -> int | None:
    """`value` as a count both engines read alike; None for any other form."""
    if type(value) is int:
        return value if 1 <= value <= MAX_INT else None
    if type(value) is float and value.is_integer() and 1 <= value <= MAX_INT:
        return int(value)
    return None


def _absent(value: object) -> bool:
    return value is None or value is msgspec.UNSET


def size(
    route: str,
    max_tokens: object,
    max_completion_tokens: object,
    max_output_tokens: object,
    n_predict: object,
) -> tuple[int | None, bool]:
    """The cap of one answer on `route` ("chat", "completions", "responses", "infill") as
    every engine reads it (None: left to the engine), and whether a cap is given in a form
    some engine reads otherwise (`odd`: reserve the most it may generate). The fields are
    as decoded: msgspec.UNSET where absent, None where null."""
    caps = (max_tokens, max_completion_tokens, max_output_tokens, n_predict)
    if caps.count(msgspec.UNSET) + caps.count(None) == 4:
        return None, False  # the common case: no cap, the engine's default
    if any(not _absent(v) and _plain(v) is None for v in caps):
        return None, True
    mt, mct, mot, npr = map(_plain, caps)
    if route == "chat":
        vllm = mct if mct is not None else mt
    elif route == "completions":
        vllm = mt if not _absent(max_tokens) else 16 if max_tokens is msgspec.UNSET else None
    elif route == "responses":
        vllm = mot
    else:
        vllm = 0  # vLLM serves no /infill: llama-server's pick alone
    # llama-server's responses route moves `max_output_tokens`, even a null one, into max_tokens
    given = max_output_tokens is not msgspec.UNSET
    llama_last = mot if route == "responses" and given else mt
    llama = next((v for v in (npr, mct, llama_last) if v is not None), None)
    if vllm is None or llama is None:
        return None, False  # the engine's default: the rest of the context
    return max(vllm, llama), False


def _count(value: object, name: str) -> int:
    if _absent(value):
        return 1
    n = _plain(value)
    if n is None:
        raise BadCount(
            f"`{name}` must be a whole number from 1 to {MAX_INT} (got {value!r}): the "
            "engines read other forms differently"
        )
    return n


def answers(n: object, n_cmpl: object, best_of: object, prompt: msgspec.Raw | None) -> int:
    """How many answers a request generates: the most any engine reads from its counts,
    times the prompts of a completions' list of prompts (`prompt`; None on other routes)."""
    if (n, n_cmpl, best_of).count(msgspec.UNSET) == 3 and not prompt:
        return 1  # the common case
    copies = max(_count(n, "n"), _count(n_cmpl, "n_cmpl"), _count(best_of, "best_of"))
    return copies * (_prompts(prompt) if prompt else 1)


def _prompts(raw: msgspec.Raw) -> int:
    """The prompts of a completions' `prompt`: one for a string or a list of token ids,
    each element of a list of strings or of token lists (vLLM refuses a mix; llama-server
    takes it as one prompt: counting its strings reserves the more)."""
    data = bytes(raw)
    if data[:1] != b"[":
        return 1
    try:
        items = _decode_items(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return 1  # not a list: the engine refuses it
    return max(1, sum(1 for item in items if bytes(item)[:1] in (b'"', b"[", b"{")))
