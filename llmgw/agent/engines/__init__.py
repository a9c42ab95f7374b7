"""Engine adapters: one per engine, each turning a LaunchSpec into a command."""

from __future__ import annotations

from llmgw.agent.engines.base import EngineAdapter, EngineCommand, EngineName, LaunchSpec, Probe
from llmgw.agent.engines.llama_server import LlamaServerAdapter
from llmgw.agent.engines.vllm import VllmAdapter

_ADAPTERS: dict[str, EngineAdapter] = {
    "llama-server": LlamaServerAdapter(),
    "vllm": VllmAdapter(),
}


def adapter_for(engine: str) -> EngineAdapter:
    try:
        return _ADAPTERS[engine]
    except KeyError:
        raise ValueError(
            f"unknown engine {engine!r}; llmgw runs {', '.join(sorted(_ADAPTERS))}"
        ) from None


__all__ = ["EngineAdapter", "EngineCommand", "EngineName", "LaunchSpec", "Probe", "adapter_for"]
