"""Local or shared, and which share: recorded /proc/self/mountinfo lines fed to the parser."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmgw.agent.discovery.weights.mounts import (
    SHARE_ID_FILE,
    MountTable,
    check_declared_identity,
    parse_beegfs_client_conf,
    parse_mountinfo_line,
    parse_share_id,
    read_mount_table,
    read_share_id,
    resolve_store,
)
from llmgw.bus.records import Store

# recorded from real nodes (options shortened); one per kind of storage weights live on
LINES = {
    "nvme": "30 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw,errors=remount-ro",
    "xfs": "31 30 259:5 / /scratch rw,noatime shared:2 - xfs /dev/nvme1n1 rw,attr2,inode64,logbufs=8",
    "tmpfs": "32 30 0:30 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw,inode64",
    "local-bind": "33 30 259:5 /models /var/lib/llmgw-weights rw,noatime shared:2 - xfs /dev/nvme1n1 rw,attr2",
    "nfs": "120 30 0:52 / /mnt/models rw,relatime shared:70 - nfs filer01:/export/models rw,vers=3,rsize=1048576,wsize=1048576,hard,proto=tcp,addr=10.0.0.5",
    "nfs4": "121 30 0:53 / /data rw,relatime shared:71 - nfs4 Filer02.example.com:/ai/ rw,vers=4.2,rsize=1048576,hard,proto=rdma,port=20049,addr=10.0.0.6",
    "nfs-bind": "122 30 0:52 /team-a /srv/weights rw,relatime shared:70 - nfs filer01:/export/models rw,vers=3,addr=10.0.0.5",
    "lustre": "130 30 0:60 / /lustre rw,relatime shared:80 - lustre 10.10.0.1@o2ib,10.10.0.11@o2ib:10.10.0.2@o2ib:/lfs01 rw,flock,lazystatfs,encrypt",
    "gpfs": "140 30 0:70 / /gpfs/fs1 rw,relatime shared:90 - gpfs fs1 rw",
    "beegfs": "150 30 0:80 / /mnt/beegfs rw,relatime shared:95 - beegfs beegfs_nodev rw,cfgFile=/etc/beegfs/beegfs-client.conf,_netdev",
    "cephfs": "160 30 0:90 / /mnt/cephfs rw,relatime shared:99 - ceph 10.0.0.2:6789,10.0.0.1:6789:/volumes/models rw,name=llm,secret=<hidden>,acl",
    "cephfs-new": "161 30 0:91 / /mnt/ceph2 rw,relatime shared:98 - ceph node07@b3acfc0d-575f-41d3-9c91-0e7ed3dbb3fa.cephfs=/models rw,secret=<hidden>",
    "ceph-fuse": "162 30 0:92 / /mnt/cfuse rw,relatime shared:97 - fuse.ceph-fuse ceph-fuse rw,user_id=0,group_id=0,allow_other",
    "cifs": "170 30 0:100 / /mnt/smb rw,relatime shared:101 - cifs //FileServer/Models rw,vers=3.1.1,cache=strict,username=svc",
    "glusterfs": "180 30 0:110 / /mnt/gluster rw,relatime shared:103 - fuse.glusterfs gs1:/gv0 rw,user_id=0,group_id=0,allow_other",
    "overlay": "500 400 0:200 / /var/lib/containers/x/merged rw,relatime - overlay overlay rw,lowerdir=/a:/b,upperdir=/c,workdir=/d",
}

EXPECTED: dict[str, tuple[str, str]] = {
    "nvme": ("local", "local:node05"),
    "xfs": ("local", "local:node05"),
    "tmpfs": ("local", "local:node05"),
    "local-bind": ("local", "local:node05"),
    "overlay": ("local", "local:node05"),
    "ceph-fuse": ("local", "local:node05"),  # source "ceph-fuse" names no cluster: unsure
    "nfs": ("shared", "nfs:filer01:/export/models"),
    "nfs4": ("shared", "nfs:filer02.example.com:/ai"),
    "nfs-bind": ("shared", "nfs:filer01:/export/models/team-a"),
    "lustre": ("shared", "lustre:lfs01"),
    "gpfs": ("shared", "gpfs:fs1"),
    "beegfs": ("shared", "beegfs:cfg:/etc/beegfs/beegfs-client.conf"),
    "cephfs": ("shared", "ceph:10.0.0.1:6789,10.0.0.2:6789:/volumes/models"),
    "cephfs-new": ("shared", "ceph:b3acfc0d-575f-41d3-9c91-0e7ed3dbb3fa.cephfs=/models"),
    "cifs": ("shared", "cifs://fileserver/models"),
    "glusterfs": ("shared", "gluster:gs1:/gv0"),
}


def table(*names: str) -> MountTable:
    return MountTable.from_text("\n".join(LINES[n] for n in names) + "\n")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_storage_kind_gets_its_store(name: str) -> None:
    mount = parse_mountinfo_line(LINES[name])
    store = table("nvme", name).store_for(mount.mount_point + "/org/model", "node05")
    assert (store.kind, store.identity) == EXPECTED[name]
    if name != "nvme":
        assert store.fs_type == mount.fs_type


def test_one_filer_seen_by_twenty_nodes_has_one_identity() -> None:
    shared = {table("nvme", "nfs").store_for("/mnt/models/a", f"n{i}").identity for i in range(20)}
    local = {table("nvme").store_for("/models/a", f"n{i}").identity for i in range(20)}
    assert shared == {"nfs:filer01:/export/models"}
    assert len(local) == 20  # a local disk is never another node's copy


def test_bind_mounts_of_two_nfs_subdirs_are_two_stores_and_match_a_direct_mount() -> None:
    team_b = LINES["nfs-bind"].replace("/team-a /srv/weights", "/team-b /srv/other")
    direct = "123 30 0:54 / /mnt/team-a rw - nfs filer01:/export/models/team-a rw,vers=3"
    # the kernel may also show the subdirectory in the source with root "/"
    folded = "124 30 0:52 /team-a /srv/folded rw - nfs filer01:/export/models/team-a rw"
    t = MountTable.from_text("\n".join([LINES["nvme"], LINES["nfs-bind"], team_b, direct, folded]))
    a = t.store_for("/srv/weights/m", "n1").identity
    assert a == "nfs:filer01:/export/models/team-a"
    assert t.store_for("/srv/other/m", "n1").identity == "nfs:filer01:/export/models/team-b"
    assert t.store_for("/mnt/team-a/m", "n2").identity == a
    assert t.store_for("/srv/folded/m", "n3").identity == a


def test_lustre_identity_is_the_fsname_whatever_nids_a_node_lists() -> None:
    other_order = LINES["lustre"].replace(
        "10.10.0.1@o2ib,10.10.0.11@o2ib:10.10.0.2@o2ib:/lfs01", "mgs2@tcp:mgs1@tcp:/lfs01"
    )
    assert MountTable.from_text(other_order).store_for("/lustre/x", "n").identity == "lustre:lfs01"
    fileset = LINES["lustre"].replace(":/lfs01", ":/lfs01/models")
    assert (
        MountTable.from_text(fileset).store_for("/lustre/x", "n").identity == "lustre:lfs01/models"
    )


def test_longest_mount_point_wins_and_prefix_must_be_a_whole_component() -> None:
    t = table("nvme", "nfs")
    assert t.store_for("/mnt/models/a/b", "n").kind == "shared"
    assert t.store_for("/mnt/models", "n").kind == "shared"
    assert t.store_for("/mnt/models2/a", "n").kind == "local"


def test_of_mounts_stacked_on_one_point_the_last_is_on_top() -> None:
    over = "600 120 259:9 / /mnt/models rw - ext4 /dev/nvme2n1 rw"
    t = MountTable.from_text("\n".join([LINES["nvme"], LINES["nfs"], over]))
    assert t.store_for("/mnt/models/x", "n").kind == "local"


def test_octal_escapes_in_paths_are_decoded() -> None:
    line = r"34 30 0:52 / /mnt/my\040models rw - nfs filer01:/export/my\040models rw"
    t = MountTable.from_text(line)
    assert t.mounts[0].mount_point == "/mnt/my models"
    assert t.store_for("/mnt/my models/x", "n").identity == "nfs:filer01:/export/my models"


def test_unreadable_mount_table_makes_everything_local(tmp_path: Path) -> None:
    store = read_mount_table(procfs=tmp_path).store_for("/mnt/models", "node05")
    assert store == Store(kind="local", identity="local:node05", source="default")


def test_beegfs_identity_comes_from_its_management_host(tmp_path: Path) -> None:
    cfg = tmp_path / "beegfs-client.conf"
    cfg.write_text(
        "# client\nsysMgmtdHost          = MGMT01   # the management daemon\nconnPortShift = 0\n"
    )
    (tmp_path / "self").mkdir()
    line = LINES["beegfs"].replace("/etc/beegfs/beegfs-client.conf", str(cfg))
    (tmp_path / "self" / "mountinfo").write_text(LINES["nvme"] + "\n" + line + "\n")
    store = read_mount_table(procfs=tmp_path).store_for("/mnt/beegfs/models/x", "n")
    assert store.identity == "beegfs:mgmt01"
    assert parse_beegfs_client_conf("sysMgmtdHost =\n") is None
    no_cfg = LINES["beegfs"].replace(",cfgFile=/etc/beegfs/beegfs-client.conf", "")
    assert MountTable.from_text(no_cfg).store_for("/mnt/beegfs/x", "n").identity == (
        "beegfs:mount:/mnt/beegfs"
    )


def test_this_machines_mount_table_parses() -> None:
    t = read_mount_table()
    assert t.mount_for("/") is not None


def test_symlink_into_a_share_is_the_share(tmp_path: Path) -> None:
    filer = tmp_path / "filer"
    (filer / "models").mkdir(parents=True)
    (tmp_path / "weights").mkdir()
    os.symlink(filer / "models", tmp_path / "weights" / "llama")
    mounts = MountTable.from_text(
        f"{LINES['nvme']}\n130 30 0:52 / {filer} rw - nfs filer01:/export rw\n"
    )
    store = resolve_store(tmp_path / "weights" / "llama", mounts, "n1", {})
    assert (store.kind, store.identity) == ("shared", "nfs:filer01:/export")


def test_id_file_wins_over_the_mount(tmp_path: Path) -> None:
    (tmp_path / SHARE_ID_FILE).write_text("  srp-image-07  \nanything else\n")
    share_id = read_share_id(tmp_path)
    assert share_id == "srp-image-07"
    store = resolve_store(
        tmp_path / "m", table("nvme"), "n1", {}, {os.path.realpath(tmp_path): share_id}
    )
    assert store == Store(kind="shared", identity="srp-image-07", fs_type="ext4", source="id-file")


@pytest.mark.parametrize(
    "text", ["", "\n\n", "has spaces in it", "local:node05", "x" * 300, "tab\there"]
)
def test_insane_id_file_is_ignored(text: str) -> None:
    assert parse_share_id(text) is None


def test_config_override_declares_a_local_looking_dir_shared(tmp_path: Path) -> None:
    store = resolve_store(
        tmp_path / "sub" / "m", table("nvme"), "n1", {str(tmp_path): "nvmeof:img01"}
    )
    assert store == Store(kind="shared", identity="nvmeof:img01", source="config")
    # and it wins over an id file too: the config is what was written for this node
    store = resolve_store(
        tmp_path / "m", table("nvme"), "n1", {str(tmp_path): "cfg"}, {str(tmp_path): "idfile"}
    )
    assert store.source == "config"


def test_declared_identity_with_spaces_is_refused_naming_the_directory() -> None:
    with pytest.raises(ValueError, match="/data/models"):
        check_declared_identity("my share", "/data/models")
    assert check_declared_identity("nfs:filer01:/export", "/data") == "nfs:filer01:/export"


def test_line_without_separator_is_refused() -> None:
    with pytest.raises(ValueError, match="not a mountinfo line"):
        parse_mountinfo_line("36 35 98:0 /mnt1 /mnt/parent rw,noatime")


def test_a_scans_remembered_realpath_answers_as_os_realpath_does(tmp_path) -> None:
    """Links at every level (into a filer's mount, back up the tree, dangling, in a loop),
    dots, missing paths and a relative start: the same answer as os.path.realpath."""
    from llmgw.agent.discovery.weights.mounts import RealPaths

    root = tmp_path / "w"
    (root / "real" / "a" / "b").mkdir(parents=True)
    (root / "real" / "a" / "b" / "f.safetensors").write_bytes(b"x")
    (root / "filer" / "models" / "m").mkdir(parents=True)
    (root / "linked").symlink_to(root / "real")  # a directory link above the file
    (root / "real" / "a" / "to-filer").symlink_to(root / "filer" / "models")
    (root / "real" / "a" / "up").symlink_to("../..")  # relative, up the tree
    (root / "real" / "dangling").symlink_to(root / "nowhere")
    (root / "loop1").symlink_to(root / "loop2")
    (root / "loop2").symlink_to(root / "loop1")
    paths = [
        root / "linked" / "a" / "b" / "f.safetensors",
        root / "real" / "a" / "to-filer" / "m",
        root / "real" / "a" / "up" / "real" / "a" / "b",
        root / "real" / "dangling",
        root / "real" / "dangling" / "below",
        root / "loop1" / "x",
        root / "missing" / "deeper",
        f"{root}/real/a/./b/../b",
        f"{root}/linked/a/b/",
        "relative/path",
        "/",
    ]
    remembered = RealPaths()
    for p in paths * 2:  # the second round from memory
        assert remembered(p) == os.path.realpath(p), p
    # a relinked directory is seen by the next scan's RealPaths, not this one's
    (root / "linked").unlink()
    (root / "linked").symlink_to(root / "filer")
    assert RealPaths()(root / "linked" / "models") == str(root / "filer" / "models")
