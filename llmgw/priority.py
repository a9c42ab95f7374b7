"""Priority classes: who waits when the fleet is full (docs/router.md, "Who waits when the
fleet is full").

A request's class is its key's, else its key's team's, else standard: bound to who sent it,
never to what the client says. A fleet without keys serves everyone as standard. A request
may lower its own class, never raise it: `x-llmgw-priority: sheddable`, or OpenAI's
`service_tier` as the SDKs send it (`flex`, the cheaper and slower tier, is sheddable;
`priority` asks for critical and gets at most the key's class; `default` is standard;
`auto` leaves the key's class).
"""

from __future__ import annotations

import enum

import msgspec

from llmgw.bus.records import PRIORITY_CLASSES


class Priority(enum.IntEnum):
    """In the order requests leave a router's queue: a lower value goes first."""

    CRITICAL = 0
    STANDARD = 1
    SHEDDABLE = 2

    @property
    def label(self) -> str:
        return PRIORITY_CLASSES[self]


CLASSES = tuple(Priority)
BY_NAME: dict[str, Priority] = {name: Priority(i) for i, name in enumerate(PRIORITY_CLASSES)}
ASK_HEADER = b"x-llmgw-priority"
# OpenAI's `service_tier` values: what each asks for (None: the key's class)
SERVICE_TIERS: dict[str, Priority | None] = {
    "flex": Priority.SHEDDABLE,
    "default": Priority.STANDARD,
    "priority": Priority.CRITICAL,
    "auto": None,
    "scale": None,
}


class Standing:
    """Who a request is, for the router's queue: its class, its team and the team's weight
    (its share against the class's other teams, in tokens served), and its key (first come,
    first served within one). Made once per key while its records hold."""

    __slots__ = ("priority", "team", "weight", "key")

    def __init__(
        self, priority: Priority = Priority.STANDARD, team: str = "", weight: int = 1, key: str = ""
    ) -> None:
        self.priority = priority
        self.team = team
        self.weight = weight
        self.key = key

    def __repr__(self) -> str:
        return f"Standing({self.priority.label}, team={self.team!r}, weight={self.weight})"


EVERYONE = Standing()  # a fleet without keys: one class, one team


class _Tier(msgspec.Struct):
    service_tier: object = None


_decode_tier = msgspec.json.Decoder(_Tier).decode
_TIER_FIELD = b'"service_tier"'


def asked(header: bytes | None, body: bytes) -> Priority | None:
    """The class a request asks for (the lower of its header's and its `service_tier`'s);
    None when it asks for none it can be read to ask for (an unknown value is ignored, as
    OpenAI's API ignores a tier a project does not have)."""
    want = BY_NAME.get(header.decode("latin-1").strip().lower()) if header else None
    if _TIER_FIELD in body:  # the common body names none: one scan, nothing decoded
        try:
            tier = _decode_tier(body).service_tier
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            tier = None
        by_tier = SERVICE_TIERS.get(tier) if isinstance(tier, str) else None
        if by_tier is not None and (want is None or by_tier > want):
            want = by_tier
    return want


def lowered(own: Priority, asked_for: Priority | None) -> Priority:
    """The class a request runs at: its own, or lower if it asked for lower; never higher."""
    return own if asked_for is None or asked_for <= own else asked_for
