import os
from pathlib import Path

import pytest

from llmgw.agent.discovery.cpu import parse_cpuinfo, read_cpu

PROCFS = Path(__file__).parent / "samples" / "procfs"


def test_x86_cpuinfo_gives_processor_count_and_model_name():
    cpu = parse_cpuinfo((PROCFS / "cpuinfo-amd-epyc-2vcpu.txt").read_text())

    assert cpu.count == 2
    assert cpu.model == "AMD EPYC"


def test_grace_cpuinfo_without_model_name_names_the_arm_core():
    cpu = parse_cpuinfo((PROCFS / "cpuinfo-grace-72core.txt").read_text())

    assert cpu.count == 72
    assert cpu.model == "ARM Neoverse-V2"


def test_old_aarch64_header_line_is_not_counted_as_a_cpu_and_hardware_names_it():
    text = (
        "Processor\t: AArch64 Processor rev 4 (aarch64)\n"
        "processor\t: 0\nCPU implementer\t: 0x51\nCPU part\t: 0x800\n\n"
        "processor\t: 1\nCPU implementer\t: 0x51\nCPU part\t: 0x800\n\n"
        "Hardware\t: Qualcomm Technologies, Inc SDM845\n"
    )

    cpu = parse_cpuinfo(text)

    assert cpu.count == 2
    assert cpu.model == "Qualcomm Technologies, Inc SDM845"


def test_unknown_arm_part_without_hardware_line_reports_the_part():
    text = "processor\t: 0\nCPU implementer\t: 0x61\nCPU part\t: 0x022\n"

    assert parse_cpuinfo(text).model == "CPU implementer 0x61 part 0x022"


def test_cpuinfo_without_any_name_has_empty_model():
    assert parse_cpuinfo("processor : 0\n\nprocessor : 1\n").model == ""


def test_empty_cpuinfo_is_refused():
    with pytest.raises(ValueError, match="no 'processor' entries"):
        parse_cpuinfo("")


def test_this_machines_cpus_are_counted():
    cpu = read_cpu()

    assert cpu.count == os.cpu_count()


def test_read_cpu_reads_cpuinfo_under_the_given_procfs(tmp_path):
    (tmp_path / "cpuinfo").write_text((PROCFS / "cpuinfo-grace-72core.txt").read_text())

    assert read_cpu(tmp_path).count == 72
