"""Agents register themselves here (``protocol/registration.py``); anyone may list them."""

from __future__ import annotations

from fastapi import APIRouter

from protocol import api
from protocol.registration import AgentList, AgentRegistration, RegisteredAgent
from service.controlplane.deps import AdmittedGroupDep, ServicesDep

router = APIRouter(tags=["agents"])
mutating = APIRouter(tags=["agents"])


@router.get(api.AGENTS, response_model=AgentList)
def list_agents(s: ServicesDep) -> AgentList:
    """Every registered agent, by group: its address and when it registered first and last."""
    return AgentList(agents=s.registry.listed())


@mutating.put(api.AGENT, response_model=RegisteredAgent, responses={403: {}, 409: {}, 422: {}, 503: {}})
def register_agent(group: AdmittedGroupDep, body: AgentRegistration, s: ServicesDep) -> RegisteredAgent:
    """An agent says where its API is, with its group's token (or the job's). An address the group
    does not have yet counts once the agent there answered the challenge (403 otherwise, the group
    keeping its agent). A group number not seen before adds the group to the job, up to
    ``--max-groups``."""
    return s.registry.register(group, body)
