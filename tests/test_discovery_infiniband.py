import logging
from pathlib import Path

import pytest
from samples import infiniband as sample
from samples.sysfs import write_tree

from llmgw.agent.discovery.infiniband import (
    parse_lid,
    parse_rate_gbps,
    parse_state,
    read_adapters,
    subnet_prefix,
)

HCA0 = "devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0"


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    return write_tree(tmp_path, sample.FILES, sample.LINKS)


def _by_name(adapters):
    return {a.name: a for a in adapters}


def test_every_adapter_is_read_in_name_order(sysfs):
    adapters = read_adapters(sysfs, sample.FABRIC_MAP)

    assert [a.name for a in adapters] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]


def test_connectx7_adapter_attributes_and_port_are_parsed(sysfs):
    hca = _by_name(read_adapters(sysfs, sample.FABRIC_MAP))["mlx5_0"]

    assert (hca.node_guid, hca.board_id, hca.fw_ver) == (
        "b83f:d203:00a1:5c40",
        "MT_0000000838",
        "28.39.2048",
    )
    [port] = hca.ports
    assert (port.port, port.state, port.phys_state) == (1, "ACTIVE", "LinkUp")
    assert port.rate == "400 Gb/sec (4X NDR)"
    assert port.rate_gbps == 400.0
    assert port.link_layer == "InfiniBand"
    assert port.lid == 0x1A
    assert port.gid0 == "fe80:0000:0000:0000:b83f:d203:00a1:5c40"
    assert port.subnet_prefix == "fe80:0000:0000:0000"


def test_fabric_comes_from_the_map_even_though_both_fabrics_share_a_subnet_prefix(sysfs):
    adapters = _by_name(read_adapters(sysfs, sample.FABRIC_MAP))

    assert adapters["mlx5_0"].fabric == "ib-a"
    assert adapters["mlx5_1"].fabric == "ib-b"
    assert adapters["mlx5_0"].ports[0].subnet_prefix == adapters["mlx5_1"].ports[0].subnet_prefix


def test_adapter_not_in_the_map_has_no_fabric(sysfs):
    roce = _by_name(read_adapters(sysfs, sample.FABRIC_MAP))["mlx5_3"]

    assert roce.fabric is None


def test_without_a_fabric_map_every_adapter_is_reported_with_no_fabric(sysfs):
    adapters = read_adapters(sysfs)

    assert len(adapters) == 4
    assert {a.fabric for a in adapters} == {None}


def test_down_port_is_reported_inactive(sysfs):
    down = _by_name(read_adapters(sysfs, sample.FABRIC_MAP))["mlx5_2"]

    assert (down.ports[0].state, down.ports[0].phys_state) == ("DOWN", "Disabled")
    assert not down.active
    assert down.fabric == "ib-a"


def test_roce_adapter_is_reported_with_ethernet_link_layer(sysfs):
    roce = _by_name(read_adapters(sysfs, sample.FABRIC_MAP))["mlx5_3"]

    [port] = roce.ports
    assert port.link_layer == "Ethernet"
    assert port.lid == 0
    assert port.rate_gbps == 100.0
    assert roce.active


def test_node_fabrics_are_those_of_active_mapped_adapters(sysfs):
    from llmgw.bus.records import Cpu, Gpus, Memory, NodeInventory

    node = NodeInventory(
        node="gpu05",
        hostname="gpu05",
        address="10.0.0.5",
        agent_version="0",
        started_at=0.0,
        cpu=Cpu(count=1),
        memory=Memory(total_bytes=1, available_bytes=1),
        gpus=Gpus(status="no_library"),
        ib=read_adapters(sysfs, sample.FABRIC_MAP),
    )

    assert node.fabrics() == {"ib-a", "ib-b"}


def test_node_without_infiniband_class_has_no_adapters(tmp_path):
    assert read_adapters(tmp_path, {"mlx5_0": "ib-a"}) == []


def test_fabric_map_naming_a_missing_adapter_is_logged_with_the_adapters_found(sysfs, caplog):
    with caplog.at_level(logging.WARNING):
        read_adapters(sysfs, {"mlx5_9": "ib-c"})

    assert "mlx5_9" in caplog.text
    assert "mlx5_0, mlx5_1, mlx5_2, mlx5_3" in caplog.text


def test_missing_or_unreadable_attribute_is_empty_not_a_crash(tmp_path):
    files = dict(sample.FILES)
    del files[f"{HCA0}/fw_ver"]
    del files[f"{HCA0}/ports/1/lid"]
    files[f"{HCA0}/ports/1/rate"] = None  # a directory where the file is: reading fails
    sysfs = write_tree(tmp_path, files, sample.LINKS)

    hca = _by_name(read_adapters(sysfs))["mlx5_0"]

    assert hca.fw_ver == ""
    assert hca.ports[0].lid is None
    assert (hca.ports[0].rate, hca.ports[0].rate_gbps) == ("", 0.0)
    assert hca.ports[0].state == "ACTIVE"


def test_ports_are_ordered_numerically(tmp_path):
    files = {f"class/infiniband/mlx4_0/ports/{n}/state": "4: ACTIVE\n" for n in (10, 2, 1)}

    [hca] = read_adapters(write_tree(tmp_path, files))

    assert [p.port for p in hca.ports] == [1, 2, 10]


@pytest.mark.parametrize(
    ("text", "state"),
    [("4: ACTIVE", "ACTIVE"), ("1: DOWN", "DOWN"), ("5: LinkUp", "LinkUp"), ("", "")],
)
def test_state_drops_the_numeric_code(text, state):
    assert parse_state(text) == state


@pytest.mark.parametrize(
    ("text", "gbps"),
    [
        ("100 Gb/sec (4X EDR)", 100.0),
        ("400 Gb/sec (4X NDR)", 400.0),
        ("2.5 Gb/sec (1X SDR)", 2.5),
        ("", 0.0),
        ("Invalid argument", 0.0),
    ],
)
def test_rate_in_gbps(text, gbps):
    assert parse_rate_gbps(text) == gbps


def test_lid_is_hex_and_subnet_prefix_is_the_first_four_groups():
    assert parse_lid("0x1a") == 26
    assert parse_lid("") is None
    assert subnet_prefix("fe80:0000:0000:0000:b83f:d203:00a1:5c40") == "fe80:0000:0000:0000"
    assert subnet_prefix("") == ""
