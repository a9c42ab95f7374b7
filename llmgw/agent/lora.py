"""The LoRA adapters of one engine: which it serves, and those it would not take.

vLLM (`LoraSync`): the agent loads and unloads adapters on the running engine
(`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`; VLLM_ALLOW_RUNTIME_LORA_UPDATING), with
no restart, to what its assignment asks. An adapter leaving is first left out of the shard
record, so routers stop sending it there, and unloaded only once the engine says it runs
and queues nothing for it (`vllm:lora_requests_info`) and `settle_s` has passed (what a
router sent just before it read the record has reached the engine by then): an adapter
with requests in flight is never unloaded. One the engine refuses (another base, a rank
over its room, incomplete files) is reported once with the engine's own words, and tried
again only when its assignment changes it; the engine keeps serving its base.

llama-server (`started_with`): its adapters are given at start (`--lora`), those the
node holds complete and made for the base's architecture; the others are reported, and
the engine starts without them rather than refusing to start.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from llmgw.agent.discovery.weights.formats import gguf_metadata
from llmgw.agent.engines import vllm
from llmgw.agent.engines.base import LaunchSpec
from llmgw.agent.files import open_regular
from llmgw.bus.records import AdapterAssigned, AdapterFailure, HeldAdapter

log = logging.getLogger(__name__)

SETTLE_S = 2.0  # after an adapter left the shard record, before it is unloaded

# (status, body) of one request to the engine, None when it did not answer
Ask = Callable[[str, str, bytes | None], Awaitable[tuple[int, bytes] | None]]


@dataclass
class LoraSync:
    """One vLLM engine's adapters, kept to what its assignment asks while it serves. `ask`
    sends one request to the engine (the supervisor's session); the clock is passed in."""

    ask: Ask
    clock: Callable[[], float] = time.monotonic
    settle_s: float = SETTLE_S
    loaded: dict[str, AdapterAssigned] = field(default_factory=dict)  # id -> as loaded
    failed: dict[str, tuple[AdapterAssigned, AdapterFailure]] = field(default_factory=dict)
    leaving: dict[str, tuple[AdapterAssigned, float]] = field(default_factory=dict)
    known: bool = False  # the engine's own list was read (after a start or an adoption)

    def served(self) -> list[str]:
        """What the shard record says it serves: loaded, and not leaving."""
        return sorted(self.loaded)

    def failures(self) -> list[AdapterFailure]:
        return [f for _, f in sorted(self.failed.values(), key=lambda x: x[1].adapter)]

    def engine_restarted(self) -> None:
        """A new engine process: it has nothing loaded."""
        self.loaded.clear()
        self.leaving.clear()
        self.known = False

    @property
    def pending(self) -> bool:
        """Adapters still to unload: look again in a while."""
        return bool(self.leaving)

    async def sync(self, want: Sequence[AdapterAssigned]) -> bool:
        """One look: unload what left (when it may), load what is new. True when what the
        shard record says changed. Requests the engine does not answer are tried again at
        the next look."""
        before = (self.served(), self.failures())
        if not self.known and not await self._read_engine(want):
            return False
        wanted = {a.id: a for a in want}
        for aid, have in list(self.loaded.items()):
            if not _same(wanted.get(aid), have):
                del self.loaded[aid]
                self.leaving[aid] = (have, self.clock())
        for aid in [a for a, (had, _) in self.failed.items() if not _same(wanted.get(a), had)]:
            del self.failed[aid]  # changed or gone: tried again if asked again
        await self._unload_settled()
        for aid, adapter in wanted.items():
            if aid in self.loaded or aid in self.failed:
                continue
            left = self.leaving.get(aid)
            if left is not None and _same(adapter, left[0]):
                self.loaded[aid] = left[0]  # asked for again before it was unloaded
                del self.leaving[aid]
                continue
            if left is not None or any(a.name == adapter.name for a, _ in self.leaving.values()):
                continue  # its name is still loaded from elsewhere: unloaded first
            await self._load(adapter)
        return (self.served(), self.failures()) != before

    async def _read_engine(self, want: Sequence[AdapterAssigned]) -> bool:
        got = await self.ask("GET", "/v1/models", None)
        listed = vllm.loaded_loras(got[1]) if got is not None and got[0] == 200 else None
        if listed is None:
            return False
        by_name = {a.name: a for a in want}
        now = self.clock()
        for name, path in listed.items():
            mine = by_name.get(name)
            if mine is not None and mine.path.rstrip("/") == path.rstrip("/"):
                self.loaded[mine.id] = mine  # an adopted engine's: kept as it is
            else:
                # loaded by an earlier agent, no longer asked for: left as any other
                self.leaving[f"~{name}"] = (
                    AdapterAssigned(id=f"~{name}", name=name, path=path),
                    now - self.settle_s,
                )
        self.known = True
        return True

    async def _unload_settled(self) -> None:
        due = {
            aid: a for aid, (a, at) in self.leaving.items() if self.clock() - at >= self.settle_s
        }
        if not due:
            return
        got = await self.ask("GET", "/metrics", None)
        busy = vllm.loras_in_use(got[1].decode("utf-8", "replace")) if got else None
        for aid, adapter in due.items():
            if busy is None or adapter.name in busy:
                continue  # requests in flight for it (or the engine does not say): later
            answer = await self.ask("POST", vllm.UNLOAD_LORA, vllm.lora_unload_body(adapter.name))
            if answer is None:
                continue
            if answer[0] != 200 and answer[0] != 404:  # 404: not loaded (any more)
                log.warning(
                    "unloading adapter %s: engine answered %d: %s",
                    adapter.name,
                    answer[0],
                    vllm.answer_message(answer[1]),
                )
                continue
            del self.leaving[aid]
            log.info("unloaded LoRA adapter %s", adapter.name)

    async def _load(self, adapter: AdapterAssigned) -> None:
        answer = await self.ask(
            "POST", vllm.LOAD_LORA, vllm.lora_load_body(adapter.name, adapter.path)
        )
        if answer is None:
            return  # the engine did not answer: the next look tries again
        status, body = answer
        if status == 200:
            self.loaded[adapter.id] = adapter
            log.info("loaded LoRA adapter %s from %s", adapter.name, adapter.path)
            return
        message = vllm.answer_message(body)
        self.failed[adapter.id] = (
            adapter,
            AdapterFailure(adapter=adapter.id, reason=message, at=time.time()),
        )
        log.warning("engine would not load LoRA adapter %s: %s", adapter.name, message)


def _same(a: AdapterAssigned | None, b: AdapterAssigned) -> bool:
    return a is not None and (a.name, a.path) == (b.name, b.path)


# --- llama-server: adapters given at start ------------------------------------------------


def started_with(
    spec: LaunchSpec, want: Sequence[AdapterAssigned], held: Mapping[str, HeldAdapter]
) -> tuple[LaunchSpec, list[AdapterFailure]]:
    """The launch with the adapters llama-server can take (`held`: this node's, by path),
    and why each other one is left out: llama-server refuses to start at all with an
    adapter of another architecture, so it is checked here first. Reads the base's GGUF
    header (a worker thread's job)."""
    now = time.time()
    failures = []
    base_arch = _architecture(spec.weights_path) if spec.weights_path else ""
    files = []
    for a in want:
        h = held.get(a.path.rstrip("/"))
        if h is None:
            why = (
                f"{a.path} is not held complete on this node (the scan finds no GGUF adapter there)"
            )
        elif base_arch and h.base and h.base != base_arch:
            why = (
                f"{a.path} is a LoRA for architecture {h.base!r}, and the base model is "
                f"{base_arch!r}: an adapter of another base"
            )
        else:
            files.append((a.id, a.path))
            continue
        failures.append(AdapterFailure(adapter=a.id, reason=why, at=now))
    return replace(spec, lora_files=tuple(files)), failures


def _architecture(path: str) -> str:
    try:
        with open_regular(path, buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            found = gguf_metadata(f, size, lambda key: key == "general.architecture")
    except (OSError, ValueError):
        return ""  # the launch's own validation says what is wrong with the file
    value = found.get("general.architecture")
    return value if isinstance(value, str) else ""


def adopted_files(
    argv: Sequence[str], want: Sequence[AdapterAssigned]
) -> tuple[tuple[str, str], ...]:
    """The adapters a llama-server an earlier agent left was started with, from its command
    line (`--lora FILE`, in order: the ids its requests name), by the id its assignment
    gives each file ("" for a file it no longer names: served by nobody)."""
    by_path = {a.path.rstrip("/"): a.id for a in want}
    files = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--lora"]
    return tuple((by_path.get(path.rstrip("/"), ""), path) for path in files)
