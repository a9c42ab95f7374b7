"""The controller's judgement of its own link, on its own: durations passed in."""

from __future__ import annotations

from llmgw.controller.link import Link, LinkState


def _trusted() -> Link:
    link = Link(stuck_after=3.0)
    assert not link.synced()  # the first read of the bucket ends no outage
    assert link.may_judge
    return link


def test_nothing_is_judged_before_the_bucket_has_been_read():
    link = Link(stuck_after=3.0)
    assert link.state is LinkState.STARTING and not link.may_judge
    link.disconnected()  # a drop during the first read: still the first read
    link.wrote(10.0)
    assert link.state is LinkState.STARTING


def test_a_reconnect_stops_judging_until_the_bucket_is_read_again_then_grants_grace():
    link = _trusted()
    link.disconnected()
    assert not link.may_judge
    link.write_failed("timeout")  # expected while away: nothing more to learn
    assert link.state is LinkState.RESYNCING
    assert link.round_trip(0.01) is False and not link.may_judge  # the view is still stale
    assert link.synced() is True  # every node gets a fresh grace period
    assert link.may_judge


def test_a_hung_write_makes_the_link_suspect_until_a_prompt_round_trip():
    link = _trusted()
    link.wrote(2.9)
    assert link.may_judge
    link.wrote(3.5)
    assert link.state is LinkState.SUSPECT and not link.may_judge
    assert link.round_trip(None) is False  # no answer at all
    assert link.round_trip(3.0) is False  # an answer, but not a prompt one
    assert not link.may_judge
    assert link.round_trip(0.2) is True  # trusted again: every node gets a fresh grace period
    assert link.may_judge
    assert link.round_trip(0.2) is False  # already trusted: no second grace period


def test_a_failed_write_makes_the_link_suspect():
    link = _trusted()
    link.write_failed("nats: timeout")
    assert link.state is LinkState.SUSPECT


def test_a_slow_round_trip_while_trusted_stops_judging():
    link = _trusted()
    assert link.round_trip(None) is False
    assert link.state is LinkState.SUSPECT


def test_a_watch_that_restarts_by_itself_changes_nothing():
    link = _trusted()
    assert link.synced() is False and link.may_judge
    link.write_failed("timeout")
    assert link.synced() is False and link.state is LinkState.SUSPECT


def test_a_reconnect_while_suspect_ends_with_the_bucket_read_again():
    link = _trusted()
    link.wrote(10.0)
    link.disconnected()
    assert link.state is LinkState.RESYNCING
    assert link.synced() is True and link.may_judge
