"""The vLLM adapter's command line held to what `vllm serve` takes, for every profile shape
llmgw builds: each flag is one `vllm serve --help=all` lists (recorded from vLLM 0.32.0, and
the installed vLLM's own help where there is one), with its value; every spelling of a flag
llmgw sets is refused in extra_args; and vLLM's own parser takes each command line whole and
reads from it what llmgw meant."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from real_vllm import TEST_ENV, vllm_binary, vllm_python
from vllm_options import Option, argv_problems, canonical, parse_options, recorded_options

from llmgw.agent.engines.base import Flag, LaunchSpec
from llmgw.agent.engines.validate import NodeFacts, validate_launch
from llmgw.agent.engines.vllm import VllmAdapter
from llmgw.bus.records import EngineInstall, Gpu

ADAPTER = VllmAdapter()
GPUS = tuple(f"GPU-{i}" for i in range(8))
H200 = 150_754_820_096  # bytes NVML reports for an H200
BASE = dict(served_name="qwen-7b", engine="vllm", binary="/opt/vllm/bin/vllm", port=18000)

# a member of a replica over two nodes of 8 GPUs, rank 0 at 10.0.0.1
MEMBER = dict(BASE, weights_path="/models/qwen", gpu_uuids=GPUS, nodes=2, master_addr="10.0.0.1")

# every shape of launch llmgw makes of a vLLM profile
SHAPES: dict[str, LaunchSpec] = {
    "cpu": LaunchSpec(
        **BASE,
        weights_path="/models/qwen",
        context=1024,
        parallel=4,
        host_ram_bytes=40 * 10**9,
        kv_cache_bytes=20 * 10**9,
        cpu_cores=(0, 1, 2, 3),
    ),
    "gpus": LaunchSpec(
        **BASE, weights_path="/models/qwen", gpu_uuids=GPUS[:2], context=8192, parallel=16
    ),
    "download": LaunchSpec(
        **BASE,
        download_source="hf://Qwen/Qwen2.5-7B-Instruct",
        fetch_dir="/fetch",
        gpu_uuids=GPUS[:1],
    ),
    "multi-node rank 0": LaunchSpec(**MEMBER, rank=0, master_port=29600, host_ip="10.0.0.1"),
    "multi-node rank 1": LaunchSpec(**MEMBER, rank=1, host_ip="10.0.0.2"),
    "shared gpu": LaunchSpec(
        **BASE,
        weights_path="/models/qwen",
        gpu_uuids=GPUS[:1],
        gpu_memory_gb=20,
        gpu_shared=True,
        gpu_total_bytes=H200,
    ),
    "api key": LaunchSpec(**BASE, weights_path="/models/qwen", gpu_uuids=GPUS[:1], api_key="k"),
    "extra args": LaunchSpec(
        **BASE,
        weights_path="/models/qwen",
        gpu_uuids=GPUS[:1],
        extra_args=(
            "--enable-prefix-caching",
            "--max-num-batched-tokens",
            "4096",
            "--kv_cache_dtype=fp8",
            "-O0",
            "--compilation-config",
            '{"mode": 0}',
        ),
    ),
}


def argvs() -> dict[str, list[str]]:
    return {name: ADAPTER.command(spec).argv for name, spec in SHAPES.items()}


def flag_problems(options: dict[str, Option]) -> list[str]:
    """Where the adapter's flag tables spell a vLLM option otherwise than vLLM does: a name
    vLLM does not have, names of two options in one Flag, or a spelling of the option that
    the Flag misses (extra_args using it would slip past the clash check)."""
    problems = []
    tables = {"managed": ADAPTER.managed.flags, "known": ADAPTER.known.flags}
    for table, flags in tables.items():
        for flag in flags:
            problems += _flag_problems(table, flag, options)
    return problems


def _flag_problems(table: str, flag: Flag, options: dict[str, Option]) -> list[str]:
    found = {name: options.get(canonical(name)) for name in flag.names}
    missing = [name for name, option in found.items() if option is None]
    if missing:
        return [f"{table} flag {flag.names}: vllm serve has no {', '.join(missing)}"]
    distinct = {option.names for option in found.values() if option}
    if len(distinct) > 1:
        return [f"{table} flag {flag.names} names {len(distinct)} different options"]
    option = next(o for o in found.values() if o)
    problems = []
    unlisted = [n for n in option.names if n not in flag.names and not n.startswith("--no-")]
    if unlisted:
        problems.append(f"{table} flag {flag.names} misses vLLM's spellings {unlisted}")
    if option.takes_value != flag.takes_value:
        problems.append(f"{table} flag {flag.names}: takes_value is {option.takes_value} in vLLM")
    return problems


@pytest.mark.parametrize("shape", SHAPES)
def test_every_flag_llmgw_builds_is_one_vllm_serve_takes(shape):
    argv = ADAPTER.command(SHAPES[shape]).argv
    assert argv_problems(argv, recorded_options()) == [], argv


def test_the_flag_tables_spell_each_option_as_vllm_does():
    assert flag_problems(recorded_options()) == []


def test_a_managed_flag_in_extra_args_is_refused_in_every_spelling_vllm_takes():
    options = recorded_options()
    node = NodeFacts(
        gpus=[
            Gpu(
                index=0,
                uuid="GPU-0",
                name="H100",
                memory_total_bytes=80 * 10**9,
                pci_bus_id="0000:01:00.0",
                compute_capability="9.0",
            )
        ],
        engines=[EngineInstall(name="vllm", path="/bin/sh", version="0.32.0")],
    )
    for flag in ADAPTER.managed.flags:
        for spelling in options[flag.names[-1]].names:
            if spelling.startswith("--no-"):
                continue
            extra = (spelling, "2") if flag.takes_value else (spelling,)
            spec = LaunchSpec(
                **{**BASE, "binary": "/bin/sh", "port": 1},
                weights_path="/",
                gpu_uuids=("GPU-0",),
                extra_args=extra,
            )
            reasons = [p.reason for p in validate_launch(spec, node)]
            assert any(f"extra arg {spelling} clashes" in r for r in reasons), (spelling, reasons)


def test_the_api_key_reaches_vllm_in_its_environment_never_in_argv():
    command = ADAPTER.command(SHAPES["api key"])
    assert command.env["VLLM_API_KEY"] == "k"
    assert "k" not in command.argv and "--api-key" not in command.argv


def test_a_shared_gpus_allotment_is_its_memory_utilization():
    argv = argvs()["shared gpu"]
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.132"  # 20 GB of 150.75


# --- against the installed vLLM ---------------------------------------------------------


@pytest.fixture(scope="module")
def real_help() -> str:
    done = subprocess.run(
        [str(vllm_binary()), "serve", "--help=all"],
        capture_output=True,
        text=True,
        env={**os.environ, **TEST_ENV},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.vllm
def test_the_real_vllm_serve_help_takes_every_flag_llmgw_builds(real_help):
    options = parse_options(real_help)
    assert {shape: argv_problems(argv, options) for shape, argv in argvs().items()} == {
        shape: [] for shape in SHAPES
    }
    assert flag_problems(options) == []


@pytest.mark.vllm
def test_the_recorded_options_are_the_real_vllm_0_32s(real_help):
    version = (Path(vllm_binary()).parent.parent / "VERSION").read_text().strip()
    if not version.startswith("0.32.0"):
        pytest.skip(f"the recording is of vLLM 0.32.0; this one is {version}")
    assert parse_options(real_help) == recorded_options()


@pytest.mark.vllm
def test_vllms_own_parser_takes_each_command_line_and_reads_what_llmgw_meant():
    binary = vllm_binary()
    script = Path(__file__).parent / "vllm_parse_argv.py"
    shapes = argvs()
    done = subprocess.run(
        [str(vllm_python(binary)), str(script)],
        input=json.dumps(list(shapes.values())),
        capture_output=True,
        text=True,
        env={**os.environ, **TEST_ENV},
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = dict(zip(shapes, (json.loads(line) for line in done.stdout.splitlines()), strict=True))
    assert {s: p.get("error") for s, p in parsed.items() if not p["ok"]} == {}
    args = {s: p["args"] for s, p in parsed.items()}
    assert args["cpu"]["served_model_name"] == ["qwen-7b"]
    assert (args["cpu"]["max_model_len"], args["cpu"]["max_num_seqs"]) == (1024, 4)
    assert (args["cpu"]["host"], args["cpu"]["port"]) == ("0.0.0.0", 18000)
    assert args["cpu"]["kv_cache_memory_bytes"] == 20 * 10**9
    assert args["gpus"]["tensor_parallel_size"] == 2
    assert (args["download"]["model_tag"], args["download"]["download_dir"]) == (
        "Qwen/Qwen2.5-7B-Instruct",
        "/fetch",
    )
    rank0, rank1 = args["multi-node rank 0"], args["multi-node rank 1"]
    assert (rank0["nnodes"], rank0["node_rank"], rank0["headless"]) == (2, 0, False)
    assert (rank0["master_addr"], rank0["master_port"]) == ("10.0.0.1", 29600)
    assert (rank1["node_rank"], rank1["headless"], rank1["master_addr"]) == (1, True, "10.0.0.1")
    assert (rank0["tensor_parallel_size"], rank0["pipeline_parallel_size"]) == (8, 2)
    assert args["shared gpu"]["gpu_memory_utilization"] == 0.132
    assert args["api key"]["api_key"] is None  # from VLLM_API_KEY, which vLLM reads itself


def test_an_optimization_level_given_twice_is_refused_however_it_is_spelled():
    spec = LaunchSpec(**BASE, weights_path="/", extra_args=("-O3", "--optimization-level", "2"))
    reasons = [p.reason for p in validate_launch(spec, NodeFacts())]
    assert any("extra arg --optimization-level repeats -O3" in r for r in reasons), reasons
