"""The last step, explain: one model's PlacementRecord, its text rendered from its data."""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.bus.records import PlacementRecord
from llmgw.controller.placement import explain
from llmgw.controller.placement.explain import Blocked, Refusal


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
    ) -> PlacementRecord:
        rec = PlacementRecord(model=self.model, desired=self.desired, placed=placed)
        if placed < self.desired:
            rec.judged = judged
            rec.refused = [
                g for profile, by_node in refusals for g in explain.group(profile, by_node)
            ]
        return self._done(rec, decisions)

    def _done(self, rec: PlacementRecord, decisions: list[str]) -> PlacementRecord:
        rec.explanation = explain.render(rec)
        rec.decided_at = self.now
        rec.decisions = decisions
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
