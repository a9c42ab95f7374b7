"""Which store a weights path is on: a share every node sees the same, or this node's disk.

Read from /proc/self/mountinfo. A shared store gets an identity that every node mounting
it computes the same way (`nfs:filer01:/export/models`), so twenty nodes seeing one filer
count as one copy. Anything unsure is local (`local:<node>`): a filer read as local costs
an unnecessary copy, while local read as shared would have the cluster believe a model is
everywhere when it is on one node.

What is written wins over the mount: a directory the config declares shared (an image
exported with SRP or NVMe-oF looks like a local disk) and a `.llmgw-share-id` file at the
top of a weights directory.
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.agent.files import TooLarge, open_regular, read_text_bounded
from llmgw.bus.records import Store

# filesystem types whose contents other nodes can see; everything else is local
SHARED_FS_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "cifs",
        "smb3",
        "glusterfs",
        "fuse.glusterfs",
        "fuse.cephfs",
        "fuse.ceph-fuse",
    }
)

SHARE_ID_FILE = ".llmgw-share-id"
_SANE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@=+,-]{0,199}$")
_OCTAL = re.compile(r"\\([0-7]{3})")


def unescape(field: str) -> str:
    r"""mountinfo escapes space, tab, newline and backslash as \040, \011, \012, \134."""
    return _OCTAL.sub(lambda m: chr(int(m[1], 8)), field)


@dataclass(frozen=True, slots=True)
class Mount:
    mount_point: str
    root: str  # the subtree of the filesystem mounted here ("/" unless a bind mount)
    fs_type: str
    source: str
    super_options: str = ""

    def option(self, name: str) -> str | None:
        for opt in self.super_options.split(","):
            key, sep, value = opt.partition("=")
            if key == name:
                return value if sep else ""
        return None


def parse_mountinfo_line(line: str) -> Mount:
    """`36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw,errors=continue`:
    the optional fields before ` - ` vary in number, so split there."""
    head, sep, tail = line.rstrip("\n").partition(" - ")
    fields = head.split(" ")
    rest = tail.split(" ")
    if not sep or len(fields) < 6 or len(rest) < 2:
        raise ValueError(f"not a mountinfo line: {line!r}")
    return Mount(
        mount_point=unescape(fields[4]),
        root=unescape(fields[3]),
        fs_type=rest[0],
        source=unescape(rest[1]),
        super_options=rest[2] if len(rest) > 2 else "",
    )


def _subpath(mount: Mount) -> str:
    return "" if mount.root in ("/", "") else posixpath.normpath(mount.root)


def _nfs_identity(mount: Mount) -> str | None:
    server, sep, export = mount.source.partition(":/")
    if mount.source.startswith("["):  # [fe80::1]:/export
        server, sep, export = mount.source[1:].partition("]:/")
    if not sep or not server:
        return None
    export = posixpath.normpath("/" + export)
    sub = _subpath(mount)
    # the kernel usually folds a bind mount's subdirectory into the source already
    if sub and not export.endswith(sub):
        export = posixpath.normpath(export + sub)
    return f"nfs:{server.lower().rstrip('.')}:{export}"


def _lustre_identity(mount: Mount) -> str | None:
    # mgs1@o2ib,mgs1b@o2ib:mgs2@o2ib:/lfs01[/fileset]: one fsname, however many MGS nids
    _, sep, path = mount.source.rpartition(":/")
    if not sep or not path:
        return None
    return "lustre:" + posixpath.normpath(path + _subpath(mount))


def _gpfs_identity(mount: Mount) -> str | None:
    device = mount.source.removeprefix("/dev/")
    return f"gpfs:{device}{_subpath(mount)}" if device else None


def _ceph_identity(mount: Mount) -> str | None:
    source = mount.source
    if "@" in source and "=" in source:  # new syntax: user@fsid.fsname=/path; user differs per node
        return "ceph:" + source.split("@", 1)[1] + _subpath(mount)
    mons, sep, path = source.rpartition(":/")
    if not sep:
        return None
    # the same monitors may be listed in a different order on each node
    return f"ceph:{','.join(sorted(mons.split(',')))}:" + posixpath.normpath(
        f"/{path}{_subpath(mount)}"
    )


def _cifs_identity(mount: Mount) -> str | None:
    source = mount.source.replace("\\", "/")
    if not source.startswith("//") or len(source) <= 2:
        return None
    # SMB share and server names are case-insensitive
    return "cifs://" + posixpath.normpath("/" + source[2:].lower()).lstrip("/") + _subpath(mount)


def _gluster_identity(mount: Mount) -> str | None:
    # the source string as mounted: the same volume mounted from two servers of the pool
    # reads as two stores (an unneeded copy), never two volumes named alike as one
    return f"gluster:{mount.source}{_subpath(mount)}" if ":" in mount.source else None


def _beegfs_identity(mount: Mount, mgmt_hosts: Mapping[str, str]) -> str:
    # source is always "beegfs_nodev": the management host in the client config names the
    # filesystem; without it, the config file path, and last the mount point
    cfg = mount.option("cfgFile")
    if cfg and mgmt_hosts.get(cfg):
        base = f"beegfs:{mgmt_hosts[cfg]}"
    elif cfg:
        base = f"beegfs:cfg:{cfg}"
    else:
        base = f"beegfs:mount:{mount.mount_point}"
    return base + _subpath(mount)


def share_identity(mount: Mount, mgmt_hosts: Mapping[str, str] | None = None) -> str | None:
    """The identity every node computes for this share; None when the mount is not a share
    or nothing in it names the share for sure (then it counts as local)."""
    fs = mount.fs_type
    if fs not in SHARED_FS_TYPES:
        return None
    if fs in ("nfs", "nfs4"):
        return _nfs_identity(mount)
    if fs == "lustre":
        return _lustre_identity(mount)
    if fs == "gpfs":
        return _gpfs_identity(mount)
    if fs == "beegfs":
        return _beegfs_identity(mount, mgmt_hosts or {})
    if fs == "ceph":
        return _ceph_identity(mount)
    if fs in ("cifs", "smb3"):
        return _cifs_identity(mount)
    if fs in ("glusterfs", "fuse.glusterfs"):
        return _gluster_identity(mount)
    # ceph-fuse shows the source "ceph-fuse" on every cluster: no identity to trust
    if ":" in mount.source or "@" in mount.source:
        return f"{fs}:{mount.source}{_subpath(mount)}"
    return None


def is_under(path: str, top: str) -> bool:
    """`path` is `top` or inside it, by name (both absolute, normalised)."""
    return path == top or path.startswith(top.rstrip("/") + "/")


@dataclass(frozen=True, slots=True)
class MountTable:
    mounts: tuple[Mount, ...]
    # cfgFile -> sysMgmtdHost, read by the shell for BeeGFS mounts
    beegfs_mgmt_hosts: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_text(cls, text: str, beegfs_mgmt_hosts: Mapping[str, str] | None = None) -> MountTable:
        mounts = tuple(parse_mountinfo_line(line) for line in text.splitlines() if line.strip())
        return cls(mounts, dict(beegfs_mgmt_hosts or {}))

    @classmethod
    def empty(cls) -> MountTable:
        return cls((), {})

    def mount_for(self, path: str) -> Mount | None:
        """The mount a resolved absolute path is on: the longest mount point above it; of
        mounts stacked on one point, the last listed (the one on top)."""
        best: Mount | None = None
        for m in self.mounts:
            if is_under(path, m.mount_point) and (
                best is None or len(m.mount_point) >= len(best.mount_point)
            ):
                best = m
        return best

    def store_for(self, path: str, node: str) -> Store:
        """Store of an already resolved path, from the mount alone."""
        mount = self.mount_for(path)
        if mount is None:
            return Store(kind="local", identity=local_identity(node), source="default")
        identity = share_identity(mount, self.beegfs_mgmt_hosts)
        if identity is None:
            return Store(kind="local", identity=local_identity(node), fs_type=mount.fs_type)
        return Store(kind="shared", identity=identity, fs_type=mount.fs_type)


def local_identity(node: str) -> str:
    return f"local:{node}"


def parse_share_id(text: str) -> str | None:
    """First line, stripped; None unless it is a sane identity (printable, no spaces, at most
    200 characters, and not pretending to be a node's local disk)."""
    first = text.splitlines()[0].strip() if text.strip() else ""
    if not _SANE_ID.match(first) or first.startswith("local:"):
        return None
    return first


def check_declared_identity(identity: str, where: str) -> str:
    """A shared identity from the config: the same rules as the id file, with an error that
    says where it came from."""
    if parse_share_id(identity) != identity:
        raise ValueError(
            f"shared identity {identity!r} for {where} is not usable: use letters, digits and "
            "._:/@=+,- only (no spaces, at most 200 characters, not starting with 'local:')"
        )
    return identity


def read_share_id(directory: Path) -> str | None:
    """`.llmgw-share-id` at the top of a weights directory, when present and sane."""
    try:
        with open_regular(directory / SHARE_ID_FILE) as f:
            return parse_share_id(f.read(1024).decode(errors="replace"))
    except OSError:
        return None


def parse_beegfs_client_conf(text: str) -> str | None:
    """sysMgmtdHost from a beegfs-client.conf."""
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "sysMgmtdHost" and value.strip():
            return value.split("#", 1)[0].strip().lower() or None
    return None


# a Kubernetes node with ~10k mounts has ~2 MB of mountinfo; a client config is a few KB
_MOUNTINFO_LIMIT = 64 << 20
_BEEGFS_CONF_LIMIT = 1 << 20


def read_mount_table(procfs: Path = Path("/proc")) -> MountTable:
    """This process's mounts, and the BeeGFS management host of each BeeGFS mount. An
    unreadable mountinfo gives an empty table: every path is then local."""
    try:
        text = read_text_bounded(procfs / "self" / "mountinfo", _MOUNTINFO_LIMIT)
        table = MountTable.from_text(text)
    except (OSError, ValueError):  # TooLarge, or a line that is not mountinfo
        return MountTable.empty()
    hosts: dict[str, str] = {}
    for m in table.mounts:
        cfg = m.option("cfgFile") if m.fs_type == "beegfs" else None
        if cfg and cfg not in hosts:
            try:
                host = parse_beegfs_client_conf(read_text_bounded(cfg, _BEEGFS_CONF_LIMIT))
            except (OSError, TooLarge):
                host = None
            if host:
                hosts[cfg] = host
    return MountTable(table.mounts, hosts)


class RealPaths:
    """`os.path.realpath`, remembered for one scan: a directory's parent is resolved once
    for all its entries, and an entry that is not a symlink then costs one lstat, where
    realpath lstats every component of every path again (25 per model on a deep tree).
    Only for one scan: a link may be changed between two."""

    def __init__(self) -> None:
        self._known: dict[str, str] = {}

    def __call__(self, path: str | Path) -> str:
        path = os.fspath(path)
        real = self._known.get(path)
        if real is None:
            real = self._resolve(path)
            self._known[path] = real
        return real

    def _resolve(self, path: str) -> str:
        parent, name = os.path.split(path)
        if not parent or not name or name in (".", "..") or parent == path:
            return os.path.realpath(path)  # a root, a relative start, a dot: as realpath does
        try:
            link = stat.S_ISLNK(os.lstat(path).st_mode)
        except OSError:
            link = True  # missing or unreadable: realpath says what it says of those
        if link:
            return os.path.realpath(path)
        return os.path.join(self(parent), name)


def resolve_store(
    path: Path,
    mounts: MountTable,
    node: str,
    shared_overrides: Mapping[str, str],
    share_ids: Mapping[str, str] | None = None,
    realpath: Callable[[str | Path], str] = os.path.realpath,
) -> Store:
    """The store of `path`, most written first: a config override for a directory above it,
    then a `.llmgw-share-id` (`share_ids`: resolved weights directory -> identity read from
    its id file) of a weights directory above it, then the mount. Symlinks are resolved
    first, so a link into a filer is the filer (`realpath`: a scan's RealPaths)."""
    real = realpath(path)
    for declared, identity in sorted(shared_overrides.items(), key=lambda kv: -len(kv[0])):
        if is_under(real, realpath(declared)):
            return Store(kind="shared", identity=identity, source="config")
    mount_store = mounts.store_for(real, node)
    for top, share_id in sorted((share_ids or {}).items(), key=lambda kv: -len(kv[0])):
        if is_under(real, top):
            return Store(
                kind="shared", identity=share_id, fs_type=mount_store.fs_type, source="id-file"
            )
    return mount_store
