"""InfiniBand (and RoCE) adapters, from /sys/class/infiniband/<hca>/.

The fabric an adapter is on is configuration (`fabric_map`: adapter name -> fabric):
OpenSM's default subnet prefix, fe80:0000:0000:0000, is the same on nearly every fabric,
so nothing read here can tell two fabrics apart.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from llmgw.bus.records import IbAdapter, IbPort

log = logging.getLogger(__name__)

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec")


def _attr(path: Path) -> str:
    """One sysfs attribute, stripped; "" when missing or unreadable (a RoCE port that is
    down answers EINVAL on `rate`), so one odd file never hides the adapter."""
    try:
        return path.read_text().strip()
    except (OSError, ValueError):
        return ""


def parse_state(text: str) -> str:
    """ "4: ACTIVE" -> "ACTIVE", "5: LinkUp" -> "LinkUp"."""
    return text.partition(":")[2].strip() if ":" in text else text.strip()


def parse_rate_gbps(text: str) -> float:
    """ "100 Gb/sec (4X EDR)" -> 100.0; 0.0 when unreadable."""
    match = _RATE.match(text)
    return float(match.group(1)) if match else 0.0


def parse_lid(text: str) -> int | None:
    """ "0x1a" -> 26; None when absent or not hex."""
    try:
        return int(text, 16)
    except ValueError:
        return None


def subnet_prefix(gid: str) -> str:
    """The first 64 bits of a GID: "fe80:0000:0000:0000:b8ce:..." -> "fe80:0000:0000:0000"."""
    groups = gid.split(":")
    return ":".join(groups[:4]) if len(groups) == 8 else ""


def read_port(port_dir: Path) -> IbPort:
    gid0 = _attr(port_dir / "gids" / "0")
    rate = _attr(port_dir / "rate")
    return IbPort(
        port=int(port_dir.name),
        state=parse_state(_attr(port_dir / "state")),
        phys_state=parse_state(_attr(port_dir / "phys_state")),
        rate=rate,
        rate_gbps=parse_rate_gbps(rate),
        link_layer=_attr(port_dir / "link_layer"),
        lid=parse_lid(_attr(port_dir / "lid")),
        gid0=gid0,
        subnet_prefix=subnet_prefix(gid0),
    )


def read_adapter(hca_dir: Path, fabric: str | None = None) -> IbAdapter:
    ports_dir = hca_dir / "ports"
    try:
        port_dirs = [p for p in ports_dir.iterdir() if p.name.isdigit()]
    except OSError:
        port_dirs = []
    return IbAdapter(
        name=hca_dir.name,
        node_guid=_attr(hca_dir / "node_guid"),
        board_id=_attr(hca_dir / "board_id"),
        fw_ver=_attr(hca_dir / "fw_ver"),
        fabric=fabric,
        ports=[read_port(p) for p in sorted(port_dirs, key=lambda p: int(p.name))],
    )


def read_adapters(
    sysfs: Path = Path("/sys"), fabric_map: dict[str, str] | None = None
) -> list[IbAdapter]:
    """Every adapter under <sysfs>/class/infiniband, sorted by name; [] when there is none.

    An adapter missing from `fabric_map` gets fabric None: it is reported, but placement
    will not use it for multi-node replicas until the config says which fabric it is on."""
    fabric_map = fabric_map or {}
    class_dir = sysfs / "class" / "infiniband"
    try:
        hca_dirs = sorted(class_dir.iterdir(), key=lambda p: p.name)
    except FileNotFoundError:
        hca_dirs = []
    except OSError as exc:
        log.warning("cannot list InfiniBand adapters in %s: %s", class_dir, exc)
        hca_dirs = []
    adapters = [read_adapter(d, fabric_map.get(d.name)) for d in hca_dirs]
    found = {a.name for a in adapters}
    for name in sorted(set(fabric_map) - found):
        log.warning(
            "the fabric map names adapter %s (fabric %s) but %s has no such adapter; "
            "fix the adapter name in the agent config (found: %s)",
            name,
            fabric_map[name],
            class_dir,
            ", ".join(sorted(found)) or "none",
        )
    return adapters
