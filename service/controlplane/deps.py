"""What the routers share, held on ``app.state.services`` and handed out with ``Annotated`` dependencies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Path, Request
from starlette.requests import HTTPConnection
from prometheus_client import CollectorRegistry

from protocol.events import JSON_INT_MAX
from protocol.tokens import bearer, token_accepted
from service.controlplane.agents import AgentClient
from service.controlplane.bus import EventBus
from service.controlplane.coverage import CoverageLedger
from service.controlplane.db import Store
from service.controlplane.drills.runner import DrillRunner
from service.controlplane.errors import TooManyGroups, UnknownGroup
from service.controlplane.group_control import GroupControl
from service.controlplane.groups import GroupBoard, GroupView
from service.controlplane.ingest import Ingestor, IngestWriter
from service.controlplane.lighthouse import LighthouseClient
from service.controlplane.registry import AgentRegistry
from service.controlplane.settings import ControlPlaneSettings
from service.controlplane.metrics import StateCollector
from service.controlplane.stragglers import StragglerTracker


@dataclass
class Services:
    settings: ControlPlaneSettings
    store: Store
    board: GroupBoard
    bus: EventBus
    ingest: Ingestor
    writer: IngestWriter
    agents: AgentClient
    registry: AgentRegistry
    control: GroupControl
    drills: DrillRunner
    lighthouse: LighthouseClient
    stragglers: StragglerTracker
    coverage: CoverageLedger
    metrics_registry: CollectorRegistry
    metrics_state: StateCollector


def _services(connection: HTTPConnection) -> Services:
    """A request's or a WebSocket's."""
    return connection.app.state.services


ServicesDep = Annotated[Services, Depends(_services)]


def find_group(s: Services, group: int) -> GroupView:
    """The group's view, or an UnknownGroup (404) that lists the groups there are."""
    views = s.board.views
    if group not in views:
        raise UnknownGroup(f"no replica group {group}; this job has groups {_ranges(sorted(views))}")
    return views[group]


def _ranges(groups: list[int]) -> str:
    """``0..3, 7`` for groups 0, 1, 2, 3 and 7; ``none`` for no group."""
    if not groups:
        return "none (no agent has registered)"
    runs, start = [], groups[0]
    for prev, g in zip(groups, groups[1:] + [None]):
        if g != prev + 1:
            runs.append(str(start) if start == prev else f"{start}..{prev}")
            start = g
    return ", ".join(runs)


def _group_from_path(group: int, s: ServicesDep) -> GroupView:
    return find_group(s, group)


GroupDep = Annotated[GroupView, Depends(_group_from_path)]


GroupPath = Annotated[int, Path(ge=0, le=JSON_INT_MAX)]


def admissible(s: Services, group: int) -> int:
    """The group number, when it may join the job: below ``--max-groups`` (a TooManyGroups otherwise)."""
    if group >= s.settings.max_groups:
        raise TooManyGroups(f"group {group} is beyond this control plane's --max-groups {s.settings.max_groups}; "
                            "raise it to run more groups")
    return group


def _admitted_group(group: GroupPath, s: ServicesDep) -> int:
    return admissible(s, group)


AdmittedGroupDep = Annotated[int, Depends(_admitted_group)]
"""A group number from the path that may join the job: below ``--max-groups`` (409 otherwise)."""


def _authorized(request: Request, s: ServicesDep) -> bool:
    return token_accepted(bearer(request.headers.get("authorization")), [s.settings.token])


AuthorizedDep = Annotated[bool, Depends(_authorized)]
"""Whether a read carries the job's token: only then does it see what torchft's own unauthenticated
kill paths need (full replica ids, Manager and store addresses)."""
