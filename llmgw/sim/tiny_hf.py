"""Write a tiny Hugging Face model directory with random weights that a real vLLM serves.

A 2-layer LlamaForCausalLM (hidden 128, 2 heads of 64) with a byte-level BPE tokenizer
trained here on a few lines of text, and a ChatML chat template: 0.5 MB, loaded in well
under a second. Output is gibberish but real: tokens are sampled, detokenized and
streamed like any model's.

It needs torch, transformers and tokenizers, which a vLLM environment has and llmgw's
does not, so it runs as a script under vLLM's python and imports nothing of llmgw:

    /path/to/vllm-env/bin/python llmgw/sim/tiny_hf.py OUT_DIR [--head-dim 64] [--context 1024]

vLLM's CPU attention kernel takes head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224,
256 and 512; `--head-dim 16` makes a model it refuses at the first request (a real fatal
engine-core error, for tests).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Training text for the tokenizer: the words tests send, and enough else to give merges.
CORPUS = [
    "hello hi there how are you today the quick brown fox jumps over the lazy dog",
    "user assistant system message content role reply answer question tell me a story",
    "one two three four five six seven eight nine ten zero numbers count again once more",
    "a model serves tokens streams usage prompt completion cache prefix repeated words",
] * 8


def write_tiny_model(out: Path, *, head_dim: int = 64, context: int = 1024, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=context,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(out)

    heads = 2
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=heads * head_dim,
        intermediate_size=2 * heads * head_dim,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=context,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    # transformers may write a generation_config.json with sampling defaults; vLLM reads it
    # as the model's defaults, so keep it plain.
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id})
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    print(write_tiny_model(args.out, head_dim=args.head_dim, context=args.context))


if __name__ == "__main__":
    main()
