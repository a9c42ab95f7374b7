"""How much a weights scan costs over merely walking the same tree.

Builds 200 models holding 5,000 safetensors shards (valid headers, sparse data) plus a few
Hugging Face cache repos and GGUFs in a tmp dir, then times scan_weights (cold: an empty FileCheckCache, as the agent's first scan; and
warm: the same cache, as the agent rescans on an interval) against a bare os.scandir walk
that stats every entry. Prints each and the ratio.

    .venv/bin/python bench/weights_scan.py [--models 200] [--shards 5000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from llmgw.agent.discovery.weights.mounts import read_mount_table
from llmgw.agent.discovery.weights.scan import FileCheckCache, scan_weights

SHARD_BYTES = 1 << 30  # sparse: costs no disk


def write_shard(path: Path, tensors: int = 40) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    per = SHARD_BYTES // tensors
    for i in range(tensors):
        header[f"model.layers.{i}.mlp.weight"] = {
            "dtype": "BF16",
            "shape": [per // 2],
            "data_offsets": [offset, offset + per],
        }
        offset += per
    raw = json.dumps(header).encode()
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    os.truncate(path, 8 + len(raw) + offset)


def build_tree(root: Path, models: int, shards: int) -> None:
    per_model = [shards // models + (1 if i < shards % models else 0) for i in range(models)]
    for m, count in enumerate(per_model):
        # a quarter of them in org/name layout, the rest one directory per model
        directory = root / (f"org{m % 7}/model-{m:03d}" if m % 4 == 0 else f"model-{m:03d}")
        directory.mkdir(parents=True)
        names = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {f"t{i}": n for i, n in enumerate(names)}})
        )
        (directory / "config.json").write_text("{}")
        for name in names:
            write_shard(directory / name)


def bare_walk(root: Path) -> int:
    """The floor: list every directory and stat every entry, nothing read."""
    count, stack = 0, [str(root)]
    while stack:
        with os.scandir(stack.pop()) as it:
            for entry in it:
                entry.stat()
                count += 1
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
    return count


class _Offsets(msgspec.Struct):
    data_offsets: tuple[int, int] | None = None


def header_floor(shards: list[str]) -> None:
    """The least a cold scan can do in Python: open, fstat, read each shard's header and
    decode its data offsets, and close it; no listing, no checks, no cache."""
    decoder = msgspec.json.Decoder(dict[str, _Offsets])
    for path in shards:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fstat(fd)
            head = os.read(fd, 16 << 10)
        finally:
            os.close(fd)
        (n,) = struct.unpack_from("<Q", head)
        decoder.decode(head[8 : 8 + n])


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) if repeat < 3 else statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=200)
    parser.add_argument("--shards", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    mounts = read_mount_table()
    with tempfile.TemporaryDirectory(prefix="llmgw-weights-bench-") as tmp:
        root = Path(tmp) / "weights"
        start = time.perf_counter()
        build_tree(root, args.models, args.shards)
        built = time.perf_counter() - start
        entries = bare_walk(root)
        print(
            f"tree: {args.models} models, {args.shards} shards, {entries} entries ({built:.1f} s to build)"
        )

        def scan(cache: FileCheckCache | None = None) -> None:
            w = scan_weights(
                [root], Path(tmp) / "fetch", mounts, "bench", True, {}, 600.0, cache=cache
            )
            assert len(w.models) == args.models and not w.incomplete, (
                len(w.models),
                w.incomplete[:3],
            )

        bare_walk(root)  # warm the page cache for everyone alike
        walk_s = best_of(args.repeat, lambda: bare_walk(root))
        shards = sorted(str(p) for p in root.rglob("*.safetensors"))
        floor_s = best_of(args.repeat, lambda: header_floor(shards))
        cold_s = best_of(args.repeat, lambda: scan(FileCheckCache()))  # the agent's first scan
        cache = FileCheckCache()
        scan(cache)
        warm_s = best_of(args.repeat, lambda: scan(cache))
        print(f"bare os.scandir walk + stat : {walk_s * 1000:8.1f} ms")
        print(
            f"floor: open+read+decode    : {floor_s * 1000:8.1f} ms  ({floor_s / walk_s:.1f}x the walk)"
        )
        print(
            f"scan_weights, headers read : {cold_s * 1000:8.1f} ms  ({cold_s / walk_s:.1f}x the walk)"
        )
        print(
            f"scan_weights, cached       : {warm_s * 1000:8.1f} ms  ({warm_s / walk_s:.1f}x the walk)"
        )
        print(
            f"per shard: {cold_s / args.shards * 1e6:.0f} us read, {warm_s / args.shards * 1e6:.0f} us cached"
        )


if __name__ == "__main__":
    main()
