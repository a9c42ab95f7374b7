"""Who may take the `leader` key and when, and what a leader may write: time passed in."""

from __future__ import annotations

from llmgw.bus.records import Leader
from llmgw.controller.leadership import (
    CREATE,
    LeaderKey,
    Leadership,
    LeadershipState,
    Takeover,
)

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


# --- Leadership: the state machine, and its one question (may I write, with which fence) ---


def _following(instance: str = "me") -> Leadership:
    return Leadership("c1", instance, ttl=TTL)


def _leading_at(revision: int, took_over: int = 4) -> Leadership:
    """A controller that took the key over at `took_over`, its claim stored at `revision`."""
    lead = _following()
    lead.saw(took_over, _leader("other"), now=100.0)
    takeover = lead.takeover(now=100.0 + TTL)
    assert takeover is not None and takeover.at == took_over
    lead.claiming(takeover.at, wall=5000.0)
    assert lead.claimed(revision)
    return lead


def test_a_takeover_leads_with_an_epoch_one_past_the_revision_taken_over():
    lead = _following()
    lead.saw(4, _leader("other", holder="c0"), now=100.0)
    assert lead.takeover(now=105.0) is None  # it has not stood still for ttl yet
    takeover = lead.takeover(now=110.0)
    assert takeover == Takeover(at=4, previous="c0")
    record = lead.claiming(takeover.at, wall=5000.0)
    assert (record.epoch, record.since, record.instance) == (5, 5000.0, "me")
    assert lead.state is LeadershipState.CLAIMING and lead.fence(view_revision=99) is None
    assert lead.claimed(7)
    assert lead.state is LeadershipState.LEADING and (lead.epoch, lead.since) == (5, 5000.0)


def test_a_new_leader_may_write_only_once_its_view_holds_its_takeover():
    lead = _leading_at(7)
    assert lead.fence(view_revision=4) is None  # still the previous leader's key
    assert lead.fence(view_revision=7) == 7
    assert lead.fence(view_revision=9) == 7  # a later revision: the fence is its own


def test_the_epoch_grows_past_a_deleted_key_too():
    lead = _following()
    lead.saw(4, _leader("other"), now=100.0)
    lead.saw(0, None, now=101.0)  # the leader resigned: it deleted the key
    takeover = lead.takeover(now=101.0)
    assert takeover == Takeover(at=CREATE, previous=None)  # at once: nobody holds it
    # the loop asks for the deletion's revision (Bus.deleted_at): 5, and claims at it
    assert lead.claiming(5, wall=1.0).epoch == 6


def test_each_renewal_moves_the_fence_and_keeps_the_epoch_and_since():
    lead = _leading_at(7)
    last, record = lead.renewal(wall=6000.0)
    assert last == 7 and (record.epoch, record.since, record.renewed_at) == (5, 5000.0, 6000.0)
    lead.renewed(8)
    assert lead.fence(view_revision=8) == 8 and lead.renewal(wall=6001.0)[0] == 8


def test_a_refused_renewal_adopts_the_key_while_it_is_still_ours_else_steps_down():
    lead = _leading_at(7)
    # its renewal was stored, and only the answer lost: the key is at 8, and still ours
    lead.renewal_refused(8, _leader("me"))
    assert lead.fence(view_revision=8) == 8
    lead.renewal_refused(9, _leader("other"))
    assert lead.state is LeadershipState.FOLLOWING and lead.fence(view_revision=9) is None
    assert lead.epoch == 5  # the number of its latest leadership stays


def test_a_claim_that_lost_the_race_follows_and_keeps_its_last_epoch():
    lead = _leading_at(7)
    lead.step_down("the server refused its write")
    lead.saw(9, _leader("me"), now=200.0)  # its own key, nobody took it: back at once
    takeover = lead.takeover(now=200.0)
    assert takeover is not None and takeover.at == 9
    lead.claiming(takeover.at, wall=7000.0)
    assert not lead.claimed(None)  # another controller was quicker
    assert lead.state is LeadershipState.FOLLOWING and lead.epoch == 5


def test_stepping_down_stops_every_write_at_once():
    lead = _leading_at(7)
    lead.step_down("cannot renew the leader key: timeout")
    assert lead.fence(view_revision=7) is None and lead.renewal(wall=1.0) is None


def test_a_resigned_controller_deletes_its_key_at_its_fence_and_never_claims_again():
    lead = _leading_at(7)
    assert lead.resign() == 7
    lead.saw(0, None, now=300.0)
    assert lead.takeover(now=300.0) is None and lead.fence(view_revision=7) is None
    assert _following().resign() is None  # nothing to delete: it never held the key
