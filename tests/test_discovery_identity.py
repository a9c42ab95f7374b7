import socket

from llmgw.agent.discovery.identity import node_id_from_hostname, read_hostname
from llmgw.bus.keys import is_token


def test_node_id_is_the_short_hostname():
    assert node_id_from_hostname("gpu05.dc1.example.com") == "gpu05"
    assert node_id_from_hostname("node05") == "node05"


def test_node_id_is_always_a_single_nats_token():
    node_id = node_id_from_hostname("GPU node#7.lab")

    assert node_id == "GPU-node-7"
    assert is_token(node_id)


def test_read_hostname_is_this_machines_name():
    assert read_hostname() == socket.gethostname()
    assert is_token(node_id_from_hostname(read_hostname()))
