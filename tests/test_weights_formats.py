"""Weight file completeness from headers and sizes: real files written into tmp dirs."""

from __future__ import annotations

import io
import json
import os
import struct
from datetime import timedelta
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.agent.discovery.weights.formats import (
    GGML_BLOCK,
    GgufLayout,
    check_gguf,
    check_gguf_split,
    check_safetensors,
    check_safetensors_dir,
    gguf_layout,
    gguf_split,
    missing_numbered_shards,
    parse_index,
    safetensors_required_size,
)


def write_safetensors(path: Path, tensors: dict[str, int], *, short_by: int = 0) -> int:
    """A safetensors file whose tensors take the given byte counts; the data is a sparse
    hole (size is all completeness looks at). Returns the complete size."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, nbytes in tensors.items():
        header[name] = {
            "dtype": "F16",
            "shape": [nbytes // 2],
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    size = 8 + len(raw) + offset
    os.truncate(path, size - short_by)
    return size


def write_gguf(path: Path, *, alignment: int | None = None, vocab: int = 100) -> int:
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        writer.add_custom_alignment(alignment)
    writer.add_block_count(2)
    writer.add_token_list([f"tok{i}" for i in range(vocab)])
    writer.add_token_scores([0.5] * vocab)
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_bool("test.flag", True)
    writer.add_float64("test.f64", 1.5)
    writer.add_tensor("tok_embd.weight", np.ones((8, 32), dtype=np.float32))
    writer.add_tensor("out.weight", np.ones((3, 7), dtype=np.float16))
    quant = np.zeros((4, 2 * 18), dtype=np.uint8)  # 4 rows of two Q4_0 blocks
    writer.add_tensor("q.weight", quant, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.stat().st_size


# --- safetensors


def test_complete_safetensors_is_complete(tmp_path: Path) -> None:
    size = write_safetensors(tmp_path / "model.safetensors", {"a": 1024, "b": 4096})
    check = check_safetensors(tmp_path / "model.safetensors")
    assert check.complete and check.bytes == size and check.files == 1


def test_truncated_safetensors_says_how_much_is_there(tmp_path: Path) -> None:
    size = write_safetensors(tmp_path / "model.safetensors", {"a": 1 << 20}, short_by=1000)
    check = check_safetensors(tmp_path / "model.safetensors")
    assert not check.complete
    assert check.why == f"model.safetensors truncated: {size - 1000} of {size} bytes"
    assert check.reason == "model.safetensors truncated"  # no numbers: stable while downloading


def test_safetensors_longer_than_its_header_is_not_complete(tmp_path: Path) -> None:
    size = write_safetensors(tmp_path / "m.safetensors", {"a": 64})
    os.truncate(tmp_path / "m.safetensors", size + 64)  # preallocated past the end
    assert not check_safetensors(tmp_path / "m.safetensors").complete


@pytest.mark.parametrize(
    "prefix",
    [
        struct.pack("<Q", 1 << 40) + b"{}",  # bogus huge header length
        struct.pack("<Q", 0),  # aria2 preallocation: zeros
        struct.pack("<Q", 10) + b"not json!!",
        struct.pack("<Q", 2) + b"[]",
        struct.pack("<Q", 28) + b'{"t":{"data_offsets":[9,1]}}',
    ],
)
def test_safetensors_whose_header_does_not_parse_is_not_complete(
    tmp_path: Path, prefix: bytes
) -> None:
    (tmp_path / "m.safetensors").write_bytes(prefix + b"\0" * 64)
    check = check_safetensors(tmp_path / "m.safetensors")
    assert not check.complete
    assert check.problem in ("header does not parse", "truncated")


def test_sharded_safetensors_with_missing_shard_names_it(tmp_path: Path) -> None:
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = {"metadata": {}, "weight_map": {f"t{i}": n for i, n in enumerate(names)}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in (names[0], names[2]):
        write_safetensors(tmp_path / name, {"a": 256})
    files = sorted(os.listdir(tmp_path))
    check = check_safetensors_dir(tmp_path, files)
    assert not check.complete
    assert check.reason == "model-00002-of-00003.safetensors missing"

    write_safetensors(tmp_path / names[1], {"a": 256})
    check = check_safetensors_dir(tmp_path, sorted(os.listdir(tmp_path)))
    assert check.complete and check.files == 3


def test_sharded_safetensors_without_index_still_needs_every_numbered_shard(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": 256})
    check = check_safetensors_dir(tmp_path, sorted(os.listdir(tmp_path)))
    assert check.reason == "model-00002-of-00002.safetensors missing"
    assert missing_numbered_shards(["x-00002-of-00003.gguf"]) == [
        "x-00001-of-00003.gguf",
        "x-00003-of-00003.gguf",
    ]


def test_sharded_safetensors_with_truncated_shard_is_not_complete(tmp_path: Path) -> None:
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": names[0], "b": names[1]}})
    )
    write_safetensors(tmp_path / names[0], {"a": 256})
    write_safetensors(tmp_path / names[1], {"a": 256}, short_by=1)
    check = check_safetensors_dir(tmp_path, sorted(os.listdir(tmp_path)))
    assert check.reason == "model-00002-of-00002.safetensors truncated"


# --- GGUF


@pytest.mark.parametrize("alignment", [None, 64])
def test_gguf_written_by_gguf_writer_is_complete(tmp_path: Path, alignment: int | None) -> None:
    size = write_gguf(tmp_path / "m.gguf", alignment=alignment)
    check = check_gguf(tmp_path / "m.gguf")
    assert check.complete and check.bytes == size
    # our layout agrees with the gguf package's own reader
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    with (tmp_path / "m.gguf").open("rb") as f:
        layout = gguf_layout(f, size)
    assert layout.data_start == reader.data_offset
    assert layout.alignment == (alignment or 32)
    last = max(reader.tensors, key=lambda t: t.data_offset)
    assert layout.required_size == last.data_offset + last.n_bytes


def test_gguf_missing_its_last_tensor_bytes_is_truncated(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf")
    with (tmp_path / "m.gguf").open("rb") as f:
        required = gguf_layout(f, (tmp_path / "m.gguf").stat().st_size).required_size
    os.truncate(tmp_path / "m.gguf", required - 1)
    check = check_gguf(tmp_path / "m.gguf")
    assert check.why == f"m.gguf truncated: {required - 1} of {required} bytes"


def test_gguf_cut_inside_its_header_is_truncated(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", vocab=2000)
    os.truncate(tmp_path / "m.gguf", 4000)  # inside the token list
    check = check_gguf(tmp_path / "m.gguf")
    assert not check.complete and check.problem == "truncated"


@pytest.mark.parametrize(
    "data, problem",
    [
        (b"GGML" + b"\0" * 60, "header does not parse"),
        (b"GGUF" + struct.pack("<I", 1) + b"\0" * 60, "header does not parse"),
        (b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 0), "header does not parse"),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 40), "truncated"),
        (b"", "truncated"),
    ],
)
def test_gguf_with_bad_header_is_not_complete(tmp_path: Path, data: bytes, problem: str) -> None:
    (tmp_path / "m.gguf").write_bytes(data)
    check = check_gguf(tmp_path / "m.gguf")
    assert not check.complete and check.problem == problem


def test_gguf_with_zeros_inside_its_header_is_not_complete(tmp_path: Path) -> None:
    # a preallocated download: full size, the header only partly written
    size = write_gguf(tmp_path / "m.gguf", vocab=2000)
    with (tmp_path / "m.gguf").open("r+b") as f:
        f.seek(4000)
        f.write(b"\0" * (size - 4000))
    check = check_gguf(tmp_path / "m.gguf")
    assert not check.complete and check.problem == "header does not parse"
    assert "zeros" in check.detail


def test_big_endian_gguf_is_read(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "be.gguf"), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_tensor("w", np.ones((4, 8), dtype=np.float32).byteswap())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert check_gguf(tmp_path / "be.gguf").complete
    os.truncate(tmp_path / "be.gguf", (tmp_path / "be.gguf").stat().st_size - 64)
    assert not check_gguf(tmp_path / "be.gguf").complete


def test_tensor_of_unknown_ggml_type_last_in_file_is_named(tmp_path: Path) -> None:
    buf = io.BytesIO()
    name = b"w"
    buf.write(b"GGUF" + struct.pack("<IQQ", 3, 1, 0))
    buf.write(struct.pack("<Q", len(name)) + name + struct.pack("<IQIQ", 1, 32, 250, 0))
    with pytest.raises(ValueError, match="ggml type 250"):
        gguf_layout(io.BytesIO(buf.getvalue()), 1 << 20)


def test_split_gguf_with_missing_part_names_it(tmp_path: Path) -> None:
    for i in (1, 3):
        write_gguf(tmp_path / f"big-0000{i}-of-00003.gguf")
    split = gguf_split("big-00001-of-00003.gguf")
    assert split is not None and (split.stem, split.index, split.total) == ("big", 1, 3)
    check = check_gguf_split(tmp_path, split, os.listdir(tmp_path))
    assert check.reason == "big-00002-of-00003.gguf missing"
    write_gguf(tmp_path / "big-00002-of-00003.gguf")
    check = check_gguf_split(tmp_path, split, os.listdir(tmp_path))
    assert check.complete and check.files == 3


def test_unsplit_names_are_not_splits() -> None:
    assert gguf_split("model.gguf") is None
    assert gguf_split("model-00004-of-00003.gguf") is None
    assert gguf_split("model-00001-of-00003.safetensors") is None


def test_ggml_block_table_matches_the_gguf_package() -> None:
    theirs = {int(t): size for t, size in gguf.GGML_QUANT_SIZES.items()}
    assert GGML_BLOCK == theirs


# --- hostile files: anyone who can write into a shared weights directory wrote these


def write_nested_gguf(path: Path, depth: int) -> Path:
    """A GGUF whose one key holds an array of an array of ... `depth` deep: 12 bytes a level."""
    path.parent.mkdir(parents=True, exist_ok=True)
    key = b"k"
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    data += struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 0)
    path.write_bytes(data)
    return path


def test_gguf_of_deeply_nested_arrays_is_a_bad_file_not_a_crash(tmp_path: Path) -> None:
    check = check_gguf(write_nested_gguf(tmp_path / "nested.gguf", 5000))
    assert (check.problem, check.detail) == (
        "header does not parse",
        "arrays nested more than 8 deep",
    )


def test_gguf_with_a_huge_key_in_a_large_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    # a 4 GiB sparse file claiming a 100 MiB key: refused by length, never read into memory
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 100 << 20)
    (tmp_path / "m.gguf").write_bytes(data)
    os.truncate(tmp_path / "m.gguf", 4 << 30)
    check = check_gguf(tmp_path / "m.gguf")
    assert check.problem == "header does not parse" and "at most 65535" in check.detail


def test_gguf_header_longer_than_any_real_one_is_refused(tmp_path: Path) -> None:
    # one string value of 300 MiB, in a sparse file: skipped by seek, refused by position
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k"
    data += struct.pack("<IQ", 8, 300 << 20)
    (tmp_path / "m.gguf").write_bytes(data)
    os.truncate(tmp_path / "m.gguf", 1 << 30)
    check = check_gguf(tmp_path / "m.gguf")
    assert check.problem == "header does not parse" and "no real one does" in check.detail


@pytest.mark.parametrize(
    "header",
    [
        b'{"__metadata__":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"t":{"data_offsets":[0,1],"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
    ],
)
def test_safetensors_header_of_deeply_nested_json_is_a_bad_file(tmp_path: Path, header) -> None:
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    check = check_safetensors(tmp_path / "m.safetensors")
    assert check.problem == "header does not parse"


def test_a_file_swapped_for_a_fifo_after_its_stat_is_still_never_read(tmp_path: Path) -> None:
    # a cached scan hands the check the stat it keyed by, and the check skips its own; the
    # path then becomes a FIFO before the open: what was opened is checked, nothing hangs
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"a": 16})
    before = os.stat(path)
    path.unlink()
    os.mkfifo(path)
    check = check_safetensors(path, before)
    assert check.reason == "model.safetensors not a regular file"
    os.unlink(path)
    os.mkfifo(path.with_suffix(".gguf"))
    assert check_gguf(path.with_suffix(".gguf"), before).why.endswith("not a regular file: a FIFO")


def test_negative_data_offsets_name_the_tensor(tmp_path: Path) -> None:
    header = b'{"__metadata__":{"format":"pt"},"good":{"data_offsets":[0,1]},"bad":{"data_offsets":[-1,1]}}'
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    check = check_safetensors(tmp_path / "m.safetensors")
    assert check.problem == "header does not parse" and "tensor 'bad'" in check.detail


def test_index_of_deeply_nested_json_is_a_bad_file(tmp_path: Path) -> None:
    nested = b'{"metadata":' + b"[" * 100_000 + b"]" * 100_000 + b', "weight_map": {}}'
    (tmp_path / "model.safetensors.index.json").write_bytes(nested)
    check = check_safetensors_dir(tmp_path, ["model.safetensors.index.json"])
    assert check.reason == "model.safetensors.index.json does not parse"
    assert "deeper than any index" in check.detail


def test_fifo_named_as_weights_is_not_a_regular_file_and_is_never_opened(tmp_path: Path) -> None:
    # opening a FIFO for reading blocks until a writer comes: this test would hang
    os.mkfifo(tmp_path / "m.gguf")
    os.mkfifo(tmp_path / "m.safetensors")
    assert check_gguf(tmp_path / "m.gguf").why == "m.gguf not a regular file: a FIFO"
    assert (
        check_safetensors(tmp_path / "m.safetensors").reason == "m.safetensors not a regular file"
    )
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    check = check_safetensors_dir(tmp_path, ["model.safetensors.index.json"])
    assert check.reason == "model.safetensors.index.json not a regular file"


# Fuzzing: any bytes give a result or a reason, quickly. Headers are built from parts real
# files have, so the search gets past the magic.

QUICKLY = timedelta(milliseconds=500)  # per example, on a shared 2-core machine

_u32 = st.integers(0, 2**32 - 1).map(lambda n: struct.pack("<I", n))
_u64 = st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1)).map(lambda n: struct.pack("<Q", n))
_small_u64 = st.integers(0, 16).map(lambda n: struct.pack("<Q", n))
_vtype = st.integers(0, 13).map(lambda n: struct.pack("<I", n))
# a run of array-of-array headers: what a 60 KB file of 5,000 nested arrays is made of
_nesting = st.integers(1, 6000).map(lambda n: struct.pack("<IQ", 9, 1) * n)
_key = st.binary(min_size=1, max_size=12).map(lambda k: struct.pack("<Q", len(k)) + k)
_value = st.one_of(
    st.tuples(_vtype, st.binary(max_size=16)).map(b"".join),
    st.tuples(st.just(struct.pack("<I", 9)), _nesting, _u32, _small_u64).map(b"".join),
    st.tuples(st.just(struct.pack("<II", 9, 8)), _small_u64, st.binary(max_size=32)).map(b"".join),
)
_kv = st.tuples(_key, _value).map(b"".join)
_gguf_parts = st.lists(
    st.one_of(_kv, _u32, _u64, _small_u64, _vtype, st.binary(max_size=24)), max_size=20
)


@st.composite
def gguf_headers(draw: st.DrawFn) -> bytes:
    version = draw(
        st.sampled_from([struct.pack("<I", 3), struct.pack(">I", 3), struct.pack("<I", 2)])
    )
    tensors, kvs = draw(_small_u64), draw(st.integers(1, 4).map(lambda n: struct.pack("<Q", n)))
    # a key-value first, so the search starts inside the key-values, where nesting lives
    return b"GGUF" + version + tensors + kvs + draw(_kv) + b"".join(draw(_gguf_parts))


@settings(max_examples=400, deadline=QUICKLY, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(gguf_headers(), st.binary(max_size=512)))
def test_gguf_reader_gives_a_layout_or_a_reason_for_any_bytes(data: bytes) -> None:
    try:
        layout = gguf_layout(io.BytesIO(data), len(data))
    except ValueError as exc:
        assert str(exc)
    else:
        assert isinstance(layout, GgufLayout) and layout.data_start >= 24


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
_entry = st.fixed_dictionaries(
    {"data_offsets": st.lists(st.integers(-(2**70), 2**70), max_size=3)},
    optional={"dtype": _json, "shape": _json},
)
_deep = st.integers(1, 100_000).map(lambda n: b"[" * n + b"]" * n)
_header_json = st.one_of(
    st.dictionaries(st.text(max_size=12), st.one_of(_entry, _json), max_size=6).map(
        lambda d: json.dumps(d).encode()
    ),
    _deep.map(lambda nest: b'{"t":{"data_offsets":[0,1],"x":' + nest + b"}}"),
)


@settings(max_examples=400, deadline=QUICKLY)
@given(st.one_of(_header_json, st.binary(max_size=256)))
def test_safetensors_header_gives_a_size_or_a_reason_for_any_bytes(header: bytes) -> None:
    try:
        size = safetensors_required_size(len(header), header)
    except ValueError as exc:
        assert str(exc)
    else:
        assert size >= 8 + len(header)


_index_json = st.fixed_dictionaries(
    {},
    optional={
        "weight_map": st.one_of(st.dictionaries(st.text(max_size=8), _json), _json),
        "metadata": _json,
    },
).map(lambda d: json.dumps(d).encode())


@settings(max_examples=400, deadline=QUICKLY)
@given(st.one_of(_index_json, _deep.map(lambda n: b'{"metadata":' + n + b"}"), st.binary()))
def test_index_gives_file_names_or_a_reason_for_any_bytes(data: bytes) -> None:
    try:
        files = parse_index(data, "model.safetensors.index.json")
    except ValueError as exc:
        assert str(exc).startswith("model.safetensors.index.json ")
    else:
        assert files and all("/" not in f and f not in ("", ".", "..") for f in files)


@settings(
    max_examples=150,
    deadline=QUICKLY,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.one_of(gguf_headers(), _header_json.map(lambda h: struct.pack("<Q", len(h)) + h)))
def test_checking_any_file_gives_a_check(tmp_path: Path, data: bytes) -> None:
    (tmp_path / "m.gguf").write_bytes(data)
    (tmp_path / "m.safetensors").write_bytes(data)
    assert isinstance(check_gguf(tmp_path / "m.gguf").complete, bool)
    assert isinstance(check_safetensors(tmp_path / "m.safetensors").complete, bool)
