from __future__ import annotations

import time

from fastapi import APIRouter, Depends, HTTPException

from service.controlplane import group_control
from service.controlplane.deps import Services, group_out, group_view, services
from service.controlplane.groups import GroupView
from service.controlplane.models import CommandOut, GroupOut

router = APIRouter(prefix="/api/v1/groups", tags=["groups"])
mutating = APIRouter(prefix="/api/v1/groups", tags=["groups"])


@router.get("", response_model=list[GroupOut])
def list_groups(s: Services = Depends(services)) -> list[GroupOut]:
    """Every replica group's state, step, loss and last heal."""
    return [group_out(v) for v in s.hub.views.values()]


@router.get("/{group}", response_model=GroupOut)
def get_group(view: GroupView = Depends(group_view)) -> GroupOut:
    """One group, with the time of every state transition."""
    return group_out(view, with_transitions=True)


@router.get("/{group}/agent", responses={404: {}, 502: {}})
async def get_agent(view: GroupView = Depends(group_view), s: Services = Depends(services)) -> dict:
    """The group's agent as it sees itself: pids, starts, warm spare, events buffered and dropped."""
    return await s.agents.status(view.group)


@mutating.post("/{group}/kill", response_model=CommandOut, responses={404: {}, 409: {}, 502: {}})
async def kill_group(view: GroupView = Depends(group_view), s: Services = Depends(services)) -> CommandOut:
    """SIGKILL the group's whole process tree, as if its node died. The others train on."""
    if view.state == "down":
        raise HTTPException(409, f"group {view.group} is already down ({view.transition.reason}); rejoin it first")
    if s.drills.running:
        raise HTTPException(409, f"drill {s.drills.current_id} is running; it controls the groups until it ends")
    agent = await group_control.kill(s.agents, s.hub, view.group, time.time())
    return CommandOut(group=view.group, action="kill", group_state=group_out(view), agent=agent)


@mutating.post("/{group}/rejoin", response_model=CommandOut, responses={404: {}, 409: {}, 502: {}})
async def rejoin_group(view: GroupView = Depends(group_view), s: Services = Depends(services)) -> CommandOut:
    """Start a group that is down again; it joins the quorum and heals from a live peer."""
    if view.state != "down":
        raise HTTPException(409, f"group {view.group} is {view.state}, not down; only a down group can rejoin")
    if s.drills.running:
        raise HTTPException(409, f"drill {s.drills.current_id} is running; it controls the groups until it ends")
    agent = await group_control.rejoin(s.agents, s.hub, view.group, time.time())
    return CommandOut(group=view.group, action="rejoin", group_state=group_out(view), agent=agent)
