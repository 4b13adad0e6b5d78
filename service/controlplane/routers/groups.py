from __future__ import annotations

from fastapi import APIRouter

from protocol import api
from protocol.agent import AgentStatus, DrainRequest
from service.controlplane.deps import GroupDep, ServicesDep
from service.controlplane.presenters import group_out
from service.controlplane.models import CommandOut, GroupOut

router = APIRouter(tags=["groups"])
mutating = APIRouter(tags=["groups"])


@router.get(api.GROUPS, response_model=list[GroupOut])
async def list_groups(s: ServicesDep) -> list[GroupOut]:
    """Every replica group's state, step, loss and last heal. On the event loop: a few
    milliseconds at 1,000 groups, less than a worker thread's handoff costs under load."""
    return [group_out(v) for v in s.board.views.values()]


@router.get(api.GROUP, response_model=GroupOut, responses={404: {}})
def get_group(view: GroupDep) -> GroupOut:
    """One group, with the time of every state transition."""
    return group_out(view, with_transitions=True)


@router.get(api.GROUP_AGENT, response_model=AgentStatus, responses={404: {}, 502: {}, 503: {}})
async def get_agent(view: GroupDep, s: ServicesDep) -> AgentStatus:
    """The group's agent as it sees itself: pids, starts, warm spare, events buffered and dropped."""
    return await s.agents.status(view.group)


@mutating.post(api.GROUP_KILL, response_model=CommandOut, responses={404: {}, 409: {}, 502: {}, 503: {}})
async def kill_group(view: GroupDep, s: ServicesDep) -> CommandOut:
    """SIGKILL the group's whole process tree, as if its node died. The others train on."""
    agent = await s.control.kill(view.group)
    return CommandOut(group=view.group, action="kill", group_state=group_out(view), agent=agent)


@mutating.post(api.GROUP_EVICT, response_model=CommandOut, responses={404: {}, 409: {}, 502: {}, 503: {}})
async def evict_group(view: GroupDep, s: ServicesDep) -> CommandOut:
    """End the group for good, as the straggler policy does: down (evicted), never restarted by
    its agent; a warm spare, when its agent has one ready, takes its place at once."""
    eviction = await s.control.evict(view.group)
    return CommandOut(group=view.group, action="evict", group_state=group_out(view), agent=eviction.agent,
                      replaced_by_spare=eviction.replaced_by_spare)


@mutating.post(api.GROUP_DRAIN, response_model=CommandOut, responses={404: {}, 409: {}, 502: {}, 503: {}})
async def drain_group(view: GroupDep, s: ServicesDep, body: DrainRequest | None = None) -> CommandOut:
    """Take the group out for maintenance: it finishes and commits the step in flight, leaves the
    quorum, and stays down (drained) until a rejoin; its agent does not bring it back by itself."""
    agent = await s.control.drain(view.group, body.reason if body is not None else None)
    return CommandOut(group=view.group, action="drain", group_state=group_out(view), agent=agent)


@mutating.post(api.GROUP_REJOIN, response_model=CommandOut, responses={404: {}, 409: {}, 502: {}, 503: {}})
async def rejoin_group(view: GroupDep, s: ServicesDep) -> CommandOut:
    """Start a group that is down again; it joins the quorum and heals from a live peer."""
    agent = await s.control.rejoin(view.group)
    return CommandOut(group=view.group, action="rejoin", group_state=group_out(view), agent=agent)
