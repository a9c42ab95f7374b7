"""How llama-server and vLLM read the fields of a request that say how much to generate,
for the fake engine (fake_engine.py) to generate what a real one would from the same body,
odd forms included: the router's reading (router/generation.py) is tested against these.

- vLLM validates with pydantic in lax mode: an int field takes 100, 100.0, 1e3, true,
  "100", " 1_000 ", "+5" and "100.0", and refuses 100.5 and "1e3" (a 400); a bool field
  takes true, 1, 1.0, "yes", "on", "1", "t"... and refuses 2 or "" (a 400).
- llama-server reads with nlohmann::json's get<T>: a number or a bool becomes an int (a
  float cut, an integer wrapped to 32 bits), a bool field takes only true or false, and a
  value of another type is skipped for the field's default.
"""

from __future__ import annotations

import re

_LAX_INT = re.compile(r"^\s*[+-]?[0-9](?:_?[0-9])*(?:\.0*)?\s*$")
_TRUE = frozenset(("1", "on", "t", "true", "y", "yes"))
_FALSE = frozenset(("0", "off", "f", "false", "n", "no"))


class Refused(ValueError):
    """vLLM's 400 for a value its request model does not take."""


def vllm_int(value: object, name: str) -> int:
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and _LAX_INT.match(value):
        return int(float(value.strip().replace("_", "")))
    raise Refused(f"{name}: Input should be a valid integer, got {value!r}")


def vllm_bool(value: object, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise Refused(f"{name}: Input should be a valid boolean, got {value!r}")


def llama_int(value: object) -> int | None:
    """nlohmann's get<int>: None where it throws (the field's default is used)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return (value + 2**31) % 2**32 - 2**31
    if isinstance(value, float):
        return int(value) if abs(value) < 2**31 else -(2**31)
    return None


def _given(body: dict, name: str) -> bool:
    return name in body and body[name] is not None


def cap(kind: str, route: str, body: dict) -> int | None:
    """The most one answer may generate as `kind` reads `body` on `route` ("chat",
    "completions", "responses", "infill"); None: until the model stops (or the context is
    full). Raises Refused where vLLM answers 400."""
    if kind == "vllm":
        name = {"chat": "max_completion_tokens", "responses": "max_output_tokens"}.get(
            route, "max_tokens"
        )
        if not _given(body, name) and route == "chat":
            name = "max_tokens"
        if not _given(body, name):
            return None
        n = vllm_int(body[name], name)
        if n < 1:
            raise Refused(f"{name} must be at least 1, got {n}")
        return n
    last = "max_tokens"
    if route == "responses" and "max_output_tokens" in body:
        last = "max_output_tokens"  # moved into max_tokens before it is read
    for name in ("n_predict", "max_completion_tokens", last):
        if _given(body, name):
            n = llama_int(body[name])
            if n is not None:
                return n if n > 0 else None  # -1: until the context is full
    return None


def streams(kind: str, body: dict) -> bool:
    value = body.get("stream")
    if value is None:
        return False
    if kind == "vllm":
        return vllm_bool(value, "stream")
    return value is True


def choices(kind: str, body: dict) -> int:
    """How many answers of each prompt: vLLM's `n`, llama-server's `n_cmpl` then `n`."""
    if kind == "vllm":
        n = vllm_int(body["n"], "n") if _given(body, "n") else 1
        if n < 1:
            raise Refused(f"n must be at least 1, got {n}")
        return n
    for name in ("n_cmpl", "n"):
        if _given(body, name):
            n = llama_int(body[name])
            if n is not None:
                return max(1, n)
    return 1
