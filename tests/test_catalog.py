from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmgw.catalog import (
    CatalogError,
    WeightsRef,
    decode_model,
    encode_model,
    load_catalog_toml,
    validate_models,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "catalog.toml"


def _profile(**over):
    base = {
        "name": "tp8",
        "engine": "vllm",
        "weights": {"key": "meta-llama/Llama-3.3-70B-Instruct"},
        "gpus_per_node": 8,
    }
    base.update(over)
    return base


def _errors(raw) -> list[str]:
    with pytest.raises(CatalogError) as info:
        validate_models(raw)
    return info.value.errors


def test_example_catalog_loads():
    models = {m.id: m for m in load_catalog_toml(EXAMPLE)}
    assert sorted(models) == ["embed-small", "llama3-70b", "phi3-mini", "qwen2-5-7b"]
    llama = models["llama3-70b"]
    assert llama.served_name == "meta-llama/Llama-3.3-70B-Instruct"
    assert [(p.name, p.nodes, p.gpus_per_node) for p in llama.profiles] == [
        ("tp8", 1, 8),
        ("pp2", 2, 4),
    ]
    assert models["phi3-mini"].served_name == "phi3-mini"  # defaults to the id
    assert models["embed-small"].endpoints == ["http://10.0.0.21:8080", "http://10.0.0.22:8080"]


def test_invalid_catalog_is_refused_whole_with_every_error_and_field_path():
    raw = {
        "models": [
            {"id": "llama3-70b", "profiles": [_profile(gpus_per_node=-1, host_ram_gb="64")]},
            {"id": "fine", "profiles": [_profile()]},
            {"id": "qwen", "profiles": [_profile(engine="sglang", nodes=0)]},
        ]
    }
    assert _errors(raw) == [
        "model 'llama3-70b', profiles[0].gpus_per_node: expected an integer >= 0, got -1",
        "model 'llama3-70b', profiles[0].host_ram_gb: expected a number >= 0, got '64'",
        "model 'qwen', profiles[0].engine: expected 'llama-server' or 'vllm', got 'sglang'",
        "model 'qwen', profiles[0].nodes: expected an integer >= 1, got 0",
    ]


def test_load_refuses_whole_file_naming_it(tmp_path):
    path = tmp_path / "catalog.toml"
    path.write_text(
        '[[models]]\nid = "ok"\n[[models.profiles]]\nname = "a"\nengine = "vllm"\n'
        'weights = { key = "org/ok" }\ngpus_per_node = 1\n'
        '[[models]]\nid = "bad"\n[[models.profiles]]\nname = "a"\nengine = "vllm"\n'
        'weights = { key = "org/bad" }\n'
    )
    with pytest.raises(CatalogError) as info:
        load_catalog_toml(path)
    assert info.value.errors == [
        f"{path}: model 'bad', profiles[0].gpus_per_node: "
        "expected an integer >= 0, got nothing (missing)"
    ]


def test_toml_syntax_error_names_the_file(tmp_path):
    path = tmp_path / "catalog.toml"
    path.write_text("[[models]\n")
    with pytest.raises(CatalogError, match=f"{path}: not valid TOML"):
        load_catalog_toml(path)


def test_misspelled_field_is_an_error_with_a_suggestion():
    errors = _errors({"models": [{"id": "m", "profiles": [_profile(host_ram_gib=64)]}]})
    assert errors == [
        "model 'm', profiles[0].host_ram_gib: unknown field (did you mean 'host_ram_gb'?)"
    ]


def test_llama_server_cannot_span_nodes():
    raw = {"models": [{"id": "m", "profiles": [_profile(engine="llama-server", nodes=2)]}]}
    assert _errors(raw) == [
        "model 'm', profiles[0].nodes: llama-server runs on one node; "
        "use nodes = 1 or engine = 'vllm' for multi-node"
    ]


def test_vllm_multi_node_needs_gpus():
    raw = {"models": [{"id": "m", "profiles": [_profile(nodes=2, gpus_per_node=0)]}]}
    assert _errors(raw) == [
        "model 'm', profiles[0].nodes: a multi-node replica needs gpus_per_node >= 1"
    ]


@pytest.mark.parametrize(
    "weights",
    [{}, {"key": "org/m", "path": "/srv/m"}, {"key": "org/m", "source": "hf://org/m"}],
)
def test_weights_need_exactly_one_reference(weights):
    errors = _errors({"models": [{"id": "m", "profiles": [_profile(weights=weights)]}]})
    assert len(errors) == 1
    assert errors[0].startswith("model 'm', profiles[0].weights: expected a table with exactly one")


@pytest.mark.parametrize(
    ("engine", "weights", "error"),
    [
        ("vllm", {"path": "models/m"}, "weights.path: expected an absolute path on the node"),
        ("vllm", {"key": "/srv/m"}, "weights.key: expected a model key (use path = "),
        ("vllm", {"source": "s3://bucket/m"}, 'weights.source: expected "hf://org/name"'),
        ("vllm", {"source": "hf://org/m:Q4_K_M"}, "a ':Q4_K_M' tag is for llama-server"),
        ("vllm", {"source": "https://x/m.gguf"}, "vllm fetches from hf://org/name, not a URL"),
        ("llama-server", {"source": "hf://not-a-repo"}, 'weights.source: expected "hf://org/name"'),
    ],
)
def test_weights_references_are_checked_per_engine(engine, weights, error):
    raw = {"models": [{"id": "m", "profiles": [_profile(engine=engine, weights=weights)]}]}
    errors = _errors(raw)
    assert len(errors) == 1 and error in errors[0], errors


def test_llama_server_takes_hf_quant_tag_and_urls():
    profiles = [
        _profile(name="a", engine="llama-server", weights={"source": "hf://org/m-GGUF:Q4_K_M"}),
        _profile(name="b", engine="llama-server", weights={"source": "https://x.example/m.gguf"}),
    ]
    (model,) = validate_models({"models": [{"id": "m", "profiles": profiles}]})
    assert [p.weights.held_key() for p in model.profiles] == ["org/m-GGUF", "m"]


def test_held_key_of_a_path_is_the_dir_name_or_gguf_stem():
    assert WeightsRef(path="/srv/models/Qwen2.5-7B/").held_key() == "Qwen2.5-7B"
    assert WeightsRef(path="/srv/m/phi-q4-00001-of-00002.gguf").held_key() == "phi-q4"


def test_model_needs_profiles_or_endpoints_but_not_both():
    raw = {
        "models": [
            {"id": "none"},
            {"id": "both", "profiles": [_profile()], "endpoints": ["http://h:1"]},
        ]
    }
    assert _errors(raw) == [
        "model 'none', profiles: a model needs profiles (to be placed) or endpoints (router-only)",
        "model 'both', endpoints: a model has either profiles or endpoints, not both",
    ]


def test_static_endpoints_must_be_http_base_urls():
    raw = {"models": [{"id": "m", "endpoints": ["http://h:8080", "h:8080", "http://h:99999"]}]}
    assert _errors(raw) == [
        "model 'm', endpoints[1]: expected a base URL like \"http://host:port\", got 'h:8080'",
        "model 'm', endpoints[2]: expected a base URL like \"http://host:port\", "
        "got 'http://h:99999'",
    ]


def test_ids_are_single_nats_tokens_and_unique():
    raw = {
        "models": [
            {"id": "llama.3", "profiles": [_profile()]},
            {"id": "dup", "profiles": [_profile(name="a b")]},
            {"id": "dup", "profiles": [_profile(), _profile()]},
        ]
    }
    assert _errors(raw) == [
        "model 'llama.3', id: expected a single token of letters, digits, '-' and '_', "
        "got 'llama.3'",
        "model 'dup', profiles[0].name: expected a single token of letters, digits, '-' and "
        "'_', got 'a b'",
        "model 'dup', profiles[1].name: profile 'tp8' defined twice",
        "model 'dup', id: defined twice (models[1] and models[2])",
    ]


def test_two_models_cannot_share_a_served_name():
    raw = {
        "models": [
            {"id": "a", "served_name": "llama", "profiles": [_profile()]},
            {"id": "b", "served_name": "llama", "profiles": [_profile()]},
        ]
    }
    assert _errors(raw) == [
        "model 'b', served_name: 'llama' is already the served name of model 'a'"
    ]


def test_llmgw_owned_flags_and_bad_env_are_refused():
    raw = {
        "models": [
            {
                "id": "m",
                "profiles": [_profile(extra_args=["--port=9000"], env={"A-B": "1", "N": 2})],
            }
        ]
    }
    assert _errors(raw) == [
        "model 'm', profiles[0].extra_args[0]: '--port=9000' is set by llmgw "
        "(placement picks the port); remove it",
        "model 'm', profiles[0].env.A-B: expected an environment variable name, got 'A-B'",
        "model 'm', profiles[0].env.N: expected a string (quote numbers), got 2",
    ]


def test_bool_is_not_an_integer():
    errors = _errors({"models": [{"id": "m", "profiles": [_profile(gpus_per_node=True)]}]})
    assert errors == ["model 'm', profiles[0].gpus_per_node: expected an integer >= 0, got true"]


def test_stored_value_round_trips():
    for model in load_catalog_toml(EXAMPLE):
        assert decode_model(encode_model(model), model.id) == model


def test_hand_put_value_is_revalidated_on_decode():
    raw = {"id": "m", "served_name": "m", "profiles": [_profile(gpus_per_node=-2)]}
    with pytest.raises(CatalogError) as info:
        decode_model(json.dumps(raw).encode(), "m")
    assert info.value.errors == [
        "model 'm', profiles[0].gpus_per_node: expected an integer >= 0, got -2"
    ]


def test_decode_refuses_value_stored_under_another_key():
    (model,) = validate_models({"models": [{"id": "m", "profiles": [_profile()]}]})
    with pytest.raises(CatalogError, match="model 'm', id: stored under key catalog.other"):
        decode_model(encode_model(model), "other")


def test_decode_refuses_non_json():
    with pytest.raises(CatalogError, match="catalog.m: not JSON"):
        decode_model(b"{nope", "m")
