"""/sys of one GPU node with four RDMA adapters, as the kernel shows them (mlx5 driver).

- mlx5_0, mlx5_1: ConnectX-7 (MT4129), NDR 400 Gb/s InfiniBand, ACTIVE, each cabled to its
  own fabric (configured as ib-a and ib-b) with the SAME OpenSM default subnet prefix
  fe80:0000:0000:0000: why the fabric has to be configuration.
- mlx5_2: ConnectX-6 (MT4123), HDR InfiniBand, port 1 DOWN / Disabled (unplugged cable).
- mlx5_3: ConnectX-6 Dx (MT4125), RoCE: link_layer Ethernet, lid 0, MAC-derived GID.
  Not in FABRIC_MAP.

Paths are relative to the sysfs root; class/infiniband/<hca> are symlinks (LINKS) into
devices/, exactly as on the node.
"""

FABRIC_MAP = {"mlx5_0": "ib-a", "mlx5_1": "ib-b", "mlx5_2": "ib-a"}

FILES: dict[str, str | None] = {
    # mlx5_0
    "devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0/node_guid": "b83f:d203:00a1:5c40\n",
    "devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0/sys_image_guid": "b83f:d203:00a1:5c40\n",
    "devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0/board_id": "MT_0000000838\n",
    "devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0/fw_ver": "28.39.2048\n",
    "devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0/hca_type": "MT4129\n",
    "devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0/node_type": "1: CA\n",
    "devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0/node_desc": "gpu05 mlx5_0\n",
    "devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0/ports/1/state": "4: ACTIVE\n",
    "devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0/ports/1/phys_state": "5: LinkUp\n",
    "devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0/ports/1/rate": "400 Gb/sec (4X NDR)\n",
    "devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0/ports/1/link_layer": "InfiniBand\n",
    "devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0/ports/1/lid": "0x1a\n",
    "devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0/ports/1/sm_lid": "0x1\n",
    "devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0/ports/1/lid_mask_count": "0\n",
    "devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0/ports/1/sm_sl": "0\n",
    "devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0/ports/1/gids/0": "fe80:0000:0000:0000:b83f:d203:00a1:5c40\n",
    "devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0/ports/1/gids/1": "0000:0000:0000:0000:0000:0000:0000:0000\n",
    # mlx5_1
    "devices/pci0000:00/0000:00:03.1/0000:3c:00.0/infiniband/mlx5_1/node_guid": "b83f:d203:00a1:5d18\n",
    "devices/pci0000:00/0000:00:03.1/0000:3c:00.0/infiniband/mlx5_1/sys_image_guid": "b83f:d203:00a1:5d18\n",
    "devices/pci0000:00/0000:00:03.1/0000:3c:00.0/infiniband/mlx5_1/board_id": "MT_0000000838\n",
    "devices/pci0000:00/0000:00:03.1/0000:3c:00.0/infiniband/mlx5_1/fw_ver": "28.39.2048\n",
    "devices/pci0000:00/0000:00:03.1/0000:3c:00.0/infiniband/mlx5_1/hca_type": "MT4129\n",
    "devices/pci0000:00/0000:00:03.1/0000:3c:00.0/infiniband/mlx5_1/node_type": "1: CA\n",
    "devices/pci0000:00/0000:00:03.1/0000:3c:00.0/infiniband/mlx5_1/node_desc": "gpu05 mlx5_1\n",
    "devices/pci0000:00/0000:00:03.1/0000:3c:00.0/infiniband/mlx5_1/ports/1/state": "4: ACTIVE\n",
    "devices/pci0000:00/0000:00:03.1/0000:3c:00.0/infiniband/mlx5_1/ports/1/phys_state": "5: LinkUp\n",
    "devices/pci0000:00/0000:00:03.1/0000:3c:00.0/infiniband/mlx5_1/ports/1/rate": "400 Gb/sec (4X NDR)\n",
    "devices/pci0000:00/0000:00:03.1/0000:3c:00.0/infiniband/mlx5_1/ports/1/link_layer": "InfiniBand\n",
    "devices/pci0000:00/0000:00:03.1/0000:3c:00.0/infiniband/mlx5_1/ports/1/lid": "0xc\n",
    "devices/pci0000:00/0000:00:03.1/0000:3c:00.0/infiniband/mlx5_1/ports/1/sm_lid": "0x1\n",
    "devices/pci0000:00/0000:00:03.1/0000:3c:00.0/infiniband/mlx5_1/ports/1/lid_mask_count": "0\n",
    "devices/pci0000:00/0000:00:03.1/0000:3c:00.0/infiniband/mlx5_1/ports/1/sm_sl": "0\n",
    "devices/pci0000:00/0000:00:03.1/0000:3c:00.0/infiniband/mlx5_1/ports/1/gids/0": "fe80:0000:0000:0000:b83f:d203:00a1:5d18\n",
    "devices/pci0000:00/0000:00:03.1/0000:3c:00.0/infiniband/mlx5_1/ports/1/gids/1": "0000:0000:0000:0000:0000:0000:0000:0000\n",
    # mlx5_2
    "devices/pci0000:80/0000:80:01.1/0000:86:00.0/infiniband/mlx5_2/node_guid": "0c42:a103:0065:8e2a\n",
    "devices/pci0000:80/0000:80:01.1/0000:86:00.0/infiniband/mlx5_2/sys_image_guid": "0c42:a103:0065:8e2a\n",
    "devices/pci0000:80/0000:80:01.1/0000:86:00.0/infiniband/mlx5_2/board_id": "MT_0000000223\n",
    "devices/pci0000:80/0000:80:01.1/0000:86:00.0/infiniband/mlx5_2/fw_ver": "20.39.1002\n",
    "devices/pci0000:80/0000:80:01.1/0000:86:00.0/infiniband/mlx5_2/hca_type": "MT4123\n",
    "devices/pci0000:80/0000:80:01.1/0000:86:00.0/infiniband/mlx5_2/node_type": "1: CA\n",
    "devices/pci0000:80/0000:80:01.1/0000:86:00.0/infiniband/mlx5_2/node_desc": "gpu05 mlx5_2\n",
    "devices/pci0000:80/0000:80:01.1/0000:86:00.0/infiniband/mlx5_2/ports/1/state": "1: DOWN\n",
    "devices/pci0000:80/0000:80:01.1/0000:86:00.0/infiniband/mlx5_2/ports/1/phys_state": "3: Disabled\n",
    "devices/pci0000:80/0000:80:01.1/0000:86:00.0/infiniband/mlx5_2/ports/1/rate": "10 Gb/sec (4X SDR)\n",
    "devices/pci0000:80/0000:80:01.1/0000:86:00.0/infiniband/mlx5_2/ports/1/link_layer": "InfiniBand\n",
    "devices/pci0000:80/0000:80:01.1/0000:86:00.0/infiniband/mlx5_2/ports/1/lid": "0xffff\n",
    "devices/pci0000:80/0000:80:01.1/0000:86:00.0/infiniband/mlx5_2/ports/1/sm_lid": "0x0\n",
    "devices/pci0000:80/0000:80:01.1/0000:86:00.0/infiniband/mlx5_2/ports/1/lid_mask_count": "0\n",
    "devices/pci0000:80/0000:80:01.1/0000:86:00.0/infiniband/mlx5_2/ports/1/sm_sl": "0\n",
    "devices/pci0000:80/0000:80:01.1/0000:86:00.0/infiniband/mlx5_2/ports/1/gids/0": "fe80:0000:0000:0000:0c42:a103:0065:8e2a\n",
    "devices/pci0000:80/0000:80:01.1/0000:86:00.0/infiniband/mlx5_2/ports/1/gids/1": "0000:0000:0000:0000:0000:0000:0000:0000\n",
    # mlx5_3
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/node_guid": "0a5c:2b03:003d:4e20\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/sys_image_guid": "0a5c:2b03:003d:4e20\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/board_id": "MT_0000000359\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/fw_ver": "22.39.1002\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/hca_type": "MT4125\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/node_type": "1: CA\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/node_desc": "gpu05 mlx5_3\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/ports/1/state": "4: ACTIVE\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/ports/1/phys_state": "5: LinkUp\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/ports/1/rate": "100 Gb/sec (4X EDR)\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/ports/1/link_layer": "Ethernet\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/ports/1/lid": "0x0\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/ports/1/sm_lid": "0x0\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/ports/1/lid_mask_count": "0\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/ports/1/sm_sl": "0\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/ports/1/gids/0": "fe80:0000:0000:0000:085c:2bff:fe3d:4e20\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/ports/1/gids/1": "fe80:0000:0000:0000:085c:2bff:fe3d:4e20\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/ports/1/gid_attrs/types/0": "IB/RoCE v1\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/ports/1/gid_attrs/types/1": "RoCE v2\n",
    "devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3/ports/1/gid_attrs/ndevs/0": "ens5f0np0\n",
}

LINKS: dict[str, str] = {
    "class/infiniband/mlx5_0": "../../devices/pci0000:00/0000:00:01.1/0000:1a:00.0/infiniband/mlx5_0",
    "class/infiniband/mlx5_1": "../../devices/pci0000:00/0000:00:03.1/0000:3c:00.0/infiniband/mlx5_1",
    "class/infiniband/mlx5_2": "../../devices/pci0000:80/0000:80:01.1/0000:86:00.0/infiniband/mlx5_2",
    "class/infiniband/mlx5_3": "../../devices/pci0000:80/0000:80:03.1/0000:a1:00.0/infiniband/mlx5_3",
}
