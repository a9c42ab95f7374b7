"""Test helpers that run real processes: a fake llama-server / vLLM.

`install_fake_engines` is imported lazily so `python -m llmgw.sim.fake_engine`
does not import the module twice.
"""

from __future__ import annotations

from typing import Any

__all__ = ["free_port", "install_fake_engines", "write_fake_gguf"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from llmgw.sim import fake_engine

        return getattr(fake_engine, name)
    raise AttributeError(name)
