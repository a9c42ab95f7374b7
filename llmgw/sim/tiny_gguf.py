"""Write a tiny llama-architecture GGUF with random weights that a real llama-server loads.

The tokenizer (every `tokenizer.*` key) is copied from a vocab-only GGUF such as
llama.cpp's models/ggml-vocab-llama-spm.gguf, which tools/build-llama-server.sh puts
next to the binary. Output is gibberish but real: tokens are sampled, detokenized and
streamed like any model's, in a tenth of a second of load time.

    python -m llmgw.sim.tiny_gguf VOCAB.gguf OUT.gguf
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

# Without a template llama-server falls back to a built-in guess; an explicit ChatML
# template keeps chat requests formatted the same on every build.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyShape:
    embedding: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    feed_forward: int = 128
    context: int = 4096  # llama-server caps -c at the trained context


class VocabError(ValueError):
    """The vocabulary file is missing or carries no tokenizer."""


def read_tokenizer(
    vocab_path: Path,
) -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """Every `tokenizer.*` key of a GGUF as (key, value, type, array element type)."""
    if not vocab_path.is_file():
        raise VocabError(
            f"vocabulary GGUF {vocab_path} not found; run tools/build-llama-server.sh, which "
            "copies one next to the llama-server binary"
        )
    reader = gguf.GGUFReader(vocab_path)
    entries = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        entries.append((key, field.contents(), vtype, sub_type))
    if not any(key == "tokenizer.ggml.tokens" for key, *_ in entries):
        raise VocabError(f"{vocab_path} has no tokenizer.ggml.tokens: not a vocabulary GGUF")
    return entries


def write_tiny_gguf(
    vocab_path: Path, out_path: Path, shape: TinyShape = TinyShape(), seed: int = 0
) -> Path:
    """Write a random-weight llama model using the tokenizer of `vocab_path`; returns out_path."""
    tokenizer = read_tokenizer(vocab_path)
    n_vocab = next(len(value) for key, value, *_ in tokenizer if key == "tokenizer.ggml.tokens")
    head_dim = shape.embedding // shape.heads
    kv_dim = head_dim * shape.kv_heads
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        # float16 like real conversions; numpy's (rows, cols) is ggml's ne = [cols, rows].
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16)

    def norm() -> np.ndarray:
        return np.ones(shape.embedding, dtype=np.float32)

    writer = gguf.GGUFWriter(out_path, "llama")
    writer.add_name("llmgw-tiny-random")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.embedding)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.feed_forward)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value, vtype, sub_type in tokenizer:
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    if not any(key == "tokenizer.chat_template" for key, *_ in tokenizer):
        writer.add_chat_template(CHATML_TEMPLATE)

    # No output.weight: llama ties it to token_embd, which halves the file.
    writer.add_tensor("token_embd.weight", matrix(n_vocab, shape.embedding))
    writer.add_tensor("output_norm.weight", norm())
    for i in range(shape.layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        writer.add_tensor(f"blk.{i}.attn_q.weight", matrix(shape.embedding, shape.embedding))
        writer.add_tensor(f"blk.{i}.attn_k.weight", matrix(kv_dim, shape.embedding))
        writer.add_tensor(f"blk.{i}.attn_v.weight", matrix(kv_dim, shape.embedding))
        writer.add_tensor(f"blk.{i}.attn_output.weight", matrix(shape.embedding, shape.embedding))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", matrix(shape.feed_forward, shape.embedding))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", matrix(shape.feed_forward, shape.embedding))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", matrix(shape.embedding, shape.feed_forward))

    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "vocab", type=Path, help="a vocab-only GGUF, e.g. ggml-vocab-llama-spm.gguf"
    )
    parser.add_argument("out", type=Path, help="where to write the tiny model")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_tiny_gguf(args.vocab, args.out, seed=args.seed))


if __name__ == "__main__":
    main()
