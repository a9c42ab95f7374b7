"""llama-server (llama.cpp): argv, environment, readiness and in-flight requests."""

from __future__ import annotations

import json
from collections.abc import Mapping

from llmgw.agent.engines.base import (
    EngineCommand,
    EngineGauges,
    Flag,
    FlagTable,
    LaunchSpec,
    Probe,
    base_url,
    cuda_env,
    is_url,
    read_gauges,
    requests_at_engine,
)
from llmgw.catalog import hf_repo

# Flags the adapter sets. Every llama.cpp flag also has a LLAMA_ARG_* variable: a
# profile setting one of those would fight the flag, so they are managed too.
MANAGED = FlagTable(
    [
        Flag(("-m", "--model"), env="LLAMA_ARG_MODEL"),
        Flag(("-hf", "-hfr", "--hf-repo"), env="LLAMA_ARG_HF_REPO"),
        Flag(("-mu", "--model-url"), env="LLAMA_ARG_MODEL_URL"),
        Flag(("--host",), env="LLAMA_ARG_HOST"),
        Flag(("--port",), env="LLAMA_ARG_PORT"),
        Flag(("-ngl", "--gpu-layers", "--n-gpu-layers"), env="LLAMA_ARG_N_GPU_LAYERS"),
        Flag(("-c", "--ctx-size"), env="LLAMA_ARG_CTX_SIZE"),
        Flag(("-np", "--parallel"), env="LLAMA_ARG_N_PARALLEL"),
        Flag(("-a", "--alias"), env="LLAMA_ARG_ALIAS"),
        Flag(("--metrics",), takes_value=False, env="LLAMA_ARG_ENDPOINT_METRICS"),
        Flag(("--api-key",), env="LLAMA_API_KEY"),
        Flag(("--api-key-file",)),
        Flag(
            ("-dev", "--device"), env="LLAMA_ARG_DEVICE"
        ),  # GPUs are chosen by CUDA_VISIBLE_DEVICES
        # the model's LoRA adapters, none applied unless a request names one (the router)
        Flag(
            ("--lora-init-without-apply",),
            takes_value=False,
            env="LLAMA_ARG_LORA_INIT_WITHOUT_APPLY",
        ),
    ]
)

# Common unmanaged flags with more than one spelling, so duplicates are seen through aliases.
KNOWN = FlagTable(
    [
        *MANAGED.flags,
        Flag(("-t", "--threads")),
        Flag(("-tb", "--threads-batch")),
        Flag(("-b", "--batch-size")),
        Flag(("-ub", "--ubatch-size")),
        Flag(("-fa", "--flash-attn")),
        Flag(("-ctk", "--cache-type-k")),
        Flag(("-ctv", "--cache-type-v")),
        Flag(("-sm", "--split-mode")),
        Flag(("-ts", "--tensor-split")),
        Flag(("-mg", "--main-gpu")),
        Flag(("-cb", "--cont-batching"), takes_value=False),
        Flag(("-nocb", "--no-cont-batching"), takes_value=False),
        Flag(("-n", "--predict", "--n-predict")),
        Flag(("-md", "--model-draft")),
        Flag(("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft")),
        Flag(("-to", "--timeout")),
        Flag(("-ot", "--override-tensor"), repeatable=True),
        Flag(("--override-kv",), repeatable=True),
        Flag(("--lora",), repeatable=True),
        Flag(("--lora-scaled",), repeatable=True),
        Flag(("--control-vector",), repeatable=True),
        Flag(("-hff", "--hf-file")),
        Flag(("--jinja",), takes_value=False),
        Flag(("--mlock",), takes_value=False),
        Flag(("--no-mmap",), takes_value=False),
    ]
)

MANAGED_ENV = frozenset(
    {f.env for f in MANAGED.flags if f.env}
    | {"LLAMA_ARG_API_KEY", "LLAMA_CACHE", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"}
)


class LlamaServerAdapter:
    name = "llama-server"
    managed = MANAGED
    known = KNOWN
    managed_env = MANAGED_ENV

    def command(self, spec: LaunchSpec) -> EngineCommand:
        argv = [spec.binary]
        if spec.weights_path:
            argv += ["-m", spec.weights_path]
        elif spec.download_source and is_url(spec.download_source):
            argv += ["-mu", spec.download_source]
        elif spec.download_source:
            argv += ["-hf", hf_repo(spec.download_source) or spec.download_source]
        # Always both: the default port is moving from 8080 to 9931 between releases.
        argv += ["--host", spec.host, "--port", str(spec.port)]
        # 999 = every layer; portable across builds where the default became "auto".
        argv += ["-ngl", "999" if spec.gpu_uuids else "0"]
        if spec.context:
            argv += ["-c", str(spec.context)]
        if spec.parallel:
            argv += ["-np", str(spec.parallel)]
        # --metrics is off by default and drain reads in-flight requests from it.
        argv += ["--alias", spec.served_name, "--metrics"]
        if spec.lora_files:
            # ids 0.. in this order; none applied by default, where a build honours it (not
            # all do: the router names what runs, also none, on every request, router/adapters.py)
            for _, path in spec.lora_files:
                argv += ["--lora", path]
            argv += ["--lora-init-without-apply"]
        argv += list(spec.extra_args)

        env = dict(spec.env)
        env.update(cuda_env(spec))
        if spec.fetch_dir:
            env["LLAMA_CACHE"] = spec.fetch_dir  # -hf downloads land in the scanned fetch dir
        if spec.api_key:
            env["LLAMA_API_KEY"] = spec.api_key
        return EngineCommand(argv=argv, env=env, base_url=base_url(spec))

    def probe_paths(self, spec: LaunchSpec) -> list[str]:
        return ["/health"]

    def readiness(self, spec: LaunchSpec, answers: Mapping[str, tuple[int, bytes]]) -> Probe:
        # llama-server listens before loading: 503 "Loading model" until ready.
        if "/health" not in answers:
            return Probe(False, "not listening yet")
        status, body = answers["/health"]
        if status == 200:
            try:
                state = json.loads(body).get("status", "ok")
            except (ValueError, AttributeError):
                state = "ok"
            # older builds answered 200 {"status": "loading model"}
            if state == "ok":
                return Probe(True, "ready")
            return Probe(False, str(state))
        return Probe(False, f"/health answered {status}: {_error_message(body)}")

    def in_flight_paths(self, spec: LaunchSpec) -> list[str]:
        # /slots answers even when a profile's build or flags lost the metrics endpoint
        return ["/metrics", "/slots"]

    def in_flight(self, path: str, status: int, body: bytes) -> int | None:
        if status != 200:
            return None
        if path == "/slots":
            try:
                return sum(1 for slot in json.loads(body) if slot.get("is_processing"))
            except (ValueError, TypeError, AttributeError):
                return None
        text = body.decode("utf-8", "replace")
        return requests_at_engine(
            text, "llamacpp:requests_processing", "llamacpp:requests_deferred"
        )

    def gauges(self, metrics: str) -> EngineGauges | None:
        return read_gauges(
            metrics,
            "llamacpp:requests_processing",
            "llamacpp:requests_deferred",
            ("llamacpp:kv_cache_usage_ratio",),
        )

    def check(self, spec: LaunchSpec) -> list[str]:
        reasons = []
        if spec.nodes > 1:
            reasons.append(
                f"llama-server runs on one node but the profile asks for {spec.nodes}; "
                "use vllm for multi-node profiles or set nodes = 1"
            )
        if spec.tensor_parallel not in (None, 1) or spec.pipeline_parallel not in (None, 1):
            reasons.append(
                "llama-server has no tensor/pipeline parallel setting: it splits layers over "
                "the assigned GPUs; remove tensor_parallel/pipeline_parallel from the profile"
            )
        source = spec.download_source
        if spec.weights_path is None and source is not None:
            if not is_url(source) and hf_repo(source) is None:
                reasons.append(
                    f"download source {source!r} is neither hf://org/name[:QUANT] nor an "
                    "http(s) URL of a .gguf file"
                )
        if spec.lora_files and any(
            self.known.key(t) in ("--lora", "--lora-scaled") for t in spec.extra_args
        ):
            reasons.append(
                "the model has LoRA adapters (llmgw adapter add), given to llama-server in their "
                "order; --lora in extra_args would shift the ids requests name: remove it"
            )
        if spec.context and spec.parallel and spec.context // spec.parallel < 64:
            reasons.append(
                f"context {spec.context} split over {spec.parallel} slots leaves "
                f"{spec.context // spec.parallel} tokens per request (-c is the total); "
                "raise context or lower parallel"
            )
        return reasons


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace")
