"""API key secrets: `llmgw-<name>-<64 hex digits>`, stored only as salted SHA-256.

A secret is 32 random bytes (256 bits) from the OS's generator. Guessing one from its hash
means trying 2**255 secrets on average, so one fast hash is enough: slow hashes (bcrypt,
scrypt, argon2) exist for passwords, which people choose from a small space. The salt (16
random bytes per secret) keeps two keys' hashes from being compared or precomputed. The
key's name is in the secret so that a router finds its record with one dict lookup.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Sequence

from llmgw.bus import keys
from llmgw.bus.records import MAX_KEY_SECRETS, SecretHash

PREFIX = "llmgw-"
SECRET_BYTES = 32
SALT_BYTES = 16
MAX_SECRET = 256  # characters of a header's key: longer is not one of ours


def new_secret(name: str) -> str:
    """A fresh secret for the key `name`."""
    keys.check_token(name, "key name")
    return f"{PREFIX}{name}-{os.urandom(SECRET_BYTES).hex()}"


def name_of(secret: str) -> str | None:
    """The key name a secret carries; None if it is not shaped like one of ours."""
    if len(secret) > MAX_SECRET or not secret.startswith(PREFIX):
        return None
    name, sep, random_part = secret[len(PREFIX) :].rpartition("-")
    if not sep or len(random_part) != SECRET_BYTES * 2 or not keys.is_token(name):
        return None
    return name


def _digest(salt: bytes, secret: str) -> bytes:
    return hashlib.sha256(salt + secret.encode()).digest()


def hash_secret(secret: str, now: float | None = None) -> SecretHash:
    salt = os.urandom(SALT_BYTES)
    return SecretHash(
        salt=salt.hex(),
        sha256=_digest(salt, secret).hex(),
        created_at=time.time() if now is None else now,
    )


def matches(stored: SecretHash, secret: str, now: float) -> bool:
    """`secret` is the one `stored` was made from, and not past its grace. One digest
    whatever `stored` holds (a garbled hash is checked against nothing)."""
    try:
        salt, want = bytes.fromhex(stored.salt), bytes.fromhex(stored.sha256)
    except ValueError:
        salt, want = _NO_SALT, b""
    same = hmac.compare_digest(_digest(salt, secret), want)
    return same and (stored.valid_until is None or now < stored.valid_until)


_NO_SALT = bytes(SALT_BYTES)
_NOTHING = SecretHash(salt=_NO_SALT.hex(), sha256="", created_at=0.0)


def match(stored: Sequence[SecretHash], secret: str, now: float) -> SecretHash | None:
    """The hash of `stored` that `secret` matches now, if any. A secret that matches none
    costs MAX_KEY_SECRETS digests whatever the key holds, or if there is no such key (call
    it with none): how long a refusal takes tells nothing of whether a key of that name
    exists, nor how many secrets it has."""
    found = None
    for s in stored[:MAX_KEY_SECRETS]:
        if matches(s, secret, now) and found is None:
            found = s
    for _ in range(MAX_KEY_SECRETS - min(len(stored), MAX_KEY_SECRETS)):
        matches(_NOTHING, secret, now)
    return found
