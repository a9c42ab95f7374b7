"""The node's address: the local address on the route to the NATS server.

The kernel picks it for a UDP "connect", which sends nothing, so it is the address other
nodes on the control plane's network can reach, not whatever interface happens to be first.
"""

from __future__ import annotations

import logging
import socket
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

DEFAULT_NATS_PORT = 4222
FALLBACK_ADDRESS = "127.0.0.1"
_SCHEMES = ("nats", "tls")


def route_address(host: str, port: int) -> str:
    """The local address the kernel would use to reach `host:port` (IPv4 or IPv6, names
    resolved). Raises OSError when the name does not resolve or no route exists."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    last: OSError | None = None
    for family, type_, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, type_, proto) as sock:
                sock.connect(sockaddr)  # UDP: picks a route and source address, sends nothing
                return str(sock.getsockname()[0])
        except OSError as exc:
            last = exc
    raise last or OSError(f"{host!r} resolved to no usable address")


def address_for_urls(urls: list[str]) -> str:
    """The route address to the first of the NATS `urls` (nats:// or tls://) that resolves.

    Falls back to 127.0.0.1 only when none does, and says so: that address is right for a
    single machine and unreachable from any other node."""
    for url in urls:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        if parts.scheme not in _SCHEMES or not parts.hostname:
            log.warning(
                "skipping NATS URL %r for the node address: expected nats:// or tls://", url
            )
            continue
        try:
            port = parts.port or DEFAULT_NATS_PORT
        except ValueError:
            log.warning("skipping NATS URL %r for the node address: bad port", url)
            continue
        try:
            return route_address(parts.hostname, port)
        except OSError as exc:
            log.info("no route to NATS server %s for the node address: %s", url, exc)
    log.warning(
        "none of the NATS URLs %s resolved to a route; reporting address %s, which other "
        "nodes cannot reach: check the nats urls in the agent config and DNS",
        urls,
        FALLBACK_ADDRESS,
    )
    return FALLBACK_ADDRESS
