"""A LoRA adapter as a model to clients: which engines serve it, and what a request for it
becomes on the way to one and back. Pure, no I/O.

A request names the adapter as its `model`. Its engines are its base's ready replicas whose
shard says the adapter is loaded there (the router sends it nowhere else: vLLM answers 404
for a name it has not loaded). A vLLM engine serves it by that name as it is; a
llama-server engine serves its base model and applies one of the adapters it was started
with per request: the router puts `"lora": [{"id": N, "scale": 1.0}]` in the body (N: the
adapter's place in the engine's `--lora` list, from its shard) and writes the adapter's name
back where the engine's answer says its base's (`"model": ...`), so the client sees the
name it asked for. A request for the base itself, to a llama-server started with adapters,
gets `"lora": [{"id": 0, "scale": 0.0}]`: llama-server leaves every adapter at scale 1.0
despite `--lora-init-without-apply` and applies them all to a request naming none
(llama.cpp issue 28674), while an adapter a request's list leaves out is at 0. A body that names `lora` itself for a model with adapters is refused:
which adapter runs is the router's to say, or a key given the base alone would reach its
adapters by number.

"Crowded" is when every engine holding the adapter carries more than its share of its
base's requests (the bounded load of llmgw/router/balancer.py) while another engine of the
base has room: the request still goes to the least busy of them, and the router's load
record asks the controller for one more replica with the adapter (it is "waiting" there).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

# how busy the engines with an adapter may be, against their base's average, before the
# router asks for the adapter elsewhere: the balancer's affinity_load_factor
CROWDED_FACTOR = 1.25


@dataclass
class AdapterRoute:
    """What a route to an adapter needs beyond its engines (Route.backends)."""

    adapter: str  # its id (adapters.<id>)
    name: str  # its served name
    base: str  # the base model's id
    base_name: str  # the base's served name: what a llama-server answers with
    lora_ids: dict[str, int] = field(default_factory=dict)  # llama-server replica -> its id
    base_backends: Sequence[object] = ()  # every engine of the base (Backends)

    def body(self, backend_id: str, body: bytes) -> bytes:
        """The body an engine gets: llama-server's with the adapter applied."""
        lora_id = self.lora_ids.get(backend_id)
        if lora_id is None:
            return body
        return with_lora(body, lora_id, 1.0)

    def answer(self, backend_id: str) -> NameSwap | None:
        """How the engine's answer is rewritten on the way back (None: as it is)."""
        if backend_id not in self.lora_ids:
            return None
        return NameSwap(self.base_name, self.name)

    def crowded(self, chosen: Sequence[object]) -> bool:
        """Every engine with the adapter busier than its share while one of the base, without
        it, is not (the module's docstring)."""
        from llmgw.router.balancer import load_cap  # (the balancer imports the table, this)

        base = list(self.base_backends)
        if len(base) <= len(chosen) or not chosen:
            return False
        cap = load_cap(sum(b.in_flight for b in base), len(base), CROWDED_FACTOR)  # type: ignore[attr-defined]
        holders = {id(b) for b in chosen}
        return all(b.in_flight >= cap for b in chosen) and any(  # type: ignore[attr-defined]
            b.in_flight < cap
            for b in base
            if id(b) not in holders  # type: ignore[attr-defined]
        )


def with_lora(body: bytes, lora_id: int, scale: float) -> bytes:
    """`body` (a JSON object, as the request parser found it) with llama-server's per-request
    adapter in front of its other fields (at `scale`; every other adapter at 0)."""
    start = body.find(b"{")
    field_ = b'"lora":[{"id":%d,"scale":%r}]' % (lora_id, scale)
    rest = body[start + 1 :]
    joiner = b"," if rest.lstrip()[:1] != b"}" else b""
    return body[: start + 1] + field_ + joiner + rest


def without_lora(body: bytes) -> bytes:
    """A base request's body for a llama-server started with adapters: none applied (the
    module's docstring)."""
    return with_lora(body, 0, 0.0)


def served_ids(shard_adapters: Sequence[str]) -> dict[str, int]:
    """adapter id -> its place in an engine's list (llama-server's `--lora` order)."""
    return {aid: i for i, aid in enumerate(shard_adapters) if aid}


class NameSwap:
    """Rewrites `"model": "<base>"` as `"model": "<adapter>"` in an answer as it passes,
    whole or streamed, whichever pieces it comes in: a match cut between two pieces is held
    back until the next one (only ever a few bytes, and never the end of an event)."""

    def __init__(self, base: str, name: str) -> None:
        olds, news = [], []
        for sep in (b":", b": "):
            for ascii_only in (False, True):
                olds.append(b'"model"' + sep + json.dumps(base, ensure_ascii=ascii_only).encode())
                news.append(b'"model"' + sep + json.dumps(name, ensure_ascii=False).encode())
        self._pairs = sorted(dict(zip(olds, news, strict=True)).items(), key=lambda p: -len(p[0]))
        self._longest = max(len(o) for o, _ in self._pairs)
        self._held = b""

    def __call__(self, data: bytes, last: bool) -> bytes:
        data = self._held + data
        self._held = b""
        for old, new in self._pairs:
            if old in data:
                data = data.replace(old, new)
        if not last:
            keep = self._partial(data)
            if keep:
                data, self._held = data[:-keep], data[-keep:]
        return data

    def _partial(self, data: bytes) -> int:
        """The longest end of `data` that begins a match (to wait for the rest)."""
        for n in range(min(self._longest - 1, len(data)), 0, -1):
            tail = data[-n:]
            if any(old.startswith(tail) for old, _ in self._pairs):
                return n
        return 0


def swapping(swap: NameSwap, write: Callable[[bytes, bool], bool]) -> Callable[[bytes, bool], bool]:
    """`write` with each piece rewritten by `swap` first."""

    def swapped(data: bytes, last: bool) -> bool:
        return write(swap(data, last), last)

    return swapped


def refusal_of(failures: Mapping[str, str]) -> str:
    """Why an adapter is loaded nowhere when engines refused it: each node's engine's words."""
    return "; ".join(
        f"the engine on {node} would not load it: {why}" for node, why in failures.items()
    )
