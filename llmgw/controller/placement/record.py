"""The last step, explain: one model's PlacementRecord, its text rendered from its data."""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.bus.records import Failure, PlacementRecord
from llmgw.controller.placement import explain
from llmgw.controller.placement.explain import Blocked, Refusal

# A model's record is bounded by construction, whatever the model asks for: its lines per
# replica stop here (each replica's own key says where it went and why), and its text too.
# With the catalog's 64 profiles a model, its refusals are at most a line per profile and
# reason. 8,000 replicas made a 1.1 MB record, over the bucket's value limit: every pass
# then failed writing it.
MAX_DECISION_LINES = 50
MAX_EXPLANATION = 4_000


def bounded_lines(lines: list[str]) -> list[str]:
    if len(lines) <= MAX_DECISION_LINES:
        return lines
    more = len(lines) - (MAX_DECISION_LINES - 1)
    return [
        *lines[: MAX_DECISION_LINES - 1],
        f"... and {more} more (each replica's own key, replicas.<model>.<rid>, says where it "
        "is and why)",
    ]


def bounded_text(text: str) -> str:
    if len(text) <= MAX_EXPLANATION:
        return text
    return text[: MAX_EXPLANATION - 40].rstrip() + " ... (cut: `refused` holds every reason)"


@dataclass(frozen=True, slots=True)
class ModelRecord:
    """Writes one model's record; `decisions` is the steps' list of lines, which may still
    grow ("not placed: <explanation>")."""

    model: str
    desired: int
    now: float

    def blocked(
        self, reason: Blocked, detail: str, placed: int, decisions: list[str]
    ) -> PlacementRecord:
        rec = PlacementRecord(
            model=self.model,
            desired=self.desired,
            placed=placed,
            blocked=reason,
            blocked_detail=detail,
        )
        return self._done(rec, decisions)

    def placed(
        self,
        placed: int,
        judged: int,
        refusals: list[tuple[str, dict[str, Refusal]]],
        decisions: list[str],
        *,
        waiting: int = 0,
        failures: list[Failure] | None = None,
        broken: list[str] | None = None,
        rollout: str = "",
        rollout_detail: str = "",
        rollout_tail: list[str] | None = None,
    ) -> PlacementRecord:
        rec = PlacementRecord(
            model=self.model,
            desired=self.desired,
            placed=placed,
            waiting=max(waiting, 0),
            failures=list(failures or []),
            broken=list(broken or []),
            rollout=rollout,
            rollout_detail=rollout_detail,
            rollout_tail=list(rollout_tail or []),
        )
        if placed < self.desired or rec.waiting:
            rec.judged = judged
            rec.refused = [
                g for profile, by_node in refusals for g in explain.group(profile, by_node)
            ]
        return self._done(rec, decisions)

    def _done(self, rec: PlacementRecord, decisions: list[str]) -> PlacementRecord:
        rec.explanation = bounded_text(explain.render(rec))
        rec.decided_at = self.now
        rec.decisions = bounded_lines(decisions)
        return rec


def frozen_record(
    model: str,
    blocked: Blocked,
    detail: str,
    desired: int,
    placed: int,
    now: float,
    decisions: list[str],
) -> PlacementRecord:
    """The record for a model the loop leaves exactly as it is, nothing placed and nothing
    removed: its catalog entry is invalid, or was deleted while replicas are desired."""
    return ModelRecord(model, desired, now).blocked(blocked, detail, placed, decisions)
