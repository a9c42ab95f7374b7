"""CPUs: how many the kernel lists and what they are called, from /proc/cpuinfo."""

from __future__ import annotations

from pathlib import Path

from llmgw.bus.records import Cpu

# aarch64 cpuinfo has no "model name"; Arm's own core parts (implementer 0x41) are the
# ones GPU servers carry (Grace is Neoverse-V2).
_ARM_PARTS = {
    "0xd0c": "Neoverse-N1",
    "0xd40": "Neoverse-V1",
    "0xd49": "Neoverse-N2",
    "0xd4f": "Neoverse-V2",
}


def _fields(text: str) -> tuple[int, dict[str, str]]:
    """Count of `processor` entries, and the first value seen for every other name."""
    count = 0
    first: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if not sep:
            continue
        name, value = name.strip(), value.strip()
        # aarch64 kernels before 4.x also had a "Processor : AArch64 ..." header line:
        # lowercase "processor" with a number is the per-CPU entry
        if name == "processor" and value.isdigit():
            count += 1
        else:
            first.setdefault(name, value)
    return count, first


def _model(fields: dict[str, str]) -> str:
    if fields.get("model name"):
        return fields["model name"]  # x86, and aarch64 on some vendor kernels
    part = fields.get("CPU part", "")
    if fields.get("CPU implementer") == "0x41" and part in _ARM_PARTS:
        return f"ARM {_ARM_PARTS[part]}"
    for name in ("Hardware", "Processor", "cpu"):  # SoC name, old aarch64 header, ppc64le
        if fields.get(name):
            return fields[name]
    if part:
        return f"CPU implementer {fields.get('CPU implementer', '?')} part {part}"
    return ""


def parse_cpuinfo(text: str) -> Cpu:
    count, fields = _fields(text)
    if count == 0:
        raise ValueError("/proc/cpuinfo lists no 'processor' entries; is procfs mounted?")
    return Cpu(count=count, model=_model(fields))


def read_cpu(procfs: Path = Path("/proc")) -> Cpu:
    return parse_cpuinfo((procfs / "cpuinfo").read_text())
