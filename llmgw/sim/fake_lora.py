"""LoRA adapters in the fake engine, as the real ones take them (for tests, demos and the
simulated fleet).

vLLM (`VllmLoras`): `--enable-lora --max-lora-rank R --max-loras N --max-cpu-loras M`, and
with VLLM_ALLOW_RUNTIME_LORA_UPDATING `POST /v1/load_lora_adapter {"lora_name",
"lora_path"}` and `/v1/unload_lora_adapter {"lora_name"}` with vLLM 0.32's answers and
refusals (vllm/entrypoints/openai/models/serving.py): a name loaded already, the base's
name, a path with no adapter, a rank over --max-lora-rank. A loaded adapter is listed in
/v1/models with its `parent`, served by name, and shown in `vllm:lora_requests_info`.

llama-server (`LlamaLoras`): `--lora FILE` (repeatable), `--lora-scaled FILE SCALE`,
`--lora-init-without-apply`; each file must be a GGUF LoRA of the model's architecture or
the server does not start; `GET/POST /lora-adapters`; a request's
`"lora": [{"id": N, "scale": S}]` ("invalid adapter id" otherwise). As the real one does
(build 11434, llama.cpp issue 28674): `--lora-init-without-apply` leaves every adapter at
scale 1.0, so a request naming no adapter (no `lora`, or an empty list) runs them all; a
request's list sets those it names and leaves the others at 0.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _gguf_strings(path: str) -> dict[str, str]:
    """The string values of a GGUF header (a fake's files are small), {} when unreadable."""
    from llmgw.agent.discovery.weights.formats import gguf_metadata

    try:
        with open(path, "rb") as f:
            found = gguf_metadata(f, os.fstat(f.fileno()).st_size, lambda key: True)
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in found.items() if isinstance(v, str)}


# --- vLLM -------------------------------------------------------------------------------------


@dataclass
class VllmLoras:
    enabled: bool = False
    max_rank: int = 16
    max_loras: int = 1
    max_cpu_loras: int = 1
    runtime: bool = False  # VLLM_ALLOW_RUNTIME_LORA_UPDATING
    loaded: dict[str, str] = field(default_factory=dict)  # name -> path
    running: Counter = field(default_factory=Counter)  # name -> requests now
    loads: int = 0  # load requests that succeeded, ever

    def startup_problem(self) -> list[str]:
        if self.enabled and self.max_cpu_loras < self.max_loras:
            return [
                f"ValueError: max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                f"({self.max_loras})."
            ]
        return []

    def serves(self, model: object) -> bool:
        return isinstance(model, str) and model in self.loaded

    def load(self, body: object, base: str) -> tuple[int, object]:
        """vLLM's answer to a load request: (status, text or error body)."""
        from llmgw.sim import vllm_answers

        name = body.get("lora_name") if isinstance(body, dict) else None
        path = body.get("lora_path") if isinstance(body, dict) else None
        if not name or not path:
            return 400, vllm_answers.error(
                400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
            )
        if name == base:
            return 400, vllm_answers.error(
                400,
                f"The lora adapter '{name}' conflicts with a served base model.",
                "InvalidUserInput",
            )
        if name in self.loaded:
            return 400, vllm_answers.error(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        problem = self._adapter_problem(str(name), str(path))
        if problem is not None:
            status, message = problem
            kind = "NotFoundError" if status == 404 else "InternalServerError"
            return status, vllm_answers.error(status, message, kind)
        self.loaded[name] = str(path)
        self.loads += 1
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def _adapter_problem(self, name: str, path: str) -> tuple[int, str] | None:
        if not self.enabled:
            return 500, "LoRA is not enabled. Use --enable-lora to enable LoRA."
        config_path = Path(path) / "adapter_config.json"
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError):
            return 404, f"Loading lora {name} failed: No adapter found for {path}"
        rank = config.get("r") if isinstance(config, dict) else None
        if isinstance(rank, int) and rank > self.max_rank:
            return 500, f"LoRA rank {rank} is greater than max_lora_rank {self.max_rank}."
        weights = Path(path) / "adapter_model.safetensors"
        if not weights.is_file() or weights.stat().st_size < 8:
            return 500, f"No adapter weights found in {path}"
        return None

    def unload(self, body: object) -> tuple[int, object]:
        from llmgw.sim import vllm_answers

        name = body.get("lora_name") if isinstance(body, dict) else None
        if not name:
            return 400, vllm_answers.error(
                400,
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                "InvalidUserInput",
            )
        if name not in self.loaded:
            return 404, vllm_answers.error(
                404, f"The lora adapter '{name}' cannot be found.", "NotFoundError"
            )
        del self.loaded[name]
        return 200, f"Success: LoRA adapter '{name}' removed successfully."

    def model_entries(self, base: str, created: int) -> list[dict]:
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": path,
                "parent": base,
                "max_model_len": None,
                "permission": [],
            }
            for name, path in self.loaded.items()
        ]

    def metrics(self) -> str:
        """vLLM's `vllm:lora_requests_info`: one sample, its labels what runs now."""
        if not self.enabled:
            return ""
        running = ",".join(sorted(n for n, c in self.running.items() if c > 0))
        return (
            "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
            "# TYPE vllm:lora_requests_info gauge\n"
            f'vllm:lora_requests_info{{max_lora="{self.max_loras}",'
            f'running_lora_adapters="{running}",waiting_lora_adapters=""}} {time.time()}\n'
        )


def vllm_loras(ns, env) -> VllmLoras:
    return VllmLoras(
        enabled=bool(getattr(ns, "enable_lora", False)),
        max_rank=ns.max_lora_rank,
        max_loras=ns.max_loras,
        max_cpu_loras=ns.max_cpu_loras if ns.max_cpu_loras is not None else ns.max_loras,
        runtime=str(env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "")).lower() in ("1", "true"),
    )


# --- llama-server -----------------------------------------------------------------------------


@dataclass
class LlamaLoras:
    files: list[tuple[str, float]] = field(default_factory=list)  # (path, scale), id = index
    applied: dict[int, int] = field(default_factory=dict)  # id -> requests that applied it

    def startup_problem(self, model_path: str | None) -> list[str]:
        """llama.cpp's lines when an adapter cannot be loaded (the server then exits)."""
        model_arch = _gguf_strings(model_path).get("general.architecture", "") if model_path else ""
        for path, _ in self.files:
            meta = _gguf_strings(path)
            if not meta:
                why = f"gguf_init_from_file: failed to open GGUF file '{path}'"
            elif meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
                why = "llama_adapter_lora_init_impl: expect general.type to be 'adapter'"
            elif model_arch and meta.get("general.architecture") != model_arch:
                why = "llama_adapter_lora_init_impl: model arch and LoRA arch mismatch"
            else:
                continue
            return [
                f"llama_adapter_lora_init_impl: loading lora adapter from '{path}' ...",
                why,
                f"common_init_from_params: failed to load lora adapter '{path}'",
                "srv    load_model: failed to load model",
                "main: exiting due to model loading error",
            ]
        return []

    def listed(self) -> list[dict]:
        return [{"id": i, "path": p, "scale": s} for i, (p, s) in enumerate(self.files)]

    def set_scales(self, body: object) -> str | None:
        """POST /lora-adapters: the global scales; an error message, or None."""
        parsed = self._parse(body)
        if isinstance(parsed, str):
            return parsed
        for i, scale in parsed.items():
            self.files[i] = (self.files[i][0], scale)
        return None

    def apply(self, body: dict) -> str | None:
        """A request's `lora` field: an error message, or None (what it applies is counted)."""
        if "lora" not in body:
            return None
        parsed = self._parse(body["lora"])
        if isinstance(parsed, str):
            return parsed
        for i, scale in parsed.items():
            if scale:
                self.applied[i] = self.applied.get(i, 0) + 1
        return None

    def mark(self, body: dict) -> str:
        """What the adapters applied to a request put before its tokens ("lora1-"): a real
        adapter changes what is generated; this one says which ran (llama.cpp's rule: the
        request's list if it names any, else the global scales)."""
        asked = self._parse(body["lora"]) if "lora" in body else {}
        scales = (
            asked
            if isinstance(asked, dict) and asked
            else dict(enumerate(s for _, s in self.files))
        )
        return "".join(f"lora{i}-" for i, scale in sorted(scales.items()) if scale)

    def _parse(self, raw: object) -> dict[int, float] | str:
        if not isinstance(raw, list):
            return "lora must be an array of objects"
        out: dict[int, float] = {}
        for entry in raw:
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), int):
                return "invalid adapter id"
            i = entry["id"]
            if not 0 <= i < len(self.files):
                return "invalid adapter id"
            scale = entry.get("scale", 1.0)
            out[i] = float(scale) if isinstance(scale, int | float) else 1.0
        return out


def llama_loras(ns) -> LlamaLoras:
    # --lora-init-without-apply is taken and, as by the real server, not honoured (above)
    files = [(p, 1.0) for p in getattr(ns, "lora", None) or []]
    for path, scale in getattr(ns, "lora_scaled", None) or []:
        files.append((path, float(scale)))
    return LlamaLoras(files=files)
