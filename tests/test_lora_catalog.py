"""LoRA adapters in the catalog (`adapters.<id>`), and what they make of a base's launch:
validation with every error listed, vLLM's room for them, llama-server's adapter files, and
the fingerprint that decides whether replicas are replaced. And the weights scan finding
adapter files: PEFT directories and GGUF adapters, complete only, never as models."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_placement import model

from llmgw import catalog
from llmgw.agent.discovery.weights.mounts import MountTable
from llmgw.agent.discovery.weights.scan import scan_weights
from llmgw.bus import keys
from llmgw.bus.records import LoraRoom
from llmgw.catalog import Adapter, CatalogError, check_adapter, decode_adapter
from llmgw.fleetstate.decode import FleetRecords
from llmgw.sim.fake_engine import write_fake_gguf
from llmgw.sim.tiny_lora import write_gguf_lora, write_peft_adapter


def adapter(aid="sql", rank=8, path="/w/sql") -> Adapter:
    return Adapter(id=aid, served_name=f"acme/{aid}", base="m", path=path, rank=rank)


def test_every_problem_of_an_adapter_is_listed_at_once():
    with pytest.raises(CatalogError) as e:
        check_adapter({"id": "a b", "base": "m", "path": "rel/dir", "rank": 0, "rnak": 8})
    assert e.value.errors == [
        "adapter, rnak: unknown field (did you mean 'rank'?)",
        "adapter, id: expected a single token (letters, digits, '-' and '_'), got 'a b'",
        "adapter, path: expected an absolute path on the nodes: a PEFT directory (vLLM) or a "
        ".gguf LoRA file (llama-server), got 'rel/dir'",
        "adapter, rank: expected an integer >= 1, got 0",
    ]


def test_a_value_stored_under_another_id_is_refused():
    data = catalog.encode_model(adapter("sql"))
    assert decode_adapter(data, "sql") == adapter("sql")
    with pytest.raises(CatalogError, match="stored under key adapters.other"):
        decode_adapter(data, "other")


def test_a_garbled_adapter_keeps_its_last_good_value_and_without_one_is_frozen():
    records = FleetRecords()
    key = keys.adapter("sql")
    records.apply(key, catalog.encode_model(adapter("sql")), 1)
    records.apply(key, b'{"id": "sql", "rank": "8"}', 2)
    assert records.adapters["sql"] == adapter("sql")
    assert records.unreadable[key].reading == "kept"
    fresh = FleetRecords()
    fresh.apply(key, b"not json", 2)
    assert "sql" not in fresh.adapters
    assert fresh.unreadable[key].reading == "frozen"
    assert "stays loaded where it is" in fresh.unreadable[key].instead()


def test_vllm_room_follows_the_largest_rank_unless_the_profile_sets_it():
    m = model(engine="vllm")
    p = m.profiles[0]
    assert catalog.lora_room(p, []) is None  # no adapter, no room asked: no LoRA
    assert catalog.lora_room(p, [adapter(rank=8), adapter("b", rank=20)]) == LoraRoom(
        rank=32, slots=catalog.DEFAULT_ADAPTER_SLOTS
    )
    sized = catalog.Profile(**{**_fields(p), "adapter_slots": 64, "adapter_rank": 64})
    assert catalog.lora_room(sized, []) == LoraRoom(rank=64, slots=64)


def test_adding_an_adapter_within_the_room_changes_no_vllm_launch():
    m = model(engine="vllm")
    p = catalog.Profile(**{**_fields(m.profiles[0]), "adapter_rank": 16})
    one = catalog.launch_hash(m, p, [adapter("a")])
    assert catalog.launch_hash(m, p, [adapter("a"), adapter("b")]) == one
    # a base without adapters keeps the fingerprint it had before adapters existed
    plain = m.profiles[0]
    assert catalog.launch_hash(m, plain, []) == catalog.launch_hash(m, plain)
    assert catalog.launch_hash(m, plain, [adapter("a")]) != catalog.launch_hash(m, plain)


def test_adding_an_adapter_changes_a_llama_server_launch():
    m = model(engine="llama-server")
    p = m.profiles[0]
    one = catalog.launch_hash(m, p, [adapter("a", path="/w/a.gguf")])
    two = catalog.launch_hash(
        m, p, [adapter("a", path="/w/a.gguf"), adapter("b", path="/w/b.gguf")]
    )
    assert one != two != catalog.launch_hash(m, p, [])


def test_room_settings_are_vllm_only():
    raw = {
        "models": [
            {
                "id": "m",
                "profiles": [
                    {
                        "name": "p",
                        "engine": "llama-server",
                        "weights": {"key": "m"},
                        "gpus_per_node": 0,
                        "adapter_slots": 4,
                    }
                ],
            }
        ]
    }
    with pytest.raises(CatalogError, match="adapter_slots: sizes vLLM's room for LoRA"):
        catalog.validate_models(raw)


def test_adapter_problem_names_a_base_that_cannot_take_the_files():
    vllm_base = model(engine="vllm")
    assert catalog.adapter_problem(adapter(path="/w/x.gguf"), vllm_base) == (
        "/w/x.gguf is a GGUF LoRA file, for llama-server, and no profile of 'm' runs llama-server"
    )
    assert catalog.adapter_problem(adapter(), None) == "its base model 'm' is not in the catalog"
    assert catalog.adapter_problem(adapter(), vllm_base) is None


def _fields(p: catalog.Profile) -> dict:
    return {f: getattr(p, f) for f in p.__struct_fields__}


# --- the weights scan -----------------------------------------------------------------------


def scan(*dirs: Path, tmp: Path):
    return scan_weights(list(dirs), tmp / "fetch", MountTable.empty(), "n1", True)


def test_scan_holds_complete_adapters_apart_from_models(tmp_path):
    w = tmp_path / "w"
    write_peft_adapter(w / "sql-lora", rank=8, base="Org/Tiny")
    write_gguf_lora(w / "chat-lora.gguf", rank=4)
    write_fake_gguf(w / "base.gguf")
    found = scan(w, tmp=tmp_path)
    assert [m.key for m in found.models] == ["base"]
    assert [(a.key, a.format, a.rank, a.base, a.path) for a in found.adapters] == [
        ("chat-lora", "gguf", 4, "llama", str(w / "chat-lora.gguf")),
        ("sql-lora", "peft", 8, "Org/Tiny", str(w / "sql-lora")),
    ]
    assert {a.store.identity for a in found.adapters} == {"local:n1"}


def test_incomplete_adapter_files_are_not_held(tmp_path):
    w = tmp_path / "w"
    write_peft_adapter(w / "cut", rank=8)
    weights = w / "cut" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    (w / "config-only").mkdir(parents=True)
    (w / "config-only" / "adapter_config.json").write_text('{"r": 8}')
    write_peft_adapter(w / "downloading", rank=8)
    (w / "downloading" / "adapter_model.safetensors.part").write_bytes(b"x")
    gguf = write_gguf_lora(w / "half.gguf", rank=4)
    gguf.write_bytes(gguf.read_bytes()[:-40])
    found = scan(w, tmp=tmp_path)
    assert found.adapters == [] and found.models == []
    assert {(i.key, i.reason) for i in found.incomplete} == {
        ("cut", "adapter_model.safetensors truncated"),
        ("config-only", "adapter_model.safetensors missing"),
        ("downloading", "download in progress (adapter_model.safetensors.part)"),
        ("half", "half.gguf truncated"),
    }
