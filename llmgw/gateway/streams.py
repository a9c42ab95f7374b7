"""What a router knows of the streams beside the bucket (LLMGW_LIMITS, LLMGW_USAGE,
LLMGW_AUDIT): which ones its adds and appends found missing.

Only the operator makes them (`llmgw up` as it starts, `llmgw key ls`, `llmgw key|team
create`, `llmgw audit`); a router cannot, and under mTLS may not. A fleet whose keys were
written by hand (`nats kv put apikeys.x ...`) can have keys and no streams: the router says
so once (the log), and all the time (`llmgw_router_streams_missing`, /health), naming the
fix. Meanwhile limited keys get what `--limits-offline` says (llmgw/gateway/limiter.py);
usage counts and audit records wait in the router until the stream takes them.
"""

from __future__ import annotations

import logging

from llmgw.bus import keys

log = logging.getLogger(__name__)

STREAMS = (keys.LIMITS_STREAM, keys.USAGE_STREAM, keys.AUDIT_STREAM)


class StreamsSeen:
    def __init__(self, offline: str = "serve", serve_offline_for: float = 600.0) -> None:
        self.offline = offline
        self.serve_offline_for = serve_offline_for
        self.missing: set[str] = set()

    def lacking(self, stream: str) -> None:
        """An add or append found no stream `stream` (connected: no responders)."""
        if stream in self.missing:
            return
        first = not self.missing
        self.missing.add(stream)
        if not first:
            return
        limited = (
            "limited keys are served only from the shares this router already holds (none "
            f"if it never reached the stream), for at most {self.serve_offline_for:.0f} s, "
            "then refused with 503"
            if self.offline == "serve"
            else "limited keys are refused with 503"
        )
        log.warning(
            "the bucket holds API keys but stream %s does not exist on NATS: %s "
            "(--limits-offline %s); usage counts and audit records wait in this router until "
            "it does. The operator makes the streams: run `llmgw key ls` with the operator's "
            "credentials (or restart `llmgw up`, which makes them); a router does not",
            stream,
            limited,
            self.offline,
        )

    def found(self, stream: str) -> None:
        """An add or append on `stream` was stored."""
        if stream not in self.missing:
            return
        self.missing.discard(stream)
        if not self.missing:
            log.warning("the gateway's streams exist now: limits, usage and audit work again")

    def state(self) -> dict[str, int]:
        """stream -> 1 when missing, 0 when not (found or never tried)."""
        return {s: int(s in self.missing) for s in STREAMS}
