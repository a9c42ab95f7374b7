"""Are these weight files complete? Decided from headers and sizes only, never tensor data.

A half-finished download looks like weights to anything that only lists files, and an
engine sent to it fails after minutes of loading. Both formats say in their header how
long the file must be, so a file read here is complete exactly when it is that long.

safetensors: u64 little-endian header length N, N bytes of JSON whose tensors carry
`data_offsets` [begin, end) into the data that follows; size == 8 + N + max end.
GGUF: "GGUF", u32 version (2 or 3), u64 tensor count, u64 key-value count, key-values,
tensor infos (name, dims, ggml type, offset), padding to `general.alignment`, data;
size >= data start + max(offset + bytes of that tensor).

Anyone who can drop a file into a shared weights directory controls these bytes, so every
reader here is bounded (nesting depth, counts, string lengths, bytes read) and a file that
breaks a bound is a bad file with a reason, never an exception out of the scan.
"""

from __future__ import annotations

import functools
import operator
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import msgspec

from llmgw.agent.files import NotRegularFile, TooLarge, open_regular, open_regular_fd, read_bounded

# --- results


class Check(msgspec.Struct, frozen=True, gc=False):
    """Complete, or why not. `problem` is stable while a download progresses ("truncated"),
    so it can go into a record without rewriting it on every scan; `detail` carries the
    numbers for people ("1048576 of 2097152 bytes"). A Struct: one per shard per cold
    scan, built in a tenth of a frozen dataclass's time."""

    complete: bool
    file: str = ""  # the file name the problem is about
    problem: str = ""
    detail: str = ""
    bytes: int = 0  # total size of the files checked (when complete)
    files: int = 0
    # a LoRA adapter's file (a GGUF whose general.type is "adapter"): its architecture and
    # rank, as its header says
    adapter: bool = False
    arch: str = ""
    rank: int = 0

    @property
    def why(self) -> str:
        """One line for people: 'model-00002-of-00003.safetensors missing'."""
        if self.complete:
            return "complete"
        head = f"{self.file} {self.problem}" if self.file else self.problem
        return f"{head}: {self.detail}" if self.detail else head

    @property
    def reason(self) -> str:
        """The stable part of `why`, without progress numbers."""
        if self.complete:
            return "complete"
        return f"{self.file} {self.problem}" if self.file else self.problem


def _ok(nbytes: int, files: int = 1) -> Check:
    return Check(complete=True, bytes=nbytes, files=files)


def _bad(file: str, problem: str, detail: str = "") -> Check:
    return Check(complete=False, file=file, problem=problem, detail=detail)


def _bad_file(path: str | Path, problem: str, detail: str = "") -> Check:
    # the file's name is worked out only for a problem: a cold scan checks thousands
    return _bad(os.path.basename(path), problem, detail)


def _unopenable(name: str, exc: OSError) -> Check:
    if isinstance(exc, NotRegularFile):
        return _bad(name, "not a regular file", exc.kind)
    if isinstance(exc, FileNotFoundError):
        return _bad(name, "missing")
    return _bad(name, "unreadable", exc.strerror or str(exc))


def combine(checks: Iterable[Check]) -> Check:
    """All complete -> one complete Check summing bytes and files; else the first problem."""
    total = files = 0
    for c in checks:
        if not c.complete:
            return c
        total += c.bytes
        files += c.files
    return _ok(total, files)


# --- safetensors

# safetensors itself refuses headers over 100 MB; a larger N is a file of zeros being
# preallocated (aria2) or not safetensors at all
SAFETENSORS_MAX_HEADER = 100_000_000


class _TensorEntry(msgspec.Struct, gc=False):  # gc=False: no cycles, 15% faster to decode
    # unknown fields (dtype, shape, and all of __metadata__) are skipped by the C decoder
    data_offsets: tuple[int, int] | None = None


_HEADER = msgspec.json.Decoder(dict[str, _TensorEntry])
_OFFSETS = operator.attrgetter("data_offsets")


def safetensors_required_size(header_len: int, header: bytes) -> int:
    """8 + N + the largest data end offset named in the JSON header. Raises ValueError
    when the header is not a safetensors header."""
    try:
        entries = _HEADER.decode(header)
    except msgspec.DecodeError as exc:
        raise ValueError(f"header is not a safetensors header ({exc})") from None
    except RecursionError:
        # msgspec bounds nesting by the interpreter's recursion limit; real headers nest 3 deep
        raise ValueError("header nests JSON deeper than any safetensors header") from None
    meta = entries.pop("__metadata__", None)
    if meta is not None and meta.data_offsets is not None:
        entries["__metadata__"] = meta  # a tensor of that name, not free-form strings
    # thousands of shards of hundreds of tensors each: no Python loop per tensor while the
    # header is valid; the loop below only names the first bad tensor
    if not entries:
        return 8 + header_len
    try:
        begins, stops = zip(*map(_OFFSETS, entries.values()))  # noqa: B905 - transposes pairs
    except TypeError:  # a tensor without data_offsets: named below
        pass
    else:
        if min(begins) >= 0 and not any(map(operator.gt, begins, stops)):
            return 8 + header_len + max(stops)
    for name, entry in entries.items():
        if entry.data_offsets is None:
            raise ValueError(f"tensor {name!r} has no data_offsets")
        begin, stop = entry.data_offsets
        if not 0 <= begin <= stop:
            raise ValueError(f"tensor {name!r} has data_offsets {list(entry.data_offsets)}")
    raise AssertionError("unreachable: some tensor's offsets were found wrong above")


def check_safetensors(path: str | Path, st: os.stat_result | None = None) -> Check:
    """One .safetensors file: complete exactly when size == 8 + N + max end offset. `st`:
    a stat of `path` just taken (see `open_regular_fd`)."""
    try:
        # a raw descriptor and one read that usually holds the header too (a few KB per
        # shard): no file object, whose fcntl and fstat calls were half of a cold check
        fd, st = open_regular_fd(path, st)
        try:
            size = st.st_size
            head = _read_exactly(fd, min(size, _FIRST_READ))
            if len(head) < 8:
                return _bad_file(
                    path, "truncated", f"{size} bytes, shorter than the 8-byte header length"
                )
            n = _U64(head)[0]
            if n == 0 or n > SAFETENSORS_MAX_HEADER:
                return _bad_file(
                    path, "header does not parse", f"header length {n} is not plausible"
                )
            if 8 + n > size:
                return _bad_file(
                    path, "truncated", f"{size} of at least {8 + n} bytes (header cut)"
                )
            if 8 + n <= len(head):
                header = memoryview(head)[8 : 8 + n]  # no copy of a few KB
            else:
                header = head[8:] + _read_exactly(fd, 8 + n - len(head))
        finally:
            os.close(fd)
    except OSError as exc:
        return _unopenable(os.path.basename(path), exc)
    try:
        required = safetensors_required_size(n, header)
    except ValueError as exc:
        return _bad_file(path, "header does not parse", str(exc))
    if size == required:
        return _ok(size)
    if size < required:
        return _bad_file(path, "truncated", f"{size} of {required} bytes")
    # a preallocated or appended-to file: not what the header describes
    return _bad_file(path, "larger than its header says", f"{size} bytes, header says {required}")


_FIRST_READ = 16 << 10  # a header of ~150 tensors; more costs a second read
_U64 = struct.Struct("<Q").unpack_from


def _read_exactly(fd: int, n: int) -> bytes:
    """`n` bytes from `fd`, fewer only at the end of the file (a read may return less)."""
    data = os.read(fd, n)
    while len(data) < n:
        more = os.read(fd, n - len(data))
        if not more:
            break
        data += more
    return data


SAFETENSORS_INDEX_SUFFIX = ".safetensors.index.json"
_SHARD = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.(?P<ext>safetensors|gguf)$")


# the largest real indexes (~100k tensors) are ~10 MB
SAFETENSORS_MAX_INDEX = 64 << 20


class _Index(msgspec.Struct):
    # metadata and anything else is skipped by the C decoder, never built
    weight_map: dict[str, str] | None = None


_INDEX = msgspec.json.Decoder(_Index)


def parse_index(data: bytes, name: str) -> list[str]:
    """The file names the weight_map of an index (`name`, for messages) points to, sorted.
    Raises ValueError when the bytes are not such an index."""
    try:
        index = _INDEX.decode(data)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{name} is not a safetensors index ({exc})") from None
    except msgspec.DecodeError:
        raise ValueError(f"{name} is not JSON") from None
    except RecursionError:
        raise ValueError(f"{name} nests JSON deeper than any index") from None
    if not index.weight_map:
        raise ValueError(f"{name} has no weight_map")
    files = set(index.weight_map.values())
    for value in sorted(files):
        if "/" in value or value in ("", ".", ".."):
            raise ValueError(f"{name} names a file {value[:200]!r} outside its directory")
    return sorted(files)


def index_files(index_path: str | Path) -> list[str]:
    """`parse_index` of a `*.safetensors.index.json` file, read up to SAFETENSORS_MAX_INDEX
    bytes. Raises ValueError when it is not an index, OSError when it cannot be read."""
    try:
        data = read_bounded(index_path, SAFETENSORS_MAX_INDEX)
    except TooLarge:
        raise ValueError(
            f"{os.path.basename(index_path)} is larger than {SAFETENSORS_MAX_INDEX} bytes; "
            "no index is"
        ) from None
    return parse_index(data, os.path.basename(index_path))


def missing_numbered_shards(names: Iterable[str]) -> list[str]:
    """For `x-00001-of-00003.*` names, the numbered siblings that are absent, sorted."""
    present = set(names)
    series = set()
    for name in present:
        m = _SHARD.match(name)
        if m:
            series.add((m["stem"], m["n"], m["ext"]))
    missing = []
    for stem, n, ext in series:
        for i in range(1, int(n) + 1):
            sibling = f"{stem}-{i:05d}-of-{n}.{ext}"
            if sibling not in present:
                missing.append(sibling)
    return sorted(missing)


def _prefix(directory: Path) -> str:
    """`directory` as a str ending in "/": a file's path is then one concatenation."""
    base = str(directory)
    return base if base.endswith("/") else base + "/"


def _check_each(paths: Iterable[str]) -> Iterator[Check]:
    return map(check_safetensors, paths)


def check_safetensors_dir(
    directory: Path,
    files: Sequence[str],
    check_files: Callable[[Iterable[str]], Iterable[Check]] = _check_each,
    read_index: Callable[[str], Iterable[str]] = index_files,
) -> Check:
    """A directory of safetensors: with `*.safetensors.index.json`, every file its
    weight_map names must exist and be complete; without one, every `.safetensors` file
    and every numbered sibling (`-0000i-of-0000N`) one of them implies. `files` is the
    listing the caller already has; `check_files` checks files (lazily: the first problem
    ends it) and `read_index` reads an index (a cache may wrap them). Files are named by
    str paths: thousands of shards per scan, and a pathlib join costs more than the stat a
    cached check needs."""
    base = _prefix(directory)
    indexes = sorted(n for n in files if n.endswith(SAFETENSORS_INDEX_SUFFIX))
    if indexes:
        wanted: set[str] = set()
        for index in indexes:
            try:
                wanted.update(read_index(base + index))
            except ValueError as exc:
                return _bad(index, "does not parse", str(exc))
            except OSError as exc:
                return _unopenable(index, exc)
    else:
        wanted = {n for n in files if n.endswith(".safetensors")}
        if not wanted:
            return _bad("", "no .safetensors files")
    names = tuple(sorted(wanted))
    present = set(files)
    for name in names + _implied_siblings(names):
        if name not in present:
            return _bad(name, "missing", "named by the index" if indexes else "")
    return combine(check_files([base + n for n in names]))


@functools.lru_cache(maxsize=1024)
def _implied_siblings(names: tuple[str, ...]) -> tuple[str, ...]:
    # the same models every rescan: a regex match per shard name only when they change
    return tuple(missing_numbered_shards(names))


# --- GGUF

# (block size in elements, bytes per block) per ggml type id, as in ggml.h and the gguf
# package's GGML_QUANT_SIZES (the agent does not depend on gguf; a test keeps them equal)
GGML_BLOCK: dict[int, tuple[int, int]] = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    9: (32, 40),  # Q8_1
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    15: (256, 292),  # Q8_K
    16: (256, 66),  # IQ2_XXS
    17: (256, 74),  # IQ2_XS
    18: (256, 98),  # IQ3_XXS
    19: (256, 50),  # IQ1_S
    20: (32, 18),  # IQ4_NL
    21: (256, 110),  # IQ3_S
    22: (256, 82),  # IQ2_S
    23: (256, 136),  # IQ4_XS
    24: (1, 1),  # I8
    25: (1, 2),  # I16
    26: (1, 4),  # I32
    27: (1, 8),  # I64
    28: (1, 8),  # F64
    29: (256, 56),  # IQ1_M
    30: (1, 2),  # BF16
    34: (256, 54),  # TQ1_0
    35: (256, 66),  # TQ2_0
    39: (32, 17),  # MXFP4
    40: (64, 36),  # NVFP4
    41: (128, 18),  # Q1_0
}

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
# value type id -> struct format of a fixed-size value (8 = string, 9 = array)
_GGUF_SCALAR = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# beyond these a header is garbage, not a model (largest real ones: ~2k tensors, ~50 keys,
# a ~30 MB header holding a 256k-token vocabulary, arrays of arrays one level deep)
_GGUF_MAX_TENSORS = 1_000_000
_GGUF_MAX_KV = 100_000
_GGUF_MAX_DIMS = 8
_GGUF_MAX_DEPTH = 8  # arrays within arrays
_GGUF_MAX_NAME = 65_535  # keys (the spec's limit) and tensor names, read into memory
GGUF_MAX_HEADER = 256 << 20  # bytes from the start of the file to the end of the header
# zeros parse as empty strings: a file preallocated (aria2) or sparse where the header goes
_ZEROS = "empty key or tensor name: zeros where the header should be (a download in progress?)"


class _Truncated(Exception):
    pass


class _Malformed(Exception):
    pass


class _Reader:
    """Sequential reads of a GGUF header through an in-memory window of the file, bounded by
    the file size and GGUF_MAX_HEADER. A vocabulary is ~150k strings, so the string-array
    loop stays in memory rather than costing a call into the file object per token."""

    _CHUNK = 1 << 20

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f, self.size = f, size
        self.e = "<"
        self.buf = b""
        self.off = 0  # position in buf
        self.base = f.tell()  # file position of buf[0]

    @property
    def pos(self) -> int:
        return self.base + self.off

    def _need(self, n: int) -> None:
        """The header goes on for n more bytes: is that possible?"""
        end = self.pos + n
        if end > self.size:
            raise _Truncated  # first: a download in progress is cut, not malformed
        if end > GGUF_MAX_HEADER:
            raise _Malformed(f"header runs past {GGUF_MAX_HEADER} bytes; no real one does")

    def _fill(self, n: int) -> None:
        """Make n bytes available at self.off."""
        self._need(n)
        parts = [self.buf[self.off :]]
        have = len(parts[0])
        want = max(n, self._CHUNK)
        while have < want:
            more = self.f.read(want - have)  # a raw read may return less: loop
            if not more:
                break
            parts.append(more)
            have += len(more)
        self.base += self.off
        self.buf, self.off = b"".join(parts), 0
        if have < n:
            raise _Truncated

    def take(self, n: int) -> bytes:
        if self.off + n > len(self.buf):
            self._fill(n)
        data = self.buf[self.off : self.off + n]
        self.off += n
        return data

    def skip(self, n: int) -> None:
        self._need(n)
        if self.off + n <= len(self.buf):
            self.off += n
            return
        self.base = self.pos + n
        self.f.seek(self.base)
        self.buf, self.off = b"", 0

    def unpack(self, fmt: str) -> int | float | bool:
        fmt = self.e + fmt
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def u32(self) -> int:
        return int(self.unpack("I"))

    def u64(self) -> int:
        return int(self.unpack("Q"))

    def string(self) -> bytes:
        """A key or tensor name: short, so it is read into memory."""
        n = self.u64()
        self._need(n)
        if n > _GGUF_MAX_NAME:
            raise _Malformed(f"a key or tensor name of {n} bytes (at most {_GGUF_MAX_NAME})")
        return self.take(n)

    def skip_strings(self, count: int) -> None:
        length = struct.Struct(self.e + "Q")
        while count:
            # fast path: as many strings as lie wholly inside the window
            buf, off, end = self.buf, self.off, len(self.buf)
            while count and off + 8 <= end:
                nxt = off + 8 + length.unpack_from(buf, off)[0]
                if nxt > end:
                    break
                off, count = nxt, count - 1
            self.off = off
            if count:  # one string across the window's edge
                self.skip(self.u64())
                count -= 1

    def value(self, vtype: int, want: bool, depth: int = 0) -> object:
        """Read (want=True) or skip one value; arrays and strings are only ever skipped."""
        if vtype in _GGUF_SCALAR:
            if want:
                return self.unpack(_GGUF_SCALAR[vtype])
            self.skip(struct.calcsize(_GGUF_SCALAR[vtype]))
        elif vtype == _GGUF_STRING:
            if want:
                return self.string()
            self.skip(self.u64())
        elif vtype == _GGUF_ARRAY:
            etype, count = self.u32(), self.u64()
            if etype in _GGUF_SCALAR:
                self.skip(count * struct.calcsize(_GGUF_SCALAR[etype]))
            elif count > self.size:  # every element takes at least one byte
                raise _Truncated
            elif etype == _GGUF_STRING:
                self.skip_strings(count)
            elif etype == _GGUF_ARRAY:
                if depth >= _GGUF_MAX_DEPTH:
                    raise _Malformed(f"arrays nested more than {_GGUF_MAX_DEPTH} deep")
                for _ in range(count):
                    self.value(etype, False, depth + 1)
            else:
                raise _Malformed(f"array of unknown value type {etype}")
        else:
            raise _Malformed(f"unknown value type {vtype}")
        return None


@dataclass(frozen=True, slots=True)
class GgufLayout:
    version: int
    tensors: int
    alignment: int
    data_start: int
    required_size: int  # data_start + the end of the last tensor
    kind: str = ""  # general.type: "model", "adapter" ("": unsaid)
    architecture: str = ""  # general.architecture
    lora_rank: int = 0  # an adapter's: the rows of its first LoRA A tensor (ggml's ne[1])


# header values the layout keeps beside general.alignment
_NAMED = (b"general.type", b"general.architecture")


def gguf_layout(f: BinaryIO, size: int) -> GgufLayout:
    """Walk a GGUF header from the start of `f` (a file of `size` bytes). Raises ValueError
    naming the problem; the message starts with "truncated" when the header runs past
    the end of the file."""
    try:
        return _gguf_layout(f, size)
    except _Truncated:
        raise ValueError(
            f"truncated: header runs past the end of the file ({size} bytes)"
        ) from None
    except _Malformed as exc:
        raise ValueError(str(exc)) from None


def _gguf_layout(f: BinaryIO, size: int) -> GgufLayout:
    r = _Reader(f, size)
    head = r.take(8)
    if head[:4] != GGUF_MAGIC:
        raise _Malformed("no GGUF magic")
    # GGUF v3 allows big-endian files; the version tells which
    (version,) = struct.unpack("<I", head[4:])
    if version not in (2, 3) and struct.unpack(">I", head[4:])[0] in (2, 3):
        r.e = ">"
        (version,) = struct.unpack(">I", head[4:])
    if version not in (2, 3):
        raise _Malformed(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = r.u64(), r.u64()
    if n_tensors > _GGUF_MAX_TENSORS or n_kv > _GGUF_MAX_KV:
        raise _Malformed(f"implausible counts: {n_tensors} tensors, {n_kv} key-values")
    alignment = GGUF_DEFAULT_ALIGNMENT
    named: dict[bytes, str] = {}
    for _ in range(n_kv):
        key = r.string()
        if not key:
            raise _Malformed(_ZEROS)
        vtype = r.u32()
        if key in _NAMED and vtype == _GGUF_STRING:
            named[key] = r.string()[:200].decode(errors="replace")
            continue
        value = r.value(vtype, key == b"general.alignment")
        if key == b"general.alignment":
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value <= 0
                or value & (value - 1)
            ):
                raise _Malformed(f"general.alignment {value!r} is not a power of two")
            alignment = value
    last_end = 0
    last_unknown: tuple[int, str, int] | None = None  # (offset, tensor, type) of an unsized tensor
    lora_rank = 0
    for _ in range(n_tensors):
        name = r.string()
        if not name:
            raise _Malformed(_ZEROS)
        n_dims = r.u32()
        if n_dims > _GGUF_MAX_DIMS:
            raise _Malformed(f"tensor {name[:60]!r} has {n_dims} dimensions")
        elements = 1
        dims = [r.u64() for _ in range(n_dims)]
        for d in dims:
            elements *= d
        if not lora_rank and n_dims == 2 and name.endswith(b".lora_a"):
            lora_rank = dims[1]
        ggml_type, offset = r.u32(), r.u64()
        if offset % alignment:
            raise _Malformed(f"tensor {name[:60]!r} offset {offset} is not aligned to {alignment}")
        block = GGML_BLOCK.get(ggml_type)
        if block is None:
            # a newer quant type: its size is unknown, but a later tensor still bounds it
            if last_unknown is None or offset > last_unknown[0]:
                last_unknown = (offset, name.decode(errors="replace"), ggml_type)
            last_end = max(last_end, offset)
            continue
        block_size, type_size = block
        last_end = max(last_end, offset + (elements + block_size - 1) // block_size * type_size)
    if last_unknown is not None and last_unknown[0] >= last_end:
        raise _Malformed(
            f"the last tensor {last_unknown[1]!r} has ggml type {last_unknown[2]}, unknown to "
            "this llmgw (update llmgw to recognise it)"
        )
    data_start = (r.pos + alignment - 1) // alignment * alignment
    return GgufLayout(
        version=version,
        tensors=n_tensors,
        alignment=alignment,
        data_start=data_start,
        required_size=data_start + last_end,
        kind=named.get(b"general.type", ""),
        architecture=named.get(b"general.architecture", ""),
        lora_rank=lora_rank,
    )


def gguf_metadata(f: BinaryIO, size: int, wanted: Callable[[str], bool]) -> dict[str, object]:
    """The header's values whose keys `wanted` accepts, when they are numbers or strings
    (what a GPU memory budget reads: "llama.block_count", ...), walking the header as
    `gguf_layout` does, as bounded. Raises ValueError naming the problem."""
    found: dict[str, object] = {}
    try:
        r = _Reader(f, size)
        head = r.take(8)
        if head[:4] != GGUF_MAGIC:
            raise _Malformed("no GGUF magic")
        if struct.unpack("<I", head[4:])[0] not in (2, 3):
            r.e = ">"
            if struct.unpack(">I", head[4:])[0] not in (2, 3):
                raise _Malformed("GGUF version is not supported (2 or 3)")
        _tensors, n_kv = r.u64(), r.u64()
        if n_kv > _GGUF_MAX_KV:
            raise _Malformed(f"implausible count: {n_kv} key-values")
        for _ in range(n_kv):
            key = r.string().decode(errors="replace")
            want = wanted(key)
            value = r.value(r.u32(), want)
            if want and value is not None:
                found[key] = value.decode(errors="replace") if isinstance(value, bytes) else value
    except _Truncated:
        raise ValueError(
            f"truncated: header runs past the end of the file ({size} bytes)"
        ) from None
    except _Malformed as exc:
        raise ValueError(str(exc)) from None
    return found


def check_gguf(path: str | Path, st: os.stat_result | None = None) -> Check:
    """One .gguf file: complete when its size reaches the end of its last tensor. `st`: a
    stat of `path` just taken (see `open_regular_fd`)."""
    name = os.path.basename(path)
    try:
        with open_regular(path, buffering=0, st=st) as f:
            size = os.fstat(f.fileno()).st_size
            layout = gguf_layout(f, size)
    except OSError as exc:
        return _unopenable(name, exc)
    except ValueError as exc:
        text = str(exc)
        if text.startswith("truncated"):
            return _bad(name, "truncated", f"{size} bytes, header not complete")
        return _bad(name, "header does not parse", text)
    if size < layout.required_size:
        return _bad(name, "truncated", f"{size} of {layout.required_size} bytes")
    if layout.kind == "adapter":
        arch, rank = layout.architecture, layout.lora_rank
        return Check(complete=True, bytes=size, files=1, adapter=True, arch=arch, rank=rank)
    return _ok(size)


@dataclass(frozen=True, slots=True)
class GgufSplit:
    stem: str  # "model" for model-00001-of-00003.gguf
    index: int
    total: int


def gguf_split(name: str) -> GgufSplit | None:
    """`model-00002-of-00003.gguf` -> (model, 2, 3); None for an unsplit file name."""
    m = _SHARD.match(name)
    if not m or m["ext"] != "gguf" or not 1 <= int(m["i"]) <= int(m["n"]):
        return None
    return GgufSplit(m["stem"], int(m["i"]), int(m["n"]))


def gguf_part_names(split: GgufSplit) -> list[str]:
    return [f"{split.stem}-{i:05d}-of-{split.total:05d}.gguf" for i in range(1, split.total + 1)]


def check_gguf_split(
    directory: Path,
    split: GgufSplit,
    files: Iterable[str],
    check_file: Callable[[str], Check] = check_gguf,
) -> Check:
    """A split GGUF is complete only when all N parts exist and each is complete."""
    present = set(files)
    names = gguf_part_names(split)
    for name in names:
        if name not in present:
            return _bad(name, "missing", f"part of {split.total}")
    base = _prefix(directory)
    return combine(check_file(base + n) for n in names)
