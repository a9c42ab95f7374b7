"""The controller's view of the bucket: the latest value of every key, kept by one watch.

Rebuilt from scratch at every start (the controller remembers nothing across restarts).
Values are decoded by the one decoder layer (llmgw/fleetstate/decode.py), which keeps the
last good value of every family an operator or a controller writes. A catalog entry or a
desired count that does not read freezes its model (`frozen`) instead of reading as a model
that was removed or a count of 0 (either would drain its replicas).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from llmgw.bus import keys
from llmgw.bus.records import Freezing
from llmgw.fleetstate.decode import FleetRecords

log = logging.getLogger(__name__)


class View(FleetRecords):
    @property
    def invalid(self) -> dict[str, str]:
        """key -> why its newest value does not read"""
        return {key: u.why for key, u in self.unreadable.items()}

    def invalid_catalog(self) -> dict[str, str]:
        return {model: u.why for model, u in self.unreadable_of(keys.CATALOG).items()}

    def frozen(self) -> dict[str, Freeze]:
        """Models whose replicas stay exactly as they are (nothing placed, nothing removed)
        because their catalog entry cannot be trusted to say what is wanted."""
        out = {
            model: Freeze("invalid-catalog", why) for model, why in self.invalid_catalog().items()
        }
        # a count that does not decode or is out of range (a typo, "1" quoted, 10^9) is
        # never read as 0: that would drain the model
        for model, u in self.unreadable_of(keys.DESIRED).items():
            out.setdefault(model, Freeze("invalid-desired", u.why))
        models_placed = {r.model for r in self.replicas.values()}
        for model, desired in self.desired.items():
            # one `nats kv del` must not drain a model someone still asks replicas of
            if (
                desired.replicas > 0
                and model not in self.catalog
                and model not in out
                and model in models_placed
            ):
                out[model] = Freeze("catalog-deleted", "")
        return out


@dataclass(frozen=True, slots=True)
class Freeze:
    """Why a model is frozen: `blocked` is its PlacementRecord.blocked key (one of
    records.FREEZING), `detail` what is wrong."""

    blocked: Freezing
    detail: str
