"""ops.<node>: one state (in service, cordoned, draining, draining by force), with the old
wire format ({cordoned, drain, force}) still read."""

from __future__ import annotations

import msgspec
import pytest

from llmgw.bus import records


@pytest.mark.parametrize(
    ("old", "state"),
    [
        (b'{"node":"n1"}', "in-service"),
        (b'{"node":"n1","cordoned":true}', "cordoned"),
        (b'{"node":"n1","cordoned":true,"drain":true}', "draining"),
        (b'{"node":"n1","drain":true}', "draining"),
        (b'{"node":"n1","cordoned":true,"drain":true,"force":true}', "draining-by-force"),
        (b'{"node":"n1","force":true}', "in-service"),  # force alone never drained anything
    ],
)
def test_the_old_wire_format_reads_as_one_state(old: bytes, state: str) -> None:
    ops = records.decode(old, records.NodeOps)
    assert ops.state == state
    # and is written in the new one alone
    written = msgspec.json.decode(records.encode(ops))
    assert not {"cordoned", "drain", "force"} & set(written)


def test_the_old_booleans_are_answers_derived_from_the_state() -> None:
    answers = {
        state: (ops.cordoned, ops.drain, ops.force, ops.unschedulable)
        for state in ("in-service", "cordoned", "draining", "draining-by-force")
        for ops in [records.NodeOps(node="n1", state=state)]
    }
    assert answers == {
        "in-service": (False, False, False, False),
        "cordoned": (True, False, False, True),
        "draining": (True, True, False, True),
        "draining-by-force": (True, True, True, True),
    }


def test_a_state_written_wins_over_old_booleans_beside_it() -> None:
    ops = records.decode(b'{"node":"n1","state":"cordoned","drain":true}', records.NodeOps)
    assert ops.state == "cordoned"
