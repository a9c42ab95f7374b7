"""LoRA adapters in the fleet's read model, as `llmgw status` and the fleet page show them:
where each is loaded, where its files are, its load by its own name, and every engine's
refusal in its words; a thousand of them summed up per base."""

from __future__ import annotations

import msgspec
from record_helpers import shard

from llmgw import catalog
from llmgw.bus import keys, records
from llmgw.cli.status import render
from llmgw.fleetstate import build
from llmgw.fleetstate.decode import FleetRecords
from llmgw.router.fleet import fleet_state
from llmgw.sim.bare import inventory

NOW = 1000.0


def _records(n: int = 2) -> FleetRecords:
    r = FleetRecords()
    for i in range(n):
        a = catalog.Adapter(
            id=f"a{i}", served_name=f"acme/a{i}", base="tiny", path=f"/w/a{i}", rank=8
        )
        r.apply(keys.adapter(a.id), catalog.encode_model(a), 1)
    held = records.HeldAdapter(
        key="a0",
        format="peft",
        path="/w/a0/",
        bytes=1,
        files=2,
        store=records.Store(kind="local", identity="local:n1"),
    )
    inv = inventory("n1", gpus=0)
    inv = msgspec.structs.replace(inv, weights=records.Weights(adapters=[held]))
    r.apply(keys.node("n1"), records.encode(inv), 1)
    refused = records.AdapterFailure(adapter="a1", reason="LoRA rank 16 is greater than 8.")
    s = shard("n1", "r1", model="tiny", adapters=["a0"], adapter_failures=[refused])
    r.apply(keys.shard("n1", "r1"), records.encode(s), 1)
    load = records.RouterLoad(
        router="x", seq=1, at=NOW, models={"a0": records.ModelLoad(in_flight=1.5)}
    )
    r.apply(keys.load("x"), records.encode(load), 1)
    return r


def test_each_adapter_shows_where_it_is_loaded_its_load_and_what_refused_it():
    view = build.fleet(_records(), NOW)
    a0, a1 = view.adapters["a0"], view.adapters["a1"]
    assert (a0.loaded, a0.held_on, a0.in_flight, a0.failures) == (["r1"], 1, 1.5, [])
    assert a0.problem == "its base model 'tiny' is not in the catalog"
    assert a1.failures == ["refused on n1: LoRA rank 16 is greater than 8."]
    text = render(view, NOW)
    assert "acme/a0 (a0) on tiny: loaded on r1, 1.5 in flight; rank 8, files on 1 node(s)" in text
    assert "acme/a1 (a1) on tiny: loaded nowhere; rank 8, files on 0 node(s)" in text
    assert "  acme/a1: refused on n1: LoRA rank 16 is greater than 8." in text
    page = fleet_state(_records(), {}, NOW, {})
    assert [a.id for a in page["adapters"]] == ["a0", "a1"]


def test_a_thousand_adapters_are_summed_up_per_base():
    text = render(build.fleet(_records(1000), NOW), NOW)
    assert (
        "  1000 on tiny: 1 loaded (1 copies), 999 loaded nowhere; most in flight: acme/a0 1.5"
        in text
    )
    assert "acme/a5 (a5)" not in text


def test_an_adapter_whose_value_does_not_read_still_shows_why():
    r = FleetRecords()
    r.apply(keys.adapter("bad"), b"not json", 3)
    (bad,) = build.fleet(r, NOW).adapters.values()
    assert bad.id == "bad" and "stays loaded where it is" in bad.unreadable
