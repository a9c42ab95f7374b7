"""Which models a node holds: real weight trees in tmp dirs, scanned by scan_weights."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from llmgw.agent.discovery.weights.mounts import SHARE_ID_FILE, MountTable
from llmgw.agent.discovery.weights.scan import (
    FileCheckCache,
    carry_over_timed_out,
    scan_weights,
    weights_equal_for_resend,
)
from llmgw.bus.records import Store, Weights

LOCAL = MountTable.from_text("30 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw\n")


def write_safetensors(path: Path, nbytes: int = 4096, *, short_by: int = 0) -> int:
    raw = json.dumps(
        {"w": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}
    ).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    os.truncate(path, 8 + len(raw) + nbytes - short_by)
    return 8 + len(raw) + nbytes


def write_sharded(directory: Path, shards: int, *, skip: int | None = None) -> None:
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {f"t{i}": n for i, n in enumerate(names)}})
    )
    for i, name in enumerate(names, start=1):
        if i != skip:
            write_safetensors(directory / name)


def write_gguf(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(["a", "b", "c"])
    writer.add_tensor("w", np.ones((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.stat().st_size


def write_hf_repo(cache: Path, repo_id: str, rev: str = "a" * 40, *, main: bool = True) -> Path:
    """huggingface_hub's cache layout: blobs by hash, snapshot links made when a file is done."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    tmp = repo / "tmp.safetensors"
    write_safetensors(tmp)
    for name, make in (("model.safetensors", None), ("config.json", "{}")):
        if make is None:
            data_path = tmp
        else:
            data_path = repo / "tmp.json"
            data_path.write_text(make)
        blob = hashlib.sha256(data_path.read_bytes()).hexdigest()
        os.replace(data_path, repo / "blobs" / blob)
        os.symlink(f"../../blobs/{blob}", snapshot / name)
    if main:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(rev)
    return repo


def scan(*dirs: Path, fetch: Path | None = None, **kw: object) -> Weights:
    fetch_dir = fetch if fetch is not None else dirs[0].parent / "fetch-absent"
    args: dict[str, object] = {
        "mounts": LOCAL,
        "node": "node05",
        "configured": bool(dirs),
        "shared_overrides": {},
        "deadline_s": 60.0,
    }
    args.update(kw)
    return scan_weights(list(dirs), fetch_dir, **args)  # type: ignore[arg-type]


def keys(w: Weights) -> list[str]:
    return [m.key for m in w.models]


def reasons(w: Weights) -> dict[str, str]:
    return {i.key: i.reason for i in w.incomplete}


# --- what counts as weights


def test_complete_model_directories_are_held(tmp_path: Path) -> None:
    size = write_safetensors(tmp_path / "w" / "tiny" / "model.safetensors")
    write_sharded(tmp_path / "w" / "big", 3)
    write_gguf(tmp_path / "w" / "qwen-7b-q4_k_m.gguf")
    w = scan(tmp_path / "w")
    assert keys(w) == ["big", "qwen-7b-q4_k_m", "tiny"]
    tiny = w.models[2]
    assert (tiny.format, tiny.path, tiny.bytes, tiny.files) == (
        "safetensors",
        str(tmp_path / "w" / "tiny"),
        size,
        1,
    )
    assert tiny.store == Store(kind="local", identity="local:node05", fs_type="ext4")
    assert w.models[0].files == 3
    assert w.incomplete == []


def test_sharded_model_missing_a_shard_is_not_held(tmp_path: Path) -> None:
    write_sharded(tmp_path / "w" / "big", 3, skip=2)
    w = scan(tmp_path / "w")
    assert keys(w) == []
    assert reasons(w) == {"big": "model-00002-of-00003.safetensors missing"}


def test_truncated_safetensors_is_not_held(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "w" / "m" / "model.safetensors", short_by=100)
    w = scan(tmp_path / "w")
    assert keys(w) == [] and reasons(w) == {"m": "model.safetensors truncated"}


def test_truncated_and_split_ggufs_are_not_held(tmp_path: Path) -> None:
    size = write_gguf(tmp_path / "w" / "cut.gguf")
    os.truncate(tmp_path / "w" / "cut.gguf", size // 2)
    write_gguf(tmp_path / "w" / "big-00001-of-00002.gguf")
    write_gguf(tmp_path / "w" / "whole-00001-of-00002.gguf")
    write_gguf(tmp_path / "w" / "whole-00002-of-00002.gguf")
    w = scan(tmp_path / "w")
    assert keys(w) == ["whole"]
    assert w.models[0].files == 2 and w.models[0].path.endswith("whole-00001-of-00002.gguf")
    assert reasons(w) == {"big": "big-00002-of-00002.gguf missing", "cut": "cut.gguf truncated"}


def test_empty_model_directory_is_not_weights(tmp_path: Path) -> None:
    (tmp_path / "w" / "llama-70b").mkdir(parents=True)
    (tmp_path / "w" / "only-config").mkdir()
    (tmp_path / "w" / "only-config" / "config.json").write_text("{}")
    w = scan(tmp_path / "w")
    assert keys(w) == []
    assert reasons(w) == {"llama-70b": "empty directory", "only-config": "no weight files"}


@pytest.mark.parametrize(
    "companion",
    [
        "model.safetensors.aria2",
        "model.safetensors.part",
        "model.safetensors.crdownload",
        "model.safetensors.tmp",
        ".model.safetensors.Xy3k9Q",  # rsync
    ],
)
def test_directory_with_a_download_companion_is_not_weights(tmp_path: Path, companion: str) -> None:
    # aria2 preallocates: the file already has its full size, only the companion tells
    write_safetensors(tmp_path / "w" / "m" / "model.safetensors")
    (tmp_path / "w" / "m" / companion).write_bytes(b"\0" * 16)
    w = scan(tmp_path / "w")
    assert keys(w) == []
    assert reasons(w) == {"m": f"download in progress ({companion})"}


def test_gguf_being_downloaded_is_reported_not_held(tmp_path: Path) -> None:
    write_gguf(tmp_path / "w" / "done.gguf")
    write_gguf(tmp_path / "w" / "busy.gguf")
    (tmp_path / "w" / "busy.gguf.aria2").write_bytes(b"x")
    (tmp_path / "w" / "coming.gguf.part").write_bytes(b"GGUF")
    w = scan(tmp_path / "w")
    assert keys(w) == ["done"]
    assert reasons(w) == {
        "busy": "download in progress (busy.gguf.aria2)",
        "coming": "download in progress (coming.gguf.part)",
    }


def test_hf_local_dir_download_in_progress_is_not_weights(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "w" / "m" / "model.safetensors")
    pending = tmp_path / "w" / "m" / ".cache" / "huggingface" / "download"
    pending.mkdir(parents=True)
    (pending / "abc123.incomplete").write_bytes(b"")
    w = scan(tmp_path / "w")
    assert keys(w) == []
    assert reasons(w)["m"].startswith("download in progress (.cache/huggingface/download/")


def test_nested_org_name_directories_key_as_org_name(tmp_path: Path) -> None:
    write_sharded(tmp_path / "w" / "meta-llama" / "Llama-3.1-8B", 2)
    write_gguf(tmp_path / "w" / "bartowski" / "phi-4-Q8_0.gguf")
    assert keys(scan(tmp_path / "w")) == ["meta-llama/Llama-3.1-8B", "phi-4-Q8_0"]


def test_configured_directory_that_is_itself_a_model(tmp_path: Path) -> None:
    write_sharded(tmp_path / "Mistral-7B", 2)
    assert keys(scan(tmp_path / "Mistral-7B")) == ["Mistral-7B"]


# --- Hugging Face cache


def test_hf_cache_repo_is_held_under_its_repo_id(tmp_path: Path) -> None:
    write_hf_repo(tmp_path / "hub", "meta-llama/Llama-3.1-8B")
    w = scan(tmp_path / "hub")
    assert keys(w) == ["meta-llama/Llama-3.1-8B"]
    assert w.models[0].path.endswith("snapshots/" + "a" * 40)


def test_hf_home_with_hub_inside_is_found(tmp_path: Path) -> None:
    write_hf_repo(tmp_path / "huggingface" / "hub", "org/name")
    assert keys(scan(tmp_path / "huggingface")) == ["org/name"]


def test_hf_cache_with_incomplete_blob_is_not_held(tmp_path: Path) -> None:
    repo = write_hf_repo(tmp_path / "hub", "org/name")
    (repo / "blobs" / ("f" * 64 + ".incomplete")).write_bytes(b"\0" * 100)
    w = scan(tmp_path / "hub")
    assert keys(w) == []
    assert reasons(w) == {"org/name": f"download in progress (blobs/{'f' * 64}.incomplete)"}


def test_hf_cache_with_dangling_snapshot_link_is_not_held(tmp_path: Path) -> None:
    repo = write_hf_repo(tmp_path / "hub", "org/name")
    os.symlink("../../blobs/" + "0" * 64, repo / "snapshots" / ("a" * 40) / "tokenizer.json")
    assert keys(scan(tmp_path / "hub")) == []


def test_hf_cache_without_refs_main_uses_newest_complete_snapshot(tmp_path: Path) -> None:
    repo = write_hf_repo(tmp_path / "hub", "org/name", "b" * 40, main=False)
    newer = repo / "snapshots" / ("c" * 40)
    newer.mkdir()
    (newer / "config.json").symlink_to("../../blobs/" + "0" * 64)  # half made
    os.utime(repo / "snapshots" / ("b" * 40), (1, 1), follow_symlinks=False)
    w = scan(tmp_path / "hub")
    assert keys(w) == ["org/name"]
    assert w.models[0].path.endswith("b" * 40)
    assert w.incomplete == []


def test_hf_cache_refs_main_on_an_incomplete_snapshot_is_not_held(tmp_path: Path) -> None:
    repo = write_hf_repo(tmp_path / "hub", "org/name", "b" * 40)
    newer = repo / "snapshots" / ("c" * 40)
    newer.mkdir()
    (repo / "refs" / "main").write_text("c" * 40)  # the revision an engine would load
    w = scan(tmp_path / "hub")
    assert keys(w) == [] and reasons(w) == {"org/name": "no weight files"}


# --- where the agent looks


def test_missing_configured_directory_is_reported_not_raised(tmp_path: Path) -> None:
    w = scan(tmp_path / "nope")
    assert [(d.path, d.status) for d in w.dirs] == [
        (str(tmp_path / "nope"), "missing"),
        (str(tmp_path / "fetch-absent"), "missing"),
    ]
    assert w.looked is True and w.models == []


def test_configured_path_that_is_a_file_is_unreadable(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert scan(tmp_path / "f").dirs[0].status == "unreadable"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a mode-000 directory anyway")
def test_unlistable_directory_is_unreadable(tmp_path: Path) -> None:
    (tmp_path / "w").mkdir(mode=0)
    try:
        assert scan(tmp_path / "w").dirs[0].status == "unreadable"
    finally:
        (tmp_path / "w").chmod(0o755)


def test_never_configured_agent_still_looks_in_the_fetch_dir(tmp_path: Path) -> None:
    fetch = tmp_path / "llmgw-weights"
    write_gguf(fetch / "fetched.gguf")
    w = scan_weights([], fetch, LOCAL, "node05", False, {}, 60.0)
    assert w.looked is False
    assert [d.path for d in w.dirs] == [str(fetch)]
    assert keys(w) == ["fetched"]


def test_never_configured_agent_with_no_fetch_dir_holds_nothing(tmp_path: Path) -> None:
    w = scan_weights([], tmp_path / "absent", LOCAL, "node05", False, {}, 60.0)
    assert (w.looked, w.models, [d.status for d in w.dirs]) == (False, [], ["missing"])


def test_fetch_dir_is_scanned_beside_configured_dirs_and_once_when_also_configured(
    tmp_path: Path,
) -> None:
    write_gguf(tmp_path / "fetch" / "a.gguf")
    write_gguf(tmp_path / "w" / "b.gguf")
    w = scan(tmp_path / "w", fetch=tmp_path / "fetch")
    assert keys(w) == ["a", "b"]
    w = scan(tmp_path / "fetch", tmp_path / "w", fetch=tmp_path / "fetch")
    assert [d.path for d in w.dirs] == [str(tmp_path / "fetch"), str(tmp_path / "w")]


def test_id_file_makes_a_directory_shared(tmp_path: Path) -> None:
    write_gguf(tmp_path / "w" / "m.gguf")
    (tmp_path / "w" / SHARE_ID_FILE).write_text("srp-image-07\n")
    w = scan(tmp_path / "w")
    assert w.models[0].store == Store(
        kind="shared", identity="srp-image-07", fs_type="ext4", source="id-file"
    )
    assert w.dirs[0].store == w.models[0].store


def test_config_override_makes_a_directory_shared(tmp_path: Path) -> None:
    write_gguf(tmp_path / "w" / "m.gguf")
    w = scan(tmp_path / "w", shared_overrides={str(tmp_path / "w"): "nvmeof:img01"})
    assert w.models[0].store == Store(kind="shared", identity="nvmeof:img01", source="config")


def test_scan_writes_nothing_into_weights_directories(tmp_path: Path) -> None:
    write_hf_repo(tmp_path / "w" / "hub", "org/name")
    write_sharded(tmp_path / "w" / "big", 2, skip=1)
    write_gguf(tmp_path / "w" / "m.gguf")

    def tree() -> list[tuple[str, int, int]]:
        return sorted(
            (str(p), p.lstat().st_size, p.lstat().st_mtime_ns) for p in (tmp_path / "w").rglob("*")
        )

    before = tree()
    scan(tmp_path / "w", cache=FileCheckCache())
    assert tree() == before


# --- time, repetition and resending


def test_deadline_marks_remaining_dirs_timeout(tmp_path: Path) -> None:
    write_gguf(tmp_path / "a" / "m.gguf")
    w = scan(tmp_path / "a", tmp_path / "b", deadline_s=0)
    assert [d.status for d in w.dirs] == ["timeout", "timeout", "timeout"]
    assert "weights.scan_timeout" in w.dirs[0].detail


def test_deadline_inside_a_directory_keeps_what_was_verified(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        write_gguf(tmp_path / "w" / f"{name}.gguf")
    ticks = iter(range(100))
    w = scan(tmp_path / "w", deadline_s=3, clock=lambda: next(ticks))  # a few checks, then out
    assert w.dirs[0].status == "timeout"
    assert len(w.models) < 3
    full = scan(tmp_path / "w")
    kept = carry_over_timed_out(full, w)
    assert keys(kept) == ["a", "b", "c"]
    assert carry_over_timed_out(None, w) is w


def test_repeated_scan_of_unchanged_tree_is_equal_for_resend(tmp_path: Path) -> None:
    write_sharded(tmp_path / "w" / "big", 2)
    write_hf_repo(tmp_path / "w", "org/name")
    cache = FileCheckCache()
    first = scan(tmp_path / "w", cache=cache, now=lambda: 1.0)
    second = scan(tmp_path / "w", cache=cache, now=lambda: 2.0)
    assert first != second  # scanned_at differs
    assert weights_equal_for_resend(first, second)
    assert second == scan(tmp_path / "w", now=lambda: 2.0)  # the cache changes nothing

    write_gguf(tmp_path / "w" / "new.gguf")
    assert not weights_equal_for_resend(second, scan(tmp_path / "w", cache=cache))


def test_cached_scan_sees_a_file_that_shrank(tmp_path: Path) -> None:
    size = write_safetensors(tmp_path / "w" / "m" / "model.safetensors")
    cache = FileCheckCache()
    assert keys(scan(tmp_path / "w", cache=cache)) == ["m"]
    os.truncate(tmp_path / "w" / "m" / "model.safetensors", size - 1)
    assert keys(scan(tmp_path / "w", cache=cache)) == []


def test_cached_scan_rereads_a_file_rewritten_at_the_same_size(tmp_path: Path) -> None:
    shard = tmp_path / "w" / "m" / "model.safetensors"
    write_safetensors(shard)
    cache = FileCheckCache()
    assert keys(scan(tmp_path / "w", cache=cache)) == ["m"]
    before = shard.stat()
    with shard.open("r+b") as f:  # same size, header overwritten: no longer safetensors
        f.write(struct.pack("<Q", 1 << 40))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    assert shard.stat().st_size == before.st_size
    w = scan(tmp_path / "w", cache=cache)
    assert keys(w) == [] and "header" in w.incomplete[0].reason


def test_cached_scan_rereads_an_index_that_changed(tmp_path: Path) -> None:
    write_sharded(tmp_path / "w" / "big", 2)
    cache = FileCheckCache()
    assert keys(scan(tmp_path / "w", cache=cache)) == ["big"]
    index = tmp_path / "w" / "big" / "model.safetensors.index.json"
    names = json.loads(index.read_text())["weight_map"]
    index.write_text(json.dumps({"weight_map": {**names, "t9": "extra.safetensors"}}))
    w = scan(tmp_path / "w", cache=cache)
    assert keys(w) == [] and "extra.safetensors" in w.incomplete[0].reason


def test_growing_download_does_not_change_what_is_resent(tmp_path: Path) -> None:
    size = write_safetensors(tmp_path / "w" / "m" / "model.safetensors", 1 << 20, short_by=1 << 19)
    first = scan(tmp_path / "w")
    os.truncate(tmp_path / "w" / "m" / "model.safetensors", size - 10)
    assert weights_equal_for_resend(first, scan(tmp_path / "w"))


# --- hostile files: one bad file is reported, never the end of the scan


def test_fifos_are_reported_not_read_and_the_scan_goes_on(tmp_path: Path) -> None:
    # each of these blocks a plain open() until a writer comes: the scan would hang
    write_gguf(tmp_path / "w" / "good.gguf")
    os.mkfifo(tmp_path / "w" / "piped.gguf")
    os.mkfifo(tmp_path / "w" / SHARE_ID_FILE)
    (tmp_path / "w" / "split").mkdir()
    write_gguf(tmp_path / "w" / "split" / "s-00001-of-00002.gguf")
    os.mkfifo(tmp_path / "w" / "split" / "s-00002-of-00002.gguf")
    repo = write_hf_repo(tmp_path / "w" / "hub", "org/name", main=False)
    (repo / "refs").mkdir()
    os.mkfifo(repo / "refs" / "main")
    w = scan(tmp_path / "w")
    assert keys(w) == ["good", "org/name"]
    assert reasons(w) == {
        "piped": "piped.gguf not a regular file",
        "s": "s-00002-of-00002.gguf not a regular file",
    }
    assert w.dirs[0].store == Store(kind="local", identity="local:node05", fs_type="ext4")


def test_malformed_files_are_bad_files_beside_good_ones(tmp_path: Path) -> None:
    from test_weights_formats import write_nested_gguf

    write_gguf(tmp_path / "w" / "good.gguf")
    write_nested_gguf(tmp_path / "w" / "nested.gguf", 5000)
    write_sharded(tmp_path / "w" / "deep", 2)
    (tmp_path / "w" / "deep" / "model.safetensors.index.json").write_bytes(
        b'{"weight_map": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    )
    w = scan(tmp_path / "w")
    assert keys(w) == ["good"]
    assert reasons(w) == {
        "deep": "model.safetensors.index.json does not parse",
        "nested": "nested.gguf header does not parse",
    }


def test_an_exception_checking_one_model_is_reported_and_the_scan_goes_on(tmp_path: Path) -> None:
    class Failing(FileCheckCache):
        def check(self, path, fn):
            if os.path.basename(path) == "bad.gguf":
                raise RuntimeError("a bug, or a bound someone missed")
            return super().check(path, fn)

    write_gguf(tmp_path / "w" / "bad.gguf")
    write_gguf(tmp_path / "w" / "good.gguf")
    w = scan(tmp_path / "w", cache=Failing())
    assert keys(w) == ["good"]
    assert reasons(w) == {"bad": "could not be checked (RuntimeError)"}
    assert [d.status for d in w.dirs] == ["ok", "missing"]


def test_the_scan_says_which_directory_it_is_in(tmp_path: Path) -> None:
    write_gguf(tmp_path / "a" / "m.gguf")
    seen: list[Path] = []
    scan(tmp_path / "a", tmp_path / "b", on_dir=seen.append)
    # each directory once for its share id, then once as its scan begins
    assert seen == [tmp_path / "a", tmp_path / "b", tmp_path / "fetch-absent"] * 2


def test_a_stuck_scan_marks_its_directory_and_keeps_what_was_known() -> None:
    from llmgw.agent.weights import stuck_scan
    from llmgw.bus.records import WeightsDir

    known = Weights(
        looked=True,
        scanned_at=5.0,
        dirs=[WeightsDir(path="/filer", status="ok"), WeightsDir(path="/fetch", status="ok")],
    )
    after = stuck_scan(known, "/filer", 300.4)
    assert [(d.path, d.status, d.detail) for d in after.dirs] == [
        ("/filer", "timeout", "scan of /filer running for 300 s"),
        ("/fetch", "ok", ""),
    ]
    first = stuck_scan(Weights(looked=True), "/filer", 62)
    assert [d.path for d in first.dirs] == ["/filer"] and first.scanned_at == 0
