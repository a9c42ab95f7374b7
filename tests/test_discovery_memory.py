from pathlib import Path

import pytest

from llmgw.agent.discovery.memory import parse_meminfo, read_memory

PROCFS = Path(__file__).parent / "samples" / "procfs"


def test_meminfo_kilobytes_become_bytes():
    memory = parse_meminfo((PROCFS / "meminfo-dgx-h100.txt").read_text())

    assert memory.total_bytes == 2113370132 * 1024
    assert memory.available_bytes == 2061250316 * 1024


def test_missing_memavailable_is_named_in_the_error():
    text = "MemTotal:       16384 kB\nMemFree:         8192 kB\n"

    with pytest.raises(ValueError, match="MemAvailable"):
        parse_meminfo(text)


def test_read_memory_reads_meminfo_under_the_given_procfs(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 2048 kB\nMemAvailable: 1024 kB\n")

    memory = read_memory(tmp_path)

    assert (memory.total_bytes, memory.available_bytes) == (2048 * 1024, 1024 * 1024)


def test_memory_grown_between_reads_is_seen_on_the_next_read(tmp_path):
    # read on every heartbeat: a VM given more RAM qualifies without an agent restart
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 32000000 kB\nMemAvailable: 30000000 kB\n")
    before = read_memory(tmp_path)
    meminfo.write_text("MemTotal: 64000000 kB\nMemAvailable: 62000000 kB\n")

    after = read_memory(tmp_path)

    assert after.total_bytes == 2 * before.total_bytes


def test_this_machines_memory_is_read():
    memory = read_memory()

    assert 0 < memory.available_bytes <= memory.total_bytes
