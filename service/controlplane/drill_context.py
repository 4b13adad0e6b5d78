"""What a running drill works with, handed to it by the runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from service.controlplane.agents import AgentClient
from service.controlplane.bus import EventBus
from service.controlplane.group_control import GroupControl
from service.controlplane.lighthouse import LighthouseClient
from service.controlplane.settings import ControlPlaneSettings


@dataclass(frozen=True)
class DrillContext:
    """``drill_id`` holds the groups while the drill runs (only it may command them); ``save()``
    persists its report as it is now, for a client polling the drill."""

    drill_id: int
    bus: EventBus
    control: GroupControl
    agents: AgentClient
    lighthouse: LighthouseClient
    settings: ControlPlaneSettings
    save: Callable[[], None]
