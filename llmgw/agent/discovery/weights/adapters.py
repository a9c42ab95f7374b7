"""LoRA adapters in a PEFT directory: `adapter_config.json` beside the adapter's weights
(`adapter_model.safetensors`, or PyTorch's `adapter_model.bin`), what vLLM loads. Complete
when the weights are (safetensors: by their header, as any; a .bin, which says nothing of
its own length: when it is there and not empty); the config says the rank (`r`) and the base
it was trained on (`base_model_name_or_path`). GGUF adapters (llama-server's) are GGUF files
whose header says `general.type = "adapter"` (formats.check_gguf).

Pure but for `peft_config`, which reads one small file, bounded."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from llmgw.agent.discovery.weights.formats import Check, combine
from llmgw.agent.files import TooLarge, read_bounded

ADAPTER_CONFIG = "adapter_config.json"
SAFETENSORS_WEIGHTS = "adapter_model.safetensors"
BIN_WEIGHTS = "adapter_model.bin"
MAX_CONFIG_BYTES = 1 << 20  # a PEFT config is a few hundred bytes


@dataclass(frozen=True, slots=True)
class PeftConfig:
    rank: int  # 0: the config does not say
    base: str  # "" when it does not say


class _Config(msgspec.Struct):
    r: object = None
    base_model_name_or_path: object = None


_decode = msgspec.json.Decoder(_Config).decode


def parse_peft_config(data: bytes) -> PeftConfig | None:
    """What an adapter_config.json says; None when it is no JSON object."""
    try:
        raw = _decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    rank = raw.r if isinstance(raw.r, int) and not isinstance(raw.r, bool) and raw.r > 0 else 0
    base = raw.base_model_name_or_path
    return PeftConfig(rank=min(rank, 1 << 20), base=base[:200] if isinstance(base, str) else "")


def peft_config(directory: Path, st: os.stat_result | None = None) -> PeftConfig | None:
    """The config of the PEFT directory `directory`; None when it is absent or unreadable."""
    try:
        return parse_peft_config(read_bounded(directory / ADAPTER_CONFIG, MAX_CONFIG_BYTES))
    except (OSError, TooLarge):
        return None


def is_peft(files: Sequence[str]) -> bool:
    """A directory whose files are those of a PEFT adapter (its config names it one)."""
    return ADAPTER_CONFIG in files


def check_peft(
    directory: Path,
    files: Sequence[str],
    check_safetensors: Callable[[list[str]], Iterator[Check]],
    config: PeftConfig | None,
) -> Check:
    """A PEFT directory: complete when its config reads and its weights are complete."""
    if config is None:
        return Check(complete=False, file=ADAPTER_CONFIG, problem="does not read as JSON")
    if SAFETENSORS_WEIGHTS in files:
        weights = combine(check_safetensors([str(directory / SAFETENSORS_WEIGHTS)]))
    elif BIN_WEIGHTS in files:
        try:
            size = os.stat(directory / BIN_WEIGHTS).st_size
        except OSError:
            size = 0
        weights = (
            Check(complete=True, bytes=size, files=1)
            if size
            else Check(complete=False, file=BIN_WEIGHTS, problem="empty")
        )
    else:
        return Check(complete=False, file=SAFETENSORS_WEIGHTS, problem="missing")
    if not weights.complete:
        return weights
    return Check(
        complete=True,
        bytes=weights.bytes,
        files=weights.files + 1,
        adapter=True,
        arch=config.base,
        rank=config.rank,
    )
