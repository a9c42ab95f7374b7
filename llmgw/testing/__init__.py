"""Test helpers that run real processes: a fake llama-server / vLLM.

`install_fake_engines` is imported lazily so `python -m llmgw.testing.fake_engine`
does not import the module twice.
"""

from __future__ import annotations

from typing import Any

__all__ = ["install_fake_engines"]


def __getattr__(name: str) -> Any:
    if name == "install_fake_engines":
        from llmgw.testing.fake_engine import install_fake_engines

        return install_fake_engines
    raise AttributeError(name)
