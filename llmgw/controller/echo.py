"""Is the controller's watch live? Its own writes of the leader key must come back through it.

The watch is one consumer, on one of the servers that hold the bucket's stream, chosen by
the cluster: not necessarily the server the controller is connected to. When that server
dies the watch goes silent while the connection, its round trips and its writes are all
fine, and every lease looks still: a controller judged a ready node unreachable 10.7 s
after the death of a server that led nothing and held none of its connections. The watch
delivers in the order the bucket stored, so once it shows a write of the controller's, it
has shown everything stored before that write: a renewal of the leader key made after a
judgement's moment and seen back proves every lease that moved before it was seen.

Pure, time passed in: the loop says what it wrote (`expect`) and what the watch showed
(`saw`), and asks whether a write is shown (`shows`) and whether the echo is overdue. The
watch may show a write before the write's own answer comes back (both come from the
server, in no set order), so what was shown is kept, not only what is awaited.
"""

from __future__ import annotations

from dataclasses import dataclass

ECHO_WITHIN_S = 5.0  # a write of its own not shown by then: the watch is made again


@dataclass
class Echo:
    within: float = ECHO_WITHIN_S
    _awaited: int = 0  # the leader key's revision written and not yet shown; 0: none
    _since: float = 0.0  # when that write was answered
    _shown: int = 0  # the latest revision of the leader key the watch has shown

    @property
    def awaited(self) -> int:
        return self._awaited

    def expect(self, revision: int, now: float) -> None:
        """The controller wrote the leader key at `revision` (answered at `now`); nothing
        is awaited when the watch has shown it already."""
        if revision > max(self._awaited, self._shown):
            self._awaited, self._since = revision, now

    def saw(self, revision: int) -> None:
        """The watch showed the leader key at `revision`: that write and every one before
        it are shown."""
        self._shown = max(self._shown, revision)
        if self._awaited and revision >= self._awaited:
            self._awaited = 0

    def shows(self, revision: int) -> bool:
        """Whether the watch has shown the write at `revision` (or a later one)."""
        return revision <= self._shown

    def overdue(self, now: float) -> bool:
        """Whether the write awaited has gone unshown for longer than `within`."""
        return bool(self._awaited) and now - self._since > self.within

    def forget(self) -> None:
        """The watch is being made again: whatever it shows next starts afresh."""
        self._awaited = 0
