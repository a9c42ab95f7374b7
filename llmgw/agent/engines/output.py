"""An engine's output: the last lines kept in memory for reports, everything in a log file."""

from __future__ import annotations

import os
import re
import shutil
from collections import deque
from pathlib import Path

from llmgw.agent.files import open_regular, open_regular_for_append


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


AGENT_LINE = b"=== llmgw"  # how the agent's own lines in an engine's log begin

# A Python exception as a traceback ends it ("RuntimeError: ...", "vllm.v1.engine.exceptions.
# EngineDeadError: ..."), after vLLM's log prefix ("(EngineCore pid=1576) ERROR 12-06
# 03:34:45 [core.py:1512] ") where there is one. For a person to read, never to decide on.
_EXCEPTION = re.compile(
    r"^(?:\(\w+ pid=\d+\) )?(?:[A-Z]+ [\d-]+ [\d:.]+ \[[^\]]*\] )?"
    r"((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit)): (.+)$"
)
ERROR_SHOWN = 240  # characters of it in a failure's reason


def first_error(lines: list[str]) -> str:
    """The first exception a traceback in `lines` ends with (the cause: what follows it is
    the shutdown it set off), shortened; "" when there is none."""
    for line in lines:
        match = _EXCEPTION.match(line.strip())
        if match:
            name = match.group(1).rsplit(".", 1)[-1]
            text = f"{name}: {match.group(2).strip()}"
            return text if len(text) <= ERROR_SHOWN else text[: ERROR_SHOWN - 3] + "..."
    return ""


class EngineLog:
    """The per-shard log file, which the engine writes itself: its output goes there
    straight from its own descriptor (opened with O_APPEND), not through a pipe to the
    agent, so the engine keeps a place to write when the agent is restarted or killed, and
    the next agent reads its last lines from the file. Rotated once (`.1`) past `max_bytes`
    by copy and truncate: the engine's appends go on at the new end (O_APPEND), and a line
    written between the copy and the truncation may be lost, as with logrotate's
    copytruncate."""

    def __init__(self, path: Path, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.path = path
        self.max_bytes = max_bytes

    def open_for_engine(self) -> int:
        """A descriptor for the engine's stdout and stderr (the caller closes its copy)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rotate_if_large()
        return open_regular_for_append(self.path)

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def write(self, text: bytes) -> None:
        """One line of the agent's own (`=== llmgw ...`), between the engine's."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_regular_for_append(self.path)  # a FIFO or a link planted here: refused
        try:
            os.write(fd, text)
        finally:
            os.close(fd)
        self.rotate_if_large()

    def rotate_if_large(self) -> bool:
        if self.size() <= self.max_bytes:
            return False
        old = self.path.with_name(self.path.name + ".1")
        try:
            old.unlink(missing_ok=True)  # a link there would be written through
            shutil.copyfile(self.path, old, follow_symlinks=False)
            os.truncate(self.path, 0)
        except OSError:
            return False
        return True

    def tail(self, since: int = 0, max_bytes: int = 64 * 1024) -> list[str]:
        """The last lines written after offset `since` (where this run of the engine began;
        a truncation since then reads from the start), bounded like OutputTail."""
        tail = OutputTail()
        tail.feed(self._since(since, max_bytes))
        return tail.lines()

    def error(self, since: int = 0, max_bytes: int = 64 * 1024) -> str:
        """The first exception in the last `max_bytes` written after `since` (`first_error`):
        what an engine died of, which its last lines (its shutdown) may no longer show."""
        return first_error(self._since(since, max_bytes).decode("utf-8", "replace").split("\n"))

    def _since(self, since: int, max_bytes: int) -> bytes:
        """The engine's own bytes of the last `max_bytes` written after `since`."""
        try:
            with open_regular(self.path, follow=False) as f:
                end = f.seek(0, os.SEEK_END)
                start = since if since <= end else 0
                start = max(start, end - max_bytes)
                f.seek(start)
                data = f.read(end - start)
        except OSError:
            return b""
        if start > since and b"\n" in data:
            data = data.split(b"\n", 1)[1]  # began mid-line
        # the agent's own lines are in the file for a person; the tail is the engine's
        return b"\n".join(ln for ln in data.split(b"\n") if not ln.startswith(AGENT_LINE))
