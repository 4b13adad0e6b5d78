"""What drills work with: the control plane's services, and a running drill's own handle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from service.controlplane.agents import AgentClient
from service.controlplane.bus import EventBus
from service.controlplane.group_control import GroupControl
from service.controlplane.lighthouse import LighthouseClient
from service.controlplane.settings import ControlPlaneSettings
from service.controlplane.stragglers import StragglerTracker


@dataclass(frozen=True)
class DrillServices:
    """What a drill's preconditions read and its run commands."""

    settings: ControlPlaneSettings
    bus: EventBus
    control: GroupControl
    agents: AgentClient
    lighthouse: LighthouseClient
    stragglers: StragglerTracker


@dataclass(frozen=True)
class DrillContext(DrillServices):
    """``drill_id`` holds the groups while the drill runs (only it may command them); ``save()``
    persists its report as it is now, for a client polling the drill."""

    drill_id: int
    save: Callable[[], None]
