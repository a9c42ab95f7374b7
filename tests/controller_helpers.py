"""The controller the end-to-end tests run beside their agents."""

from __future__ import annotations

import dataclasses

from llmgw.controller.loop import ControllerSettings


def quick_controller(ports: tuple[int, int], **changes: object) -> ControllerSettings:
    """Quick to react, slow to declare nodes lost (end-to-end tests are about engines, not
    liveness; `changes` say otherwise), placing engines on `ports` (the engine_ports fixture
    or port_helpers.free_port_run, never llmgw's default range)."""
    quick = ControllerSettings(
        unreachable_after=2, lost_after=30, leader_ttl=1, tick=0.05, resync=0.5, port_range=ports
    )
    return dataclasses.replace(quick, **changes)
