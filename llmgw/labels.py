"""Node labels and taints, and the selectors and tolerations profiles place by.

Kubernetes' semantics, kept small (docs/placement.md, "Labels, selectors and taints"):

- a node's labels are discovered from the inventory its agent reports (`discovered_labels`:
  GPU model and count, fabrics, engines and their versions, the node id) plus those its agent
  config sets (`node.labels`), which win over a discovered one of the same key;
- a discovered label may have several values (a node on two fabrics, with two engines);
- a profile's `node_selector` is key = value pairs, every one required; a value matches
  when it is one of the label's values. A value written `!v` requires the opposite: the
  node has no such label, or its values do not include v (`node = "!node07"`);
- a taint is a name a node carries (agent config `node.taints`, or the operator's
  `llmgw node taint`); a profile is placed on a tainted node only if it lists every one of
  its taints in `tolerations`. Taints keep new replicas away and never evict running ones.

Pure: the syntax rules here are the ones the catalog, the agent config and the bus's readers
check, and placement's filters ask `unmatched` and `untolerated`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence

from llmgw.bus.records import NodeInventory

# a key: letters, digits, '.', '-', '_', starting and ending with a letter or digit
_KEY = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
_VALUE = re.compile(r"^[A-Za-z0-9._-]{1,63}$")
MAX_LABELS = 64
MAX_TAINTS = 32
NOT = "!"

Labels = Mapping[str, frozenset[str]]


def key_problem(key: object) -> str | None:
    """Why `key` cannot be a label key or a taint, or None."""
    if not isinstance(key, str) or not _KEY.match(key):
        return (
            f"{key!r} is not a label name: 1-63 letters, digits, '.', '-' and '_', starting "
            "and ending with a letter or digit"
        )
    return None


def value_problem(value: object, *, negation: bool = False) -> str | None:
    """Why `value` cannot be a label value (with `negation`, a selector's `!value` too)."""
    if negation and isinstance(value, str) and value.startswith(NOT):
        value = value[len(NOT) :]
    if not isinstance(value, str) or not _VALUE.match(value):
        return f"{value!r} is not a label value: 1-63 letters, digits, '.', '-' and '_'"
    return None


@functools.lru_cache(maxsize=1024)  # a fleet has a few GPU names, read on every node
def sanitize_value(text: str) -> str:
    """Discovered text as a label value: "NVIDIA H100 80GB HBM3" -> "H100-80GB-HBM3"."""
    text = text.removeprefix("NVIDIA ").strip()
    out = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:63].strip("-._")
    return out or "unknown"


def discovered_labels(inv: NodeInventory) -> dict[str, frozenset[str]]:
    """The labels a node's inventory says of it, in one place: `node`, `gpu.model`,
    `gpu.count`, `gpu.mig`, `fabric` (active ones), `engine`, and `<engine>.version`."""
    labels: dict[str, set[str]] = {
        "node": {inv.node},
        "gpu.count": {str(len(inv.gpus.devices))},
    }
    models = {sanitize_value(g.name) for g in inv.gpus.devices}
    if models:
        labels["gpu.model"] = models
    # the MIG profiles the operator configured ("1g.18gb"): `gpu.mig = "1g.18gb"` asks for a
    # node that has one (a profile's gpu_model asks for the GPU itself)
    migs = {g.mig_profile for g in inv.gpus.devices if g.mig_profile}
    if migs:
        labels["gpu.mig"] = {sanitize_value(m) for m in migs}
    fabrics = inv.fabrics()
    if fabrics:
        labels["fabric"] = set(fabrics)
    if inv.engines:
        labels["engine"] = {e.name for e in inv.engines}
    for e in inv.engines:
        if e.version.split():
            # "9439 (47f6423ed)": the build number; "0.11.2" as it is
            labels.setdefault(f"{e.name}.version", set()).add(sanitize_value(e.version.split()[0]))
    return {k: frozenset(v) for k, v in labels.items()}


def node_labels(inv: NodeInventory) -> dict[str, frozenset[str]]:
    """Discovered labels, then the agent config's: what is written wins."""
    labels = discovered_labels(inv)
    for key, value in inv.labels.items():
        labels[key] = frozenset({value})
    return labels


def unmatched(selector: Mapping[str, str], labels: Labels) -> tuple[str, str, bool] | None:
    """The first selector term (by key) a node fails: (key, value, negated); None if all hold."""
    for key in sorted(selector):
        wanted = selector[key]
        have = labels.get(key, frozenset())
        if wanted.startswith(NOT):
            if wanted[len(NOT) :] in have:
                return key, wanted[len(NOT) :], True
        elif wanted not in have:
            return key, wanted, False
    return None


def untolerated(taints: Sequence[str] | frozenset[str], tolerations: Sequence[str]) -> str | None:
    """The first of a node's taints a profile does not tolerate, or None."""
    return next((t for t in sorted(taints) if t not in tolerations), None)
