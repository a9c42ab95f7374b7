"""Placement: which replicas of which model run where, as a pure function of a snapshot.

`plan(snapshot)` reads the whole desired and observed state and returns what to create,
what to remove and, per model, a record that explains it. No I/O, no clock: the
reconcile loop builds the Snapshot, calls plan, and writes the result; running it again
on the same snapshot gives the same plan.

Shaped like the Kubernetes scheduler, one idea per module:

- `snapshot`: the input;
- `nodes`: what each node has left (GPUs by UUID, ports, host RAM), and taking from it;
- `filters`: FILTERS, each returning None or a Refusal, decide whether a node can take
  a replica;
- `weights`, `scores`: the scores in `Rank` order the nodes that can;
- `pickers`: the best node, or nodes in one fabric, for the next replica of a profile;
- `ports`: a replica whose port another program took after placement gets another one;
- `steps`: each model's plan, its replicas as named sets through named stages: a frozen
  model kept as it is, lost and kept, current and outdated, live and given up (moved:
  `failures`), outdated replaced a batch at a time (`rollout`) or surplus removed, fill,
  drain by force, explain;
- `record`, `explain`: the PlacementRecord, its refusals as data and its text rendered
  from them: "0/6 nodes fit: 3 lost, 2 no vllm, 1 short of free GPUs (2 free, needs 4)";
- `qualifying`: which nodes fit a waiting model now.

Rules kept here (docs/placement.md says why for each):
- weights nearby is a preference, never a filter, for weights an engine fetches; a node
  that never looked for weights ranks exactly like one that looked and found nothing;
  weights no engine can fetch (a key that is no repo id, a path) are a requirement
  (`filters.weights_held`);
- a placed replica on a ready or unreachable node is never moved to chase a better
  score; replicas on lost nodes are replaced; surplus replicas go newest first; replicas
  the catalog no longer asks for as they run, or on a draining node, are replaced one
  batch at a time, a new one ready before an old one drains;
- resources held by replicas in the snapshot and by those placed earlier in the same
  plan are accounted for (GPUs by UUID, host RAM, ports), and so is what the agents see:
  memory other programs hold on a GPU, GPUs NVML reports faulty, ports other programs
  listen on.
"""

from llmgw.controller.placement.explain import GB, Blocked, Reason, Refusal, same_decision
from llmgw.controller.placement.filters import FILTERS, Filter, fit
from llmgw.controller.placement.nodes import (
    InventoryMemo,
    Need,
    NodeState,
    Unschedulable,
    fleet_nodes,
    mark_unschedulable,
)
from llmgw.controller.placement.ports import PortMove, move_taken_ports
from llmgw.controller.placement.qualifying import qualifying_nodes, qualifying_nodes_by_model
from llmgw.controller.placement.record import frozen_record
from llmgw.controller.placement.rollout import news as rollout_news
from llmgw.controller.placement.rollout import same_rollout
from llmgw.controller.placement.scores import Rank, rank
from llmgw.controller.placement.snapshot import (
    DEFAULT_PORTS,
    FAILURE_COOLDOWN_S,
    FAILURE_NODES,
    FailurePolicy,
    Frozen,
    Snapshot,
)
from llmgw.controller.placement.steps import (
    Plan,
    Removal,
    blocked_model,
    collector_paused,
    fill,
    plan,
    plan_model,
    remove_surplus,
    replace_lost,
)

__all__ = [
    "DEFAULT_PORTS",
    "FAILURE_COOLDOWN_S",
    "FAILURE_NODES",
    "FILTERS",
    "FailurePolicy",
    "Frozen",
    "GB",
    "Blocked",
    "Filter",
    "Need",
    "NodeState",
    "Plan",
    "PortMove",
    "Rank",
    "Reason",
    "Refusal",
    "Removal",
    "Snapshot",
    "Unschedulable",
    "blocked_model",
    "collector_paused",
    "fill",
    "InventoryMemo",
    "fleet_nodes",
    "fit",
    "frozen_record",
    "mark_unschedulable",
    "move_taken_ports",
    "plan",
    "plan_model",
    "qualifying_nodes",
    "qualifying_nodes_by_model",
    "rank",
    "remove_surplus",
    "replace_lost",
    "same_decision",
    "rollout_news",
    "same_rollout",
]
