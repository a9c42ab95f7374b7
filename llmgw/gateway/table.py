"""KeyTable: the keys and teams a router knows, from its watch of `apikeys.*` and `teams.*`.

Every check is a dict lookup and SHA-256 digests against what the table holds (as many
for a name that is no key's: credentials.match): no NATS round trip on the request path.
Expiry and revocation times are compared with the clock at each request, so an expired
key fails on a router cut off from NATS too. A revocation reaches a
router through its watch (milliseconds); a router cut off from NATS cannot hear of one, so
it serves the keys it knows for `serve_known_for` seconds after it was cut off (default
300) and then refuses every key with 503 until its watch is back.

A value of `apikeys.<name>` or `teams.<team>` that does not read (garbled by hand, the wrong
type, a name that is not its key's) keeps the last good value the table read
(llmgw/fleetstate/decode.py, the one decoder): a key keeps working with its old limits and
models, a team's keys keep its old limits. One never read good grants nothing: the key is
refused (401), the team's keys are refused (403); and a key that does not read counts as a
key, so a fleet whose only key is garbled still requires keys. `unreadable` holds them (the
log, `llmgw_router_unreadable_keys`, `llmgw status`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable

from llmgw import priority
from llmgw.bus import keys, records, trust
from llmgw.bus.records import ApiKey, Team
from llmgw.fleetstate.decode import Unreadable, settle

from . import credentials, refusals
from .refusals import Refusal

log = logging.getLogger(__name__)

# a whole NATS outage of 10 minutes is served through (docs/reliability.md)
SERVE_KNOWN_FOR = 600.0
# `Authorization` headers already checked against the record their secret matched: a
# request with one costs a dict lookup, not a header parse and a SHA-256; dropped whole
# when full (a flood of wrong secrets is never added)
MAX_CHECKED = 10_000


_NO_LIMITS = records.Limits()


class Identity:
    """Who sent a request: its key's record and its team's (None: no team, or a team the
    bucket does not hold, which then limits nothing). Made once per key while its records
    hold, so what a request asks of it is read, not worked out again."""

    __slots__ = (
        "key",
        "team",
        "name",
        "team_name",
        "limited",
        "standing",
        "_allowed",
        "_allowed_set",
    )

    def __init__(self, key: ApiKey, team: Team | None) -> None:
        self.key = key
        self.team = team
        self.name = key.name
        self.team_name = key.team
        # whether any limit applies to it (its own, on a model, its team's)
        self.limited = any(
            limits != _NO_LIMITS
            for limits in (key.limits, key.model_limits, team.limits if team else _NO_LIMITS)
        )
        # its class (its own, else its team's, else standard) and its team's weight: who
        # waits when the fleet is full (llmgw/priority.py)
        own = key.priority or (team.priority if team is not None else None)
        self.standing = priority.Standing(
            priority.BY_NAME[own] if own else priority.Priority.STANDARD,
            key.team or "",
            team.weight if team is not None else 1,
            key.name,
        )
        mine = key.models or None
        theirs = team.models if team is not None and team.models else None
        if mine is None:
            allowed = theirs
        elif theirs is None:
            allowed = mine
        else:
            allowed = [m for m in mine if m in theirs]
        self._allowed = None if allowed is None else list(allowed)
        self._allowed_set = None if allowed is None else frozenset(allowed)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Identity) and (self.key, self.team) == (other.key, other.team)

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"Identity(key={self.name!r}, team={self.team_name!r})"

    def allowed(self) -> list[str] | None:
        """The models this identity may use; None: every model. A key's list and its team's
        both apply."""
        return None if self._allowed is None else list(self._allowed)

    def may_use(self, model: str) -> bool:
        allowed = self._allowed_set
        return allowed is None or model in allowed


def bearer(authorization: str | None) -> str | None:
    """The secret of an `Authorization: Bearer <secret>` header."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None


class KeyTable:
    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.time,
        serve_known_for: float = SERVE_KNOWN_FOR,
    ) -> None:
        self.clock = clock
        self.serve_known_for = serve_known_for
        self._keys: dict[str, ApiKey] = {}
        self._teams: dict[str, Team] = {}
        self._cut_off_since: float | None = None
        self._checked: dict[str, tuple[ApiKey, records.SecretHash]] = {}
        self._identities: dict[str, Identity] = {}  # one per key, while its records hold
        # `Authorization` headers as they came (bytes) -> (identity, until when it holds,
        # the table's generation then): a request with a known header costs one lookup
        self._headers: dict[bytes, tuple[Identity, float, int]] = {}
        self._generation = 0  # every change to what the table holds adds one
        # keys whose newest value does not read, and what is read instead (kept or refused)
        self.unreadable: dict[str, Unreadable] = {}
        self._refused_keys: set[str] = set()  # names: garbled, never read good
        self._told: set[str] = set()  # of those, the ones a request presented (logged, once)
        self._refused_teams: set[str] = set()
        self.skipped = trust.SkippedValues()

    # --- fed by the watch --------------------------------------------------------------

    def apply_raw(self, key: str, data: bytes | None, revision: int) -> None:
        """One update of the watch as stored (None: deleted), read by the bucket's one
        decoder: a value that does not read keeps the last good one, or grants nothing."""
        parsed = keys.parse_gateway(key)
        if parsed is None:
            return
        name = parsed.ids[0]
        refused = self._refused_keys if parsed.prefix == keys.APIKEYS else self._refused_teams
        self.unreadable.pop(key, None)
        refused.discard(name)
        if data is None:
            self.apply(key, None)
            return
        held = self._keys if parsed.prefix == keys.APIKEYS else self._teams
        value, problem = settle(parsed, key, data, revision, held.get(name), self.skipped)
        if problem is not None:
            self.unreadable[key] = problem
            if value is None:
                refused.add(name)
        self.apply(key, value)

    def unreadable_counts(self) -> dict[tuple[str, str], int]:
        """(family, reading) -> keys whose newest value does not read."""
        return dict(Counter((u.family, u.reading) for u in self.unreadable.values()))

    def apply(self, key: str, value: object) -> None:
        """One update of the watch: a record, or None when the key was deleted."""
        parsed = keys.parse_gateway(key)
        if parsed is None:
            return
        self._generation += 1
        name = parsed.ids[0]
        if parsed.prefix == keys.APIKEYS:
            if isinstance(value, ApiKey):
                self._keys[name] = value
            else:
                self._keys.pop(name, None)
                self._identities.pop(name, None)
        elif parsed.prefix == keys.TEAMS:
            if isinstance(value, Team):
                self._teams[name] = value
            else:
                self._teams.pop(name, None)

    def cut_off(self, now: float | None = None) -> None:
        """The watch lost NATS: from now the table may miss revocations."""
        if self._cut_off_since is None:
            self._cut_off_since = self.clock() if now is None else now
            self._generation += 1

    def caught_up(self) -> None:
        """The watch has replayed the bucket again: the table is current."""
        self._cut_off_since = None
        self._generation += 1

    # --- asked per request ---------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """Keys are required once the bucket holds any (one that does not read counts)."""
        return bool(self._keys) or bool(self._refused_keys)

    def key(self, name: str) -> ApiKey | None:
        return self._keys.get(name)

    def team(self, name: str) -> Team | None:
        return self._teams.get(name)

    def teams(self) -> list[str]:
        return sorted(self._teams)

    def authenticate_header(self, header: bytes | None, now: float) -> Identity | Refusal:
        """`authenticate` for an `Authorization` header as it came: a header seen before
        costs one lookup while the table is unchanged (any update, or losing NATS, forgets
        them all) and its key and secret are in their time."""
        if header is not None:
            seen = self._headers.get(header)
            if seen is not None and seen[2] == self._generation and now < seen[1]:
                return seen[0]
        authorization = None if header is None else header.decode("latin-1")
        found = self.authenticate(authorization, now)
        if isinstance(found, Identity) and header is not None and self._cut_off_since is None:
            checked = self._checked.get(authorization)
            if checked is not None:
                until = min(
                    (
                        t
                        for t in (
                            checked[0].expires_at,
                            checked[0].revoked_at,
                            checked[1].valid_until,
                        )
                        if t is not None
                    ),
                    default=math.inf,
                )
                if len(self._headers) >= MAX_CHECKED:
                    self._headers.clear()
                self._headers[header] = (found, until, self._generation)
        return found

    def authenticate(
        self, authorization: str | None, now: float | None = None
    ) -> Identity | Refusal:
        now = self.clock() if now is None else now
        if self._cut_off_since is not None and now - self._cut_off_since > self.serve_known_for:
            return Refusal(
                503,
                "server_error",
                "keys_unavailable",
                f"this router has not heard from NATS for {now - self._cut_off_since:.0f} s "
                f"and no longer trusts its copy of the keys (after {self.serve_known_for:.0f} "
                "s); try another router",
                retry_after=1.0,
            )
        record = self._known(authorization, now)
        if record is None:
            secret = bearer(authorization)
            if secret is None:
                return refusals.unauthenticated("no API key given")
            record = self._match(authorization, secret, now)
        if record is None:
            name = credentials.name_of(secret) if self._refused_keys else None
            if name in self._refused_keys and name not in self._told:
                # said here, not to the client: a 401 must not tell that a name exists
                self._told.add(name)
                log.warning(
                    "router: a request presented API key %s, whose record in the bucket does "
                    "not read: refused (401) until it is fixed (`llmgw key show %s`)",
                    name,
                    name,
                )
            return refusals.unauthenticated("incorrect API key provided")
        if record.revoked_at is not None and now >= record.revoked_at:
            return refusals.unauthenticated(f"API key {record.name} was revoked")
        if record.expires_at is not None and now >= record.expires_at:
            return refusals.unauthenticated(f"API key {record.name} has expired")
        team = self._teams.get(record.team) if record.team else None
        if team is None and record.team in self._refused_teams:
            return refusals.team_unreadable(record.name, record.team)
        known = self._identities.get(record.name)
        if known is not None and known.key is record and known.team is team:
            return known
        identity = self._identities[record.name] = Identity(record, team)
        return identity

    def _known(self, authorization: str | None, now: float) -> ApiKey | None:
        """The record an `Authorization` header was checked against before, while that
        record is still the one held (and its secret, if rotated, within its grace)."""
        checked = self._checked.get(authorization) if authorization else None
        if checked is None:
            return None
        record, stored = checked
        if self._keys.get(record.name) is not record:
            return None
        if stored.valid_until is not None and now >= stored.valid_until:
            return None
        return record

    def _match(self, authorization: str, secret: str, now: float) -> ApiKey | None:
        """The record `secret` is a secret of, now (a rotated one only within its grace),
        remembered by the header that carried it."""
        name = credentials.name_of(secret)
        record = self._keys.get(name) if name is not None else None
        # the same work whether the name is a key's or not (credentials.match)
        stored = credentials.match(record.secrets if record is not None else (), secret, now)
        if record is None or stored is None:
            return None
        if len(self._checked) >= MAX_CHECKED:
            self._checked.clear()
        self._checked[authorization] = (record, stored)
        return record

    def authorize(self, identity: Identity, model: str) -> Refusal | None:
        if identity.may_use(model):
            return None
        return refusals.not_allowed(model, identity.allowed() or [])

    def visible(self, identity: Identity | None, models: Iterable[str]) -> list[str]:
        """`GET /v1/models` for this identity: only the models it may use."""
        if identity is None:
            return list(models)
        return [m for m in models if identity.may_use(m)]
