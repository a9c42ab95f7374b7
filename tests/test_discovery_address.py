import ipaddress
import logging
import socket

import pytest

from llmgw.agent.discovery.address import address_for_urls, route_address

# TEST-NET-1 (RFC 5737): routed by the default route, never answered; UDP connect sends nothing
OFF_HOST = "192.0.2.1"


def _default_route_address() -> str:
    try:
        return route_address(OFF_HOST, 4222)
    except OSError:
        pytest.skip("this machine has no default route")


def test_route_to_loopback_server_is_the_loopback_address():
    assert route_address("127.0.0.1", 4222) == "127.0.0.1"


def test_route_resolves_host_names():
    assert ipaddress.ip_address(route_address("localhost", 4222)).is_loopback


def test_route_to_ipv6_server_is_an_ipv6_address():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        address = route_address("::1", 4222)
    except OSError:
        pytest.skip("IPv6 loopback is not configured here")
    assert address == "::1"


def test_route_to_a_remote_server_is_a_real_interface_address_not_loopback():
    address = _default_route_address()

    assert not ipaddress.ip_address(address).is_loopback


def test_unresolvable_server_raises():
    with pytest.raises(OSError):
        route_address("nats.invalid", 4222)


def test_urls_are_tried_in_turn_until_one_resolves():
    expected = _default_route_address()

    address = address_for_urls(["nats://nats.invalid:4222", f"tls://{OFF_HOST}:4443"])

    assert address == expected


def test_no_resolvable_url_falls_back_to_loopback_and_says_so(caplog):
    with caplog.at_level(logging.WARNING):
        address = address_for_urls(["nats://nats.invalid:4222", "http://example.org"])

    assert address == "127.0.0.1"
    assert "other nodes cannot reach" in caplog.text
    assert "expected nats:// or tls://" in caplog.text
