"""The runs of ports tests give their engines (port_helpers): free now, outside llmgw's
default range and the kernel's ephemeral ports, and never handed to two holders at once."""

from __future__ import annotations

import socket

import port_helpers
from port_helpers import LOWEST, WIDTH, ephemeral_low, free_port_run

from llmgw.bus.records import ENGINE_PORTS


def test_two_runs_held_at_once_never_share_a_port(monkeypatch):
    # both would start from the same block: only the reservation keeps them apart
    monkeypatch.setattr(port_helpers.random, "randrange", lambda n: 0)
    with free_port_run() as a, free_port_run() as b:
        assert not set(range(a[0], a[1] + 1)) & set(range(b[0], b[1] + 1)), (a, b)
        for low, high in (a, b):
            assert ENGINE_PORTS[1] < low <= high < ephemeral_low()
    with free_port_run() as again:  # given back when the block exits
        assert again == a


def test_a_run_is_never_one_something_listens_in(monkeypatch):
    monkeypatch.setattr(port_helpers.random, "randrange", lambda n: 0)  # the first block first
    with socket.socket() as other:
        taken = next(p for p in range(LOWEST, LOWEST + WIDTH) if _bound(other, p))
        other.listen()
        with free_port_run() as (low, high):
            assert not low <= taken <= high


def _bound(s: socket.socket, port: int) -> bool:
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def test_the_ephemeral_range_is_read_from_procfs_and_assumed_when_unreadable(tmp_path):
    (tmp_path / "sys/net/ipv4").mkdir(parents=True)
    (tmp_path / "sys/net/ipv4/ip_local_port_range").write_text("40000\t60999\n")
    assert ephemeral_low(tmp_path) == 40000
    assert ephemeral_low(tmp_path / "nothing") == 32768
