from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.catalog import (
    CatalogError,
    WeightsRef,
    decode_model,
    encode_model,
    load_catalog_toml,
    validate_models,
)
from llmgw.errors import LlmgwError

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


def test_a_refused_catalog_reads_as_the_cli_prints_it(tmp_path: Path) -> None:
    path = tmp_path / "catalog.toml"
    path.write_text('[[models]]\nid = "m"\n[[models]]\nid = "m"\n')
    with pytest.raises(CatalogError) as refused:
        load_catalog_toml(path)
    assert isinstance(refused.value, LlmgwError)  # the CLI prints it as it is
    n = len(refused.value.errors)
    assert n >= 2 and str(refused.value) == (
        f"catalog refused, nothing written ({n} error(s)):\n  " + "\n  ".join(refused.value.errors)
    )
    with pytest.raises(CatalogError) as stored:
        decode_model(b"{", "m")
    assert str(stored.value).startswith(
        "catalog value refused (1 error(s)):\n  catalog.m: not JSON"
    )


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


def test_a_served_name_is_at_most_100_bytes_and_the_error_says_so():
    long = "é" * 51  # 51 characters, 102 bytes: the bound is on bytes
    raw = {
        "models": [
            {"id": "a", "served_name": "x" * 100, "profiles": [_profile()]},
            {"id": "b", "served_name": long, "profiles": [_profile()]},
            {"id": "c" * 101, "profiles": [_profile()]},
        ]
    }
    errors = _errors(raw)
    assert len(errors) == 2
    assert errors[0].startswith("model 'b', served_name: 'ééé")
    assert "is 102 bytes long; a served name is at most 100 bytes" in errors[0]
    assert errors[1].startswith(f"model '{'c' * 101}', id: ") and "101 bytes" in errors[1]


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


def test_served_name_clash_with_a_model_that_has_other_errors_is_listed_too():
    raw = {
        "models": [
            {"id": "a", "served_name": "llama", "profiles": [_profile()]},
            {"id": "b", "served_name": "llama", "profiles": [_profile(gpus_per_node=-1)]},
        ]
    }
    assert _errors(raw) == [
        "model 'b', profiles[0].gpus_per_node: expected an integer >= 0, got -1",
        "model 'b', served_name: 'llama' is already the served name of model 'a'",
    ]


def test_an_integer_too_long_for_a_float_or_an_engine_is_an_error_not_a_crash():
    raw = {
        "models": [
            {
                "id": "m",
                "profiles": [_profile(host_ram_gb=10**400, context=2**31, parallel=10**5000)],
            }
        ]
    }
    errors = _errors(raw)
    assert [e.split(":")[0] for e in errors] == [
        "model 'm', profiles[0].host_ram_gb",
        "model 'm', profiles[0].context",
        "model 'm', profiles[0].parallel",
    ]
    assert "expected an integer <= 2147483647, got 2147483648" in errors[1]
    assert max(len(e) for e in errors) < 200  # the value is quoted, not copied whole


# --- fuzzed: every error listed, and nothing else --------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
_PROFILE_FIELDS = [*_profile(), "gpu_memory_gb", "host_ram_gb", "nodes", "context", "extra_args"]


@st.composite
def _entry(draw) -> dict:
    """A model table, often valid, often broken in a few fields; ids and served names are
    drawn from small sets so that clashes are common."""
    profiles = [
        _profile(name=name) for name in draw(st.sampled_from([["a"], ["a", "b"], ["a", "a"]]))
    ]
    for profile in profiles:
        for field in draw(st.sets(st.sampled_from([*_PROFILE_FIELDS, "hostram_gb"]), max_size=2)):
            if draw(st.booleans()):
                profile.pop(field, None)
            else:
                profile[field] = draw(_JSON)
    entry: dict = {"profiles": profiles}
    mid = draw(st.sampled_from(["m1", "m2", "m3", "m.4", "", None]))
    if mid is not None:
        entry["id"] = mid
    served = draw(st.sampled_from([None, "chat", "m1", " "]))
    if served is not None:
        entry["served_name"] = served
    for field in draw(
        st.sets(st.sampled_from(["id", "served_name", "profiles", "endpoints", "x"]), max_size=1)
    ):
        entry[field] = draw(_JSON)
    return entry


def _alone(entry: dict, index: int) -> list[str]:
    """The entry's own errors, as if the catalog held only it (renumbered to its place)."""
    try:
        validate_models({"models": [entry]})
    except CatalogError as e:
        return [err.replace("models[0]", f"models[{index}]") for err in e.errors]
    return []


def _where(entry: dict, index: int) -> str:
    mid = entry.get("id")
    return f"model '{mid}'" if isinstance(mid, str) and mid else f"models[{index}] (no id)"


def _served(entry: dict):
    served = entry.get("served_name", entry.get("id"))
    return served if isinstance(served, str) and served.strip() else None


@settings(max_examples=300, deadline=None)
@given(st.lists(_entry(), max_size=5))
def test_a_catalog_is_refused_with_every_error_of_every_model_and_every_clash(entries):
    try:
        validate_models({"models": entries})
        errors: list[str] = []
    except CatalogError as e:
        errors = e.errors
    expected = [err for i, entry in enumerate(entries) for err in _alone(entry, i)]
    first_id: dict[str, int] = {}
    named: dict[str, tuple] = {}  # served name -> (id, where) of its first entry
    for i, entry in enumerate(entries):
        mid = entry.get("id")
        if isinstance(mid, str):
            if mid in first_id:
                expected.append(
                    f"model '{mid}', id: defined twice (models[{first_id[mid]}] and models[{i}])"
                )
            first_id.setdefault(mid, i)
    for i, entry in enumerate(entries):
        served = _served(entry)
        if served is None:
            continue
        where = _where(entry, i)
        other_id, other_where = named.setdefault(served, (entry.get("id"), where))
        same_id = isinstance(other_id, str) and entry.get("id") == other_id  # said once already
        if other_where != where and not same_id:
            expected.append(
                f"{where}, served_name: {served!r} is already the served name of {other_where}"
            )
    assert sorted(errors) == sorted(expected)


def test_rollout_settings_are_integers_not_both_zero_and_only_for_placed_models():
    def model(**fields):
        return {"models": [{"id": "m", "profiles": [_profile()], **fields}]}

    (m,) = validate_models(model())
    assert (m.surge, m.max_unavailable) == (1, 0)
    (m,) = validate_models(model(surge=0, max_unavailable=1))
    assert (m.surge, m.max_unavailable) == (0, 1)
    assert _errors(model(surge=0)) == [
        "model 'm', surge: surge and max_unavailable are both 0: a rollout could neither "
        "start a new replica before an old one drains nor drain one first; set surge = 1"
    ]
    assert _errors(model(surge=-1, max_unavailable=20_000)) == [
        "model 'm', surge: expected an integer >= 0, got -1",
        "model 'm', max_unavailable: expected an integer <= 10000, got 20000",
    ]
    static = {"models": [{"id": "s", "endpoints": ["http://h:1"], "surge": 2}]}
    assert _errors(static) == [
        "model 's', surge: only a model with profiles is rolled out; remove it"
    ]


def test_selectors_and_tolerations_are_labels_and_taint_names():
    raw = {
        "models": [
            {
                "id": "m",
                "profiles": [
                    _profile(
                        node_selector={"pool": "research", "node": "!node07", "bad key": "x"},
                        tolerations=["gpu-flaky", "no spaces please"],
                    )
                ],
            }
        ]
    }
    errors = _errors(raw)
    assert errors == [
        "model 'm', profiles[0].node_selector.bad key: 'bad key' is not a label name: 1-63 "
        "letters, digits, '.', '-' and '_', starting and ending with a letter or digit",
        "model 'm', profiles[0].tolerations[1]: 'no spaces please' is not a taint name: 1-63 "
        "letters, digits, '.', '-' and '_', starting and ending with a letter or digit",
    ]
    raw["models"][0]["profiles"][0]["node_selector"].pop("bad key")
    raw["models"][0]["profiles"][0]["tolerations"].pop()
    (m,) = validate_models(raw)
    assert m.profiles[0].node_selector == {"pool": "research", "node": "!node07"}
    assert decode_model(encode_model(m), "m") == m


def test_the_structs_carry_their_own_bounds_so_a_typed_decode_refuses_what_the_checker_does():
    import msgspec

    from llmgw.catalog import Autoscale, Model, Profile

    for typ, raw, path in [
        (Profile, _profile(context=0), "$.context"),
        (Profile, _profile(gpu_memory_gb=-1), "$.gpu_memory_gb"),
        (Autoscale, {"max_replicas": 2, "kv_cache_full": 1.5}, "$.kv_cache_full"),
        (Model, {"id": "m", "served_name": "m", "surge": 10**6}, "$.surge"),
    ]:
        with pytest.raises(msgspec.ValidationError, match=re.escape(path)):
            msgspec.convert(raw, typ)
        # and the checker says the same of it, in the catalog's words
        if typ is Profile:
            assert _errors({"models": [{"id": "m", "profiles": [raw]}]})


def _shared(**over):
    return _profile(**{"engine": "llama-server", "gpus_per_node": 1, "share_gpus": True, **over})


def test_a_shared_profile_needs_the_memory_each_replica_is_given():
    errors = _errors({"models": [{"id": "m", "profiles": [_shared()]}]})
    assert errors == [
        "model 'm', profiles[0].share_gpus: needs gpu_memory_gb: the GPU memory each replica "
        "is given, which placement counts against each GPU's (e.g. gpu_memory_gb = 20)"
    ]
    (model,) = validate_models({"models": [{"id": "m", "profiles": [_shared(gpu_memory_gb=20)]}]})
    assert model.profiles[0].share_gpus and model.profiles[0].gpu_memory_gb == 20


def test_multi_gpu_and_multi_node_profiles_stay_exclusive_and_the_catalog_says_so():
    raw = {
        "models": [
            {"id": "tp", "profiles": [_profile(share_gpus=True, gpu_memory_gb=20)]},
            {
                "id": "pp",
                "profiles": [_profile(share_gpus=True, gpu_memory_gb=20, gpus_per_node=1, nodes=2)],
            },
            {"id": "cpu", "profiles": [_profile(share_gpus=True, gpus_per_node=0, host_ram_gb=8)]},
            {"id": "typo", "profiles": [_shared(gpu_memory_gb=20, share_gpus="yes")]},
        ]
    }
    assert _errors(raw) == [
        "model 'tp', profiles[0].share_gpus: a replica on 8 GPUs has them to itself (tensor "
        "parallel); only gpus_per_node = 1 shares a GPU: remove share_gpus or set gpus_per_node = 1",
        "model 'pp', profiles[0].share_gpus: a multi-node replica has its GPUs to itself; "
        "remove share_gpus or set nodes = 1",
        "model 'cpu', profiles[0].share_gpus: a CPU profile (gpus_per_node = 0) has no GPU to share",
        "model 'typo', profiles[0].share_gpus: expected true or false, got 'yes'",
    ]


def test_sharing_is_part_of_the_launch_and_profiles_that_do_not_share_keep_their_fingerprint():
    from llmgw.catalog import launch_hash

    def first(**over):
        (m,) = validate_models({"models": [{"id": "m", "profiles": [_shared(**over)]}]})
        return m, m.profiles[0]

    exclusive = first(gpu_memory_gb=20, share_gpus=False)
    # the fingerprint of this profile before share_gpus existed: upgrading rolls nothing out
    assert launch_hash(*exclusive) == "01238a2f6ff7"
    assert launch_hash(*first(gpu_memory_gb=20)) != launch_hash(*exclusive)


def test_gpu_model_names_the_gpus_a_replica_may_be_given():
    (m,) = validate_models(
        {"models": [{"id": "m", "profiles": [_shared(gpu_memory_gb=9, gpu_model="1g.18gb")]}]}
    )
    assert m.profiles[0].gpu_model == "1g.18gb"
    errors = _errors(
        {
            "models": [
                {"id": "m", "profiles": [_profile(gpus_per_node=0, gpu_model="", host_ram_gb=8)]}
            ]
        }
    )
    assert errors == [
        "model 'm', profiles[0].gpu_model: expected a non-empty string, got ''",
        "model 'm', profiles[0].gpu_model: set on a CPU profile; remove it",
    ]


def test_only_a_cpu_vllm_profile_pins_cores():
    cpu = {"gpus_per_node": 0}
    raw = {
        "models": [
            {"id": "gpu-cores", "profiles": [_profile(cpu_cores=4, host_ram_gb=8)]},
            {
                "id": "llama-cores",
                "profiles": [
                    _profile(**cpu, engine="llama-server", weights={"path": "/m.gguf"}, cpu_cores=2)
                ],
            },
        ]
    }
    assert _errors(raw) == [
        "model 'gpu-cores', profiles[0].cpu_cores: set on a GPU profile; remove it",
        "model 'llama-cores', profiles[0].cpu_cores: pins a vLLM engine; give llama-server its "
        "threads and cores in extra_args (-t, --cpu-range)",
    ]
    (m,) = validate_models(
        {"models": [{"id": "m", "profiles": [_profile(**cpu, host_ram_gb=8, cpu_cores=2)]}]}
    )
    assert (m.profiles[0].host_ram_gb, m.profiles[0].cpu_cores) == (8, 2)


def test_cpu_cores_are_part_of_the_launch_and_profiles_without_keep_their_fingerprint():
    from llmgw.catalog import launch_hash

    def first(**over):
        (m,) = validate_models({"models": [{"id": "m", "profiles": [_shared(**over)]}]})
        return m, m.profiles[0]

    # the same profile as the fingerprint test above, from before cpu_cores existed
    assert launch_hash(*first(gpu_memory_gb=20, share_gpus=False)) == "01238a2f6ff7"
    (m,) = validate_models(
        {"models": [{"id": "m", "profiles": [_profile(gpus_per_node=0, host_ram_gb=8)]}]}
    )
    pinned = msgspec.structs.replace(m.profiles[0], cpu_cores=2)
    assert launch_hash(m, pinned) != launch_hash(m, m.profiles[0])
