"""Write tiny LoRA adapters in the layouts the engines load, with nothing but the standard
library: a PEFT directory (adapter_config.json and adapter_model.safetensors, vLLM's) and a
GGUF LoRA file (llama-server's).

The PEFT adapter fits the tiny model of llmgw/sim/tiny_hf.py (hidden 128, 2 layers; its
q_proj and v_proj both 128 wide): a real vLLM loads it and serves it by name. The GGUF one
says what a real llama-server checks (general.type "adapter", adapter.type "lora", the
architecture) around LoRA tensors of the tiny GGUF's shapes (llmgw/sim/tiny_gguf.py: 64
wide); the fake engine and the agent's scan read it.
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

PEFT_TARGETS = ("q_proj", "v_proj")


def _safetensors(tensors: dict[str, tuple[list[int], list[float]]]) -> bytes:
    """A safetensors file of F32 tensors: name -> (shape, values)."""
    header: dict[str, object] = {}
    data = bytearray()
    for name, (shape, values) in tensors.items():
        start = len(data)
        data += struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [start, len(data)]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw + bytes(data)


def write_peft_adapter(
    out: Path,
    *,
    rank: int = 8,
    hidden: int = 128,
    layers: int = 2,
    base: str = "llmgw-tiny",
    seed: int = 0,
) -> Path:
    """A PEFT LoRA directory for a Llama of `hidden` width and `layers` layers, its q_proj
    and v_proj adapted (their outputs `hidden` wide, as the tiny model's are)."""
    rng = random.Random(seed)
    tensors: dict[str, tuple[list[int], list[float]]] = {}
    for layer in range(layers):
        for target in PEFT_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            a = [rng.gauss(0.0, 0.02) for _ in range(rank * hidden)]
            b = [rng.gauss(0.0, 0.02) for _ in range(hidden * rank)]
            tensors[f"{prefix}.lora_A.weight"] = ([rank, hidden], a)
            tensors[f"{prefix}.lora_B.weight"] = ([hidden, rank], b)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_model.safetensors").write_bytes(_safetensors(tensors))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "target_modules": list(PEFT_TARGETS),
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _text(s: str) -> bytes:
    data = s.encode()
    return struct.pack("<Q", len(data)) + data


def write_gguf_lora(
    path: Path,
    *,
    rank: int = 4,
    embedding: int = 64,
    layers: int = 2,
    arch: str = "llama",
    seed: int | None = None,
) -> Path:
    """A GGUF LoRA adapter (v3) of F32 tensors: blk.N.attn_q.weight.lora_a (ggml ne
    [embedding, rank]) and .lora_b ([rank, embedding]) for each layer: zeros, or with a
    `seed` random values large enough that a real llama-server answers otherwise with it
    applied than without (a test can tell it was)."""
    kv = [
        (_text("general.architecture"), 8, _text(arch)),
        (_text("general.type"), 8, _text("adapter")),
        (_text("adapter.type"), 8, _text("lora")),
        (_text("adapter.lora.alpha"), 6, struct.pack("<f", float(2 * rank))),
    ]
    shapes = []
    for layer in range(layers):
        shapes.append((f"blk.{layer}.attn_q.weight.lora_a", [embedding, rank]))
        shapes.append((f"blk.{layer}.attn_q.weight.lora_b", [rank, embedding]))
    header = b"GGUF" + struct.pack("<IQQ", 3, len(shapes), len(kv))
    for key, vtype, value in kv:
        header += key + struct.pack("<I", vtype) + value
    offset = 0
    sizes = []
    for name, dims in shapes:
        header += _text(name) + struct.pack("<I", len(dims))
        header += b"".join(struct.pack("<Q", d) for d in dims)
        header += struct.pack("<IQ", 0, offset)  # ggml type 0: F32
        size = dims[0] * dims[1] * 4
        sizes.append(size)
        offset += size + (-size % 32)
    header += bytes(-len(header) % 32)
    rng = random.Random(seed)

    def values(size: int) -> bytes:
        if seed is None:
            return bytes(size)
        return struct.pack(f"<{size // 4}f", *(rng.gauss(0.0, 1.0) for _ in range(size // 4)))

    data = b"".join(values(size) + bytes(-size % 32) for size in sizes)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + data)
    return path
