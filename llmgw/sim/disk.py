"""What simulated nodes hold on disk: weights files the real scan and validation accept, and
the engine binaries the real discovery finds.

Weights are real (tiny) files, so the agent's own weights scan reports them and its own
launch validation passes: a node's local models in `<root>/nodes/<node>/weights`, a
share's in `<root>/shares/<share>` with a `.llmgw-share-id` naming it (the agent reads a
share's identity from that file, so every node mounting it reports one copy). Everything
lives under one root the simulator owns and clears at start.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

from llmgw.agent.discovery.weights.mounts import SHARE_ID_FILE
from llmgw.sim.fake_engine import install_fake_engines, write_fake_gguf
from llmgw.sim.fleet import LORA_DIR, LoraFiles
from llmgw.sim.tiny_lora import write_gguf_lora, write_peft_adapter

MARKER = ".llmgw-sim"  # the root is the simulator's: it may clear it


class SimDisk:
    def __init__(self, root: Path) -> None:
        self.root = root

    def reset(self) -> None:
        """Start from nothing (weights of an earlier run are not this file's), refusing to
        clear a directory that is not the simulator's."""
        if self.root.exists():
            if not (self.root / MARKER).exists():
                raise FileExistsError(
                    f"{self.root} exists and is not a simulated fleet's directory; "
                    "choose another --data-dir"
                )
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True)
        (self.root / MARKER).write_text("written by llmgw sim; cleared at its next start\n")

    def install_engines(self) -> dict[str, Path]:
        """The fake llama-server and vllm, as discovery finds real ones (they are never
        run: the simulator serves the engines itself)."""
        return install_fake_engines(self.root / "bin")

    def node_dir(self, node: str) -> Path:
        return self.root / "nodes" / node

    def weights_dir(self, node: str) -> Path:
        return self.node_dir(node) / "weights"

    def share_dir(self, share: str) -> Path:
        return self.root / "shares" / share

    def share_identity(self, share: str) -> str:
        return f"sim:{share}"

    def hold(
        self, directory: Path, models: Iterable[str], adapters: Sequence[LoraFiles] = ()
    ) -> None:
        """Make `directory` hold exactly `models` (fleet names: `x.gguf` or `org/name`) and,
        in its folder `loras/`, `adapters`."""
        self._hold_adapters(directory / LORA_DIR, adapters)
        want = set(models)
        directory.mkdir(parents=True, exist_ok=True)
        held = _held(directory)
        for gone in held - want:
            target = directory / gone
            if target.is_dir():
                shutil.rmtree(target)
            else:
                target.unlink(missing_ok=True)
            if target.parent != directory and not any(target.parent.iterdir()):
                target.parent.rmdir()
        for model in sorted(want - held):
            target = directory / model
            if model.endswith(".gguf"):
                write_fake_gguf(target)
            else:
                write_safetensors_model(target)

    def _hold_adapters(self, directory: Path, adapters: Sequence[LoraFiles]) -> None:
        want = {name: g.rank for g in adapters for name in g.files()}
        held = {e.name for e in directory.iterdir()} if directory.is_dir() else set()
        for gone in held - set(want):
            target = directory / gone
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
        for name in sorted(set(want) - held):
            # small: a thousand of them are a few MB (the fake engines read only the headers)
            if name.endswith(".gguf"):
                write_gguf_lora(directory / name, rank=want[name], embedding=16, layers=1)
            else:
                write_peft_adapter(directory / name, rank=want[name], hidden=16, layers=1)
        if not want and directory.is_dir():
            directory.rmdir()

    def hold_share(self, share: str, models: Iterable[str], adapters: Sequence[LoraFiles] = ()):
        directory = self.share_dir(share)
        self.hold(directory, models, adapters)
        (directory / SHARE_ID_FILE).write_text(self.share_identity(share) + "\n")


def _held(directory: Path) -> set[str]:
    """The fleet names of the models in `directory` (one or two levels down)."""
    found: set[str] = set()
    for entry in directory.iterdir():
        if entry.name.startswith(".") or entry.name == LORA_DIR:
            continue
        if entry.is_file() and entry.name.endswith(".gguf"):
            found.add(entry.name)
        elif entry.is_dir() and (entry / "config.json").exists():
            found.add(entry.name)
        elif entry.is_dir():
            for sub in entry.iterdir():
                if sub.is_file() and sub.name.endswith(".gguf"):
                    found.add(f"{entry.name}/{sub.name}")
                elif sub.is_dir():
                    found.add(f"{entry.name}/{sub.name}")
    return found


def write_safetensors_model(directory: Path) -> None:
    """A Hugging Face model directory of a few hundred bytes: config.json and one complete
    safetensors file (one F32 tensor), which vLLM's validation and the weights scan accept."""
    directory.mkdir(parents=True, exist_ok=True)
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (directory / "model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + bytes(4)
    )
    (directory / "config.json").write_text('{"architectures": ["SimForCausalLM"]}\n')
