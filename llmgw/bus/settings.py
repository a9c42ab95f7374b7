"""What a component needs to know to reach NATS and its bucket: URLs, TLS files, timings.

Settings that can never work (a URL that is not NATS's, a TLS file that is missing, not PEM,
encrypted, or not its certificate's key) are said at once, as a BusError naming the setting
and the fix, before anything connects. Imports no nats.
"""

from __future__ import annotations

import os
import ssl
import urllib.parse
from dataclasses import dataclass

from llmgw.files import NotRegularFile, open_regular

from . import keys
from .errors import BusSettingsError

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_HEALTHY_AFTER = 10.0
_MAX_PEM_BYTES = 1 << 20  # a certificate chain or key file; anything bigger is not one
_SCHEMES = ("nats", "tls", "ws", "wss")


@dataclass(frozen=True)
class NatsSettings:
    urls: tuple[str, ...] = (DEFAULT_NATS_URL,)
    ping_interval: float = 3.0  # seconds between keepalive PINGs
    max_outstanding_pings: int = 2  # unanswered PINGs before the server is left
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_hostname: str | None = None
    name: str = "llmgw"
    # what this client claims to be, for refusal messages ("node05 (from hostname)")
    identity: str = ""
    inbox_prefix: str | None = None
    connect_timeout: float = 2.0
    healthy_after: float = DEFAULT_HEALTHY_AFTER
    backoff_base: float = 1.0  # first reconnect within [0, 1] s: spread (bus/backoff.py)
    backoff_cap: float = 30.0

    def check_urls(self) -> None:
        """Raise BusError naming the first URL that is not a NATS URL, and the fix."""
        if not self.urls:
            raise BusSettingsError(
                "no NATS URL given: set --nats (or nats.urls) to nats://HOST:4222"
            )
        schemes = {check_url(u) for u in self.urls}
        if schemes & {"ws", "wss"} and schemes - {"ws", "wss"}:
            raise BusSettingsError(
                f"NATS URLs {', '.join(self.urls)} mix websocket (ws://, wss://) and plain "
                "(nats://, tls://) servers, which one connection cannot: list one kind"
            )

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for the configured files; BusError naming the file and what is
        wrong with it (missing, unreadable, not PEM, encrypted, key not the certificate's)."""
        if not (self.tls_ca or self.tls_cert or self.tls_key):
            return None
        if self.tls_cert and not self.tls_key:
            raise BusSettingsError(
                f"TLS certificate {self.tls_cert} given without its key: set tls_key"
            )
        if self.tls_key and not self.tls_cert:
            raise BusSettingsError(
                f"TLS key {self.tls_key} given without its certificate: set tls_cert"
            )
        if self.tls_ca:
            _check_pem(self.tls_ca, "TLS CA file", "tls_ca", b"CERTIFICATE")
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
        except ssl.SSLError as e:
            raise BusSettingsError(
                f"TLS CA file {self.tls_ca} holds no usable CA certificate ({e.reason or e}): "
                "give the PEM file of the CA that signed the server's certificate"
            ) from None
        if self.tls_cert and self.tls_key:
            _check_pem(self.tls_cert, "TLS certificate", "tls_cert", b"CERTIFICATE")
            key = _check_pem(self.tls_key, "TLS key", "tls_key", b"PRIVATE KEY")
            if b"ENCRYPTED" in key:
                raise BusSettingsError(
                    f"TLS key {self.tls_key} is encrypted, and llmgw cannot ask for its "
                    "passphrase: store it unencrypted (`openssl pkey -in KEY -out KEY.plain`), "
                    "readable only by the user llmgw runs as"
                )
            try:
                # a callback that refuses: OpenSSL must never prompt on a terminal
                ctx.load_cert_chain(self.tls_cert, self.tls_key, password=_no_passphrase)
            except (ssl.SSLError, ValueError) as e:
                raise BusSettingsError(
                    f"cannot use TLS certificate {self.tls_cert} with key {self.tls_key} "
                    f"({getattr(e, 'reason', None) or e}): the key must be that certificate's "
                    "private key (compare `openssl x509 -noout -pubkey -in CERT` with "
                    "`openssl pkey -pubout -in KEY`)"
                ) from None
        return ctx


def check_url(url: str) -> str:
    """The scheme of a NATS URL (nats, tls, ws, wss; `host:port` alone reads as nats, as
    nats-py reads it); BusError naming the URL and the fix for anything else."""
    scheme, sep, rest = url.strip().partition("://")
    if not sep:
        scheme, rest = "nats", url.strip()
    fix = "write nats://HOST:4222 (tls:// insists on TLS; ws://, wss:// reach a websocket port)"
    if scheme.lower() not in _SCHEMES:
        raise BusSettingsError(f"{url!r} is not a NATS URL (scheme {scheme}://): {fix}")
    try:
        parsed = urllib.parse.urlsplit(f"{scheme}://{rest}")
        parsed.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as e:
        raise BusSettingsError(f"{url!r} is not a NATS URL ({e}): {fix}") from None
    if not parsed.hostname or parsed.path not in ("", "/") or parsed.query:
        raise BusSettingsError(
            f"{url!r} is not a NATS URL (expected only a host and a port): {fix}"
        )
    return scheme.lower()


def _no_passphrase() -> bytes:
    raise ValueError("the key is encrypted")


def _check_pem(path: str, what: str, setting: str, kind: bytes) -> bytes:
    """The file's bytes, if it is a readable PEM file holding `kind`; BusError otherwise."""
    fix = f"set {setting} (--{setting.replace('_', '-')}) to the right PEM file"
    try:
        # a FIFO or a device is refused, never opened: an open() waits for a FIFO's writer
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(_MAX_PEM_BYTES + 1)
    except FileNotFoundError:
        raise BusSettingsError(f"{what} {path} does not exist: {fix}") from None
    except NotRegularFile as e:
        kind = "a directory, not a file" if e.kind == "a directory" else f"{e.kind}, not a file"
        raise BusSettingsError(f"{what} {path} is {kind}: {fix}") from None
    except PermissionError:
        raise BusSettingsError(
            f"{what} {path} cannot be read by this user (uid {os.getuid()}): make it readable "
            "by the user llmgw runs as"
        ) from None
    except OSError as e:
        raise BusSettingsError(f"{what} {path} cannot be read ({e.strerror or e}): {fix}") from None
    if size > _MAX_PEM_BYTES or len(data) > _MAX_PEM_BYTES:
        raise BusSettingsError(f"{what} {path} is {size:,} bytes, too big for a PEM file: {fix}")
    if b"-----BEGIN " not in data:
        raise BusSettingsError(
            f"{what} {path} is not PEM (no '-----BEGIN' line; DER or another format?): {fix}; "
            "convert DER with `openssl x509 -inform der -in FILE -out FILE.pem` "
            "(`openssl pkey -inform der ...` for a key)"
        )
    if kind + b"-----" not in data:
        raise BusSettingsError(
            f"{what} {path} is PEM but holds no {kind.decode()} (another file given here?): {fix}"
        )
    return data


@dataclass(frozen=True)
class BucketSettings:
    name: str = keys.DEFAULT_BUCKET
    # None: not specified by the operator; a missing bucket is created with the defaults
    # and an existing one is accepted as it is. Given: checked against the bucket.
    replicas: int | None = None
    history: int | None = None
    # False: wait for a missing bucket, never make it. An agent: one of a thousand started
    # before the controller would otherwise decide the bucket's replicas for the fleet.
    create: bool = True
