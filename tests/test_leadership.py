"""Who may take the `leader` key and when, on its own: time passed in."""

from __future__ import annotations

from llmgw.bus.records import Leader
from llmgw.controller.leadership import CREATE, LeaderKey

TTL = 10.0


def _leader(instance: str, holder: str = "c1") -> Leader:
    return Leader(holder=holder, since=1.0, renewed_at=1.0, instance=instance)


def test_an_absent_key_is_created():
    assert LeaderKey().claim("me", now=0.0, ttl=TTL) == CREATE
    key = LeaderKey()
    key.saw(5, _leader("other"), now=1.0)
    key.saw(0, None, now=2.0)  # the leader resigned: it deleted the key
    assert key.claim("me", now=2.0, ttl=TTL) == CREATE


def test_a_lease_is_taken_over_only_once_it_stood_still_for_ttl():
    key = LeaderKey()
    key.saw(5, _leader("other"), now=100.0)
    assert key.claim("me", now=109.9, ttl=TTL) is None
    key.saw(6, _leader("other"), now=109.9)  # renewed: counts again from here
    assert key.claim("me", now=115.0, ttl=TTL) is None
    key.saw(6, _leader("other"), now=116.0)  # the same revision again is not a renewal
    assert key.claim("me", now=119.9, ttl=TTL) == 6


def test_a_value_that_does_not_decode_is_taken_over_at_once_at_its_revision():
    key = LeaderKey()
    key.saw(42, None, now=100.0)  # `nats kv put llmgw leader 42`
    assert key.claim("me", now=100.0, ttl=TTL) == 42


def test_a_namesake_process_waits_for_the_old_lease_but_a_process_takes_back_its_own():
    key = LeaderKey()
    key.saw(5, _leader("old-process", holder="ctl"), now=100.0)
    # restarted under the same --id: a different instance, so not its own lease
    assert key.claim("new-process", now=101.0, ttl=TTL) is None
    assert key.claim("old-process", now=101.0, ttl=TTL) == 5  # its renewal failed once
