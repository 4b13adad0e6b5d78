"""What the routers share, held on ``app.state.services`` and handed out with Depends."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from fastapi import HTTPException, Request
from prometheus_client import CollectorRegistry

from service.controlplane.agents import AgentClient
from service.controlplane.db import Store
from service.controlplane.drills import DrillRunner
from service.controlplane.groups import GroupView
from service.controlplane.hub import Hub
from service.controlplane.models import GroupOut, HealOut, TransitionOut
from service.controlplane.settings import ControlPlaneSettings


@dataclass
class Services:
    settings: ControlPlaneSettings
    store: Store
    hub: Hub
    agents: AgentClient
    drills: DrillRunner
    lighthouse: httpx.AsyncClient
    metrics_registry: CollectorRegistry


def services(request: Request) -> Services:
    return request.app.state.services


def group_view(group: int, request: Request) -> GroupView:
    """The group from the path, or a 404 that lists the groups there are."""
    views = services(request).hub.views
    if group not in views:
        raise HTTPException(404, f"no replica group {group}; this job has groups 0..{len(views) - 1}")
    return views[group]


def group_out(view: GroupView, with_transitions: bool = False) -> GroupOut:
    t = view.transition
    return GroupOut(
        group=view.group, state=view.state, down_reason=t.reason if t and t.state == "down" else None,
        since=t.ts if t else None, step=view.step, loss=view.loss, participants=view.participants,
        quorum_id=view.quorum_id, step_s=view.step_s, last_event_ts=view.last_event_ts,
        last_heal=HealOut(**view.last_heal) if view.last_heal else None, pid=view.pid,
        restarts=max(0, view.starts - 1),
        transitions=[TransitionOut(state=h.state, reason=h.reason, ts=h.ts) for h in view.history]
        if with_transitions else None,
    )
