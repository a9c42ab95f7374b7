"""The tiny random-weight GGUF writer, checked by reading its output back with gguf."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from llmgw.sim.tiny_gguf import TinyShape, VocabError, write_tiny_gguf

TOKENS = ["<unk>", "<s>", "</s>", "▁hello", "▁world", "!"]


def _write_vocab(path: Path, *, with_template: bool = False) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(TOKENS)
    writer.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0, -3.0])
    writer.add_token_types([2, 3, 3, 1, 1, 1])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    if with_template:
        writer.add_chat_template("{{ messages[0]['content'] }}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_model_carries_every_tokenizer_key_of_the_vocabulary(tmp_path: Path):
    vocab = _write_vocab(tmp_path / "vocab.gguf")

    model = gguf.GGUFReader(write_tiny_gguf(vocab, tmp_path / "tiny.gguf"))

    fields = model.fields
    assert fields["tokenizer.ggml.tokens"].contents() == TOKENS
    assert fields["tokenizer.ggml.scores"].contents() == [0.0, 0.0, 0.0, -1.0, -2.0, -3.0]
    assert fields["tokenizer.ggml.token_type"].contents() == [2, 3, 3, 1, 1, 1]
    assert fields["tokenizer.ggml.bos_token_id"].contents() == 1
    assert fields["tokenizer.ggml.add_bos_token"].contents() is True
    assert "im_start" in fields["tokenizer.chat_template"].contents()


def test_vocabulary_chat_template_is_kept_not_replaced(tmp_path: Path):
    vocab = _write_vocab(tmp_path / "vocab.gguf", with_template=True)

    model = gguf.GGUFReader(write_tiny_gguf(vocab, tmp_path / "tiny.gguf"))

    assert model.fields["tokenizer.chat_template"].contents() == "{{ messages[0]['content'] }}"


def test_tiny_model_has_llama_tensors_sized_by_shape_and_vocabulary(tmp_path: Path):
    vocab = _write_vocab(tmp_path / "vocab.gguf")
    shape = TinyShape(embedding=32, layers=3, heads=4, kv_heads=2, feed_forward=48)

    model = gguf.GGUFReader(write_tiny_gguf(vocab, tmp_path / "tiny.gguf", shape))

    shapes = {t.name: t.shape.tolist() for t in model.tensors}  # ggml order: [columns, rows]
    assert shapes["token_embd.weight"] == [32, len(TOKENS)]
    assert shapes["blk.2.attn_k.weight"] == [32, 16]  # 2 kv heads of 32/4
    assert shapes["blk.2.ffn_down.weight"] == [48, 32]
    assert "blk.3.attn_q.weight" not in shapes
    assert model.fields["llama.block_count"].contents() == 3
    assert model.fields["general.architecture"].contents() == "llama"


def test_missing_vocabulary_names_the_build_script(tmp_path: Path):
    with pytest.raises(VocabError, match="tools/build-llama-server.sh"):
        write_tiny_gguf(tmp_path / "absent.gguf", tmp_path / "tiny.gguf")


def test_gguf_without_tokenizer_is_refused(tmp_path: Path):
    writer = gguf.GGUFWriter(tmp_path / "weights-only.gguf", "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with pytest.raises(VocabError, match="not a vocabulary GGUF"):
        write_tiny_gguf(tmp_path / "weights-only.gguf", tmp_path / "tiny.gguf")
