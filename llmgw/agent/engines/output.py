"""An engine's output: the last lines kept in memory for reports, everything in a log file."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import BinaryIO


class OutputTail:
    """The last `max_lines` lines, at most `max_bytes` in all: what a failure report carries.

    A carriage return starts the line over, as on a terminal, so download progress
    bars leave their last state instead of filling the tail.
    """

    def __init__(self, max_lines: int = 64, max_bytes: int = 8192) -> None:
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self._lines: deque[str] = deque()
        self._size = 0
        self._partial = b""

    def feed(self, chunk: bytes) -> None:
        data = self._partial + chunk
        *complete, self._partial = data.split(b"\n")
        for raw in complete:
            self._append(raw)
        if len(self._partial) > self.max_bytes:  # a line without end: keep its end
            self._partial = self._partial[-self.max_bytes :]

    def _append(self, raw: bytes) -> None:
        raw = raw.rstrip(b"\r").rsplit(b"\r", 1)[-1]
        line = raw.decode("utf-8", "replace")[-self.max_bytes :]
        self._lines.append(line)
        self._size += len(line) + 1
        while len(self._lines) > self.max_lines or self._size > self.max_bytes:
            self._size -= len(self._lines.popleft()) + 1

    def lines(self) -> list[str]:
        out = list(self._lines)
        if self._partial:
            out.append(self._partial.rsplit(b"\r", 1)[-1].decode("utf-8", "replace"))
        return out[-self.max_lines :]

    def clear(self) -> None:
        self._lines.clear()
        self._size = 0
        self._partial = b""


class EngineLog:
    """Append-only per-shard log file, rotated once (`.1`) past `max_bytes`."""

    def __init__(self, path: Path, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._file: BinaryIO | None = None
        self._written = 0

    def open(self) -> None:
        self.close()  # a restart reopens: the file may have been rotated or removed
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")  # noqa: SIM115 - closed in close()
        self._written = self._file.tell()
        if self._written > self.max_bytes:
            self._rotate()

    def write(self, chunk: bytes) -> None:
        if self._file is None:
            return
        # small appends to a local file: cheaper inline than a thread hop per chunk
        self._file.write(chunk)
        self._file.flush()
        self._written += len(chunk)
        if self._written > self.max_bytes:
            self._rotate()

    def _rotate(self) -> None:
        assert self._file is not None
        self._file.close()
        self.path.replace(self.path.with_name(self.path.name + ".1"))
        self._file = open(self.path, "ab")  # noqa: SIM115
        self._written = 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
