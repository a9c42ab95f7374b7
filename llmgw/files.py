"""Reading files llmgw does not control: weights, their indexes, share-id files, TLS and key
files, configs and catalogs.

Anyone who can write into a shared weights directory decides what these are, and an
operator's path may name anything. A FIFO named `model.safetensors` blocks a plain `open()`
until someone writes to it, and a device file can be read forever; so only regular files
are read, they are opened without blocking, and every read has a bound.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


class NotRegularFile(OSError):
    """The path is a FIFO, socket, device or directory: nothing the agent reads."""

    def __init__(self, path: str | Path, kind: str) -> None:
        super().__init__(errno.EINVAL, f"is {kind}, not a regular file", str(path))
        self.kind = kind  # "a FIFO"


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a special file"


def _refuse(path: str | Path, mode: int) -> NotRegularFile:
    return NotRegularFile(path, _kind(mode))


def open_regular_fd(
    path: str | Path, st: os.stat_result | None = None, *, follow: bool = True
) -> tuple[int, os.stat_result]:
    """A raw descriptor on `path` and its fstat, when it is a regular file (links to one are
    fine); NotRegularFile (an OSError) otherwise. Never blocks on a FIFO or a device: the
    kind is checked before opening, and again on what was opened, in case the path was
    swapped in between. The descriptor keeps O_NONBLOCK, which regular files ignore; the
    caller closes it. For readers that need no file object (a header check per shard): an
    open, an fstat, the reads and a close, without the fcntl and fstat calls a file adds.
    `st`, a stat of `path` the caller has just taken (a cache keyed by it), saves the one
    before opening. `follow=False`: a symbolic link is refused too (O_NOFOLLOW), for files
    only the agent writes, such as its pidfiles, where a link is never its own."""
    if st is None:
        st = os.stat(path) if follow else os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, st.st_mode)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags if follow else flags | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:  # became a link after the lstat
            raise NotRegularFile(path, "a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def open_regular(
    path: str | Path, *, buffering: int = -1, st: os.stat_result | None = None, follow: bool = True
) -> BinaryIO:
    """`path` opened for binary reading when it is a regular file, as `open_regular_fd`."""
    fd, _ = open_regular_fd(path, st, follow=follow)
    try:
        os.set_blocking(fd, True)  # regular files ignore O_NONBLOCK; say what is meant
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def open_regular_for_append(path: str | Path, mode: int = 0o640) -> int:
    """A descriptor appending to `path` (created when missing), for a file only the agent
    and its engines write (an engine's log): NotRegularFile when it is a link, a FIFO or a
    device. Never blocks: a FIFO is refused, not waited on for a reader. The caller closes
    it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(path, flags, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotRegularFile(path, "a symbolic link") from None
        if e.errno == errno.ENXIO:  # a FIFO nobody reads
            raise NotRegularFile(path, "a FIFO") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, st.st_mode)
        os.set_blocking(fd, True)  # regular files ignore O_NONBLOCK; say what is meant
    except BaseException:
        os.close(fd)
        raise
    return fd


class TooLarge(ValueError):
    pass


_CHUNK = 1 << 20


def read_bounded(path: str | Path, limit: int, *, follow: bool = True) -> bytes:
    """The whole of a regular file of at most `limit` bytes. TooLarge (a ValueError naming
    the file and the limit) when it is longer; OSError when it cannot be read (NotRegularFile
    when it is no regular file, or with `follow=False` a symbolic link)."""
    with open_regular(path, follow=follow) as f:
        # files in /proc say size 0: read in chunks to the end or just past the bound
        chunks, total = [], 0
        while total <= limit:
            chunk = f.read(min(_CHUNK, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    if total > limit:
        raise TooLarge(f"{path} is larger than {limit} bytes, more than such a file ever holds")
    return b"".join(chunks)


def read_text_bounded(path: str | Path, limit: int) -> str:
    """`read_bounded`, decoded as UTF-8 with undecodable bytes replaced."""
    return read_bounded(path, limit).decode(errors="replace")


def bounded_lines(path: str | Path, max_lines: int, max_chars: int) -> Iterator[str]:
    """The first `max_lines` lines of a regular file, each cut at `max_chars` (the rest of
    a longer line comes as further lines), decoded as UTF-8 with undecodable bytes
    replaced: a kernel table such as /proc/net/tcp, read without holding it whole."""
    with open_regular(path) as f:
        for _ in range(max_lines):
            line = f.readline(max_chars)
            if not line:
                return
            yield line.decode(errors="replace")


class NotUtf8(ValueError):
    """A text file (TOML: a config, a catalog, a fleet file) whose bytes are not UTF-8: the
    message names the file, where, and the fix."""


def utf8_text(data: bytes, path: str | Path) -> str:
    """`data` decoded as UTF-8, as TOML files are; NotUtf8 naming the first byte that is
    not, by line and column, rather than a UnicodeDecodeError traceback."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise NotUtf8(
            f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at line {line}, column "
            f"{column}); save it as UTF-8"
        ) from None
