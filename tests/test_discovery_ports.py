"""Ports of the engine range other programs listen on, from recorded /proc/net/tcp{,6}."""

from __future__ import annotations

import socket
from pathlib import Path

from llmgw.agent.discovery.ports import listening_ports, ports_taken, read_ports_taken
from llmgw.bus.records import MAX_PORTS_TAKEN

# recorded on a GPU node: sshd on 22, a notebook on 0.0.0.0:18000, an engine of the agent on
# 127.0.0.1:18002, a client connection from 18001 (ESTABLISHED, not a listener), a service
# on 19000 (outside the range)
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1069 1 00000000b555cf25 100 0 0 10 0
   1: 00000000:4650 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 2210 1 00000000cc6d2c87 100 0 0 10 0
   2: 0100007F:4652 00000000:0000 0A 00000000:00000000 00:00000000 00000000   999        0 3301 1 00000000aa6d2c87 100 0 0 10 0
   3: 0A000005:4651 0A000007:D5D0 01 00000000:00000000 02:00000BE9 00000000  1000        0 4402 3 00000000cc6d2c87 20 4 30 10 -1
   4: 00000000:4A38 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5503 1 00000000dd6d2c87 100 0 0 10 0
"""
# a Jupyter server on [::]:18005 (an IPv6 listener covers IPv4 too)
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:4655 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 6604 1 00000000ee6d2c87 100 0 0 10 0
"""


def test_only_listening_sockets_count_whatever_their_address():
    assert listening_ports(TCP.splitlines()) == {22, 18000, 18002, 19000}
    assert listening_ports(TCP6.splitlines()) == {18005}


def test_ports_taken_are_those_in_the_range_that_are_not_the_agents_engines():
    taken = ports_taken({22, 18000, 18002, 18005, 19000}, 18000, 18999, own=[18002])

    assert (taken.low, taken.high, taken.ports, taken.unlisted) == (18000, 18999, [18000, 18005], 0)


def test_garbage_lines_are_skipped():
    lines = ["", "x", "   0: zz:zz 0:0 0A", "   1: 00000000:FFFFF 0:0 0A", "0: nocolon 0:0 0A"]

    assert listening_ports(lines) == set()


def test_at_most_1024_ports_are_listed_and_the_rest_counted():
    taken = ports_taken(range(20_000, 22_000), 1, 65_535)

    assert len(taken.ports) == MAX_PORTS_TAKEN == 1024
    assert taken.ports[0] == 20_000 and taken.unlisted == 2000 - 1024


def test_read_from_a_recorded_procfs_with_and_without_ipv6(tmp_path):
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(TCP)
    assert read_ports_taken(tmp_path, 18000, 18999, own=[18002]).ports == [18000]
    (tmp_path / "net" / "tcp6").write_text(TCP6)
    assert read_ports_taken(tmp_path, 18000, 18999, own=[18002]).ports == [18000, 18005]
    assert read_ports_taken(tmp_path / "nothing", 18000, 18999).ports == []


def test_a_socket_listening_on_this_machine_is_seen_in_the_real_table():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert read_ports_taken(Path("/proc"), port, port).ports == [port]
    assert read_ports_taken(Path("/proc"), port, port).ports == []
