"""The node's id: its short hostname, which is also its certificate's common name."""

from __future__ import annotations

import socket

from llmgw.bus.keys import sanitize_token


def node_id_from_hostname(hostname: str) -> str:
    """`gpu05.dc1.example.com` -> `gpu05`, made a single NATS token.

    The short name because the certificate's CN and every operator's shell use it, and a
    `.` would split `nodes.<node>` into more tokens than the key pattern watches.
    """
    short = hostname.strip().split(".", 1)[0]
    return sanitize_token(short)


def read_hostname() -> str:
    return socket.gethostname()
