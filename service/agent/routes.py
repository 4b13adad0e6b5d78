"""The agent's HTTP API (``protocol/agent.py``): status for anyone, commands with the token."""

from __future__ import annotations

from typing import Annotated, Callable

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from protocol.agent import (CUT_PATH, HEALTH_PATH, PROBE_PATH, STATUS_PATH, AgentAction, AgentStatus, CommandResult,
                            CutRequest, CutState, DrainRequest, KillRequest, ProbeRequest, ProbeResult, command_path)
from protocol.health import Served
from protocol.injection import INJECT_PATH, InjectRequest, InjectResult
from protocol.registration import CHALLENGE_PATH, NONCE_PATTERN, ChallengeAnswer
from service.agent.agent import Agent
from service.agent.probe import probe as probe_peers
from service.agent.supervisor import Outcome, StateConflict


def _agent(request: Request) -> Agent:
    return request.app.state.agent


AgentDep = Annotated[Agent, Depends(_agent)]
router = APIRouter()
commands = APIRouter()


@router.get(STATUS_PATH, response_model=AgentStatus)
def get_status(agent: AgentDep) -> AgentStatus:
    return agent.status()


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)


@router.get(CHALLENGE_PATH, response_model=ChallengeAnswer)
def challenge(agent: AgentDep, nonce: Annotated[str, Query(pattern=NONCE_PATTERN)]) -> ChallengeAnswer:
    """Prove to the control plane that the agent at this address holds its group's token, without
    sending it: an HMAC of the nonce and of this agent's own address (``protocol/registration.py``)."""
    settings = agent.settings
    return ChallengeAnswer.of(settings.token, settings.group, settings.api_url(), nonce)


@router.get(HEALTH_PATH, response_model=Served)
def healthz() -> Served:
    """Liveness: the agent answers."""
    return Served(ok=True)


async def _run(agent: Agent, action: AgentAction, fn: Callable[[], Outcome]) -> CommandResult:
    outcome = await run_in_threadpool(fn)
    return CommandResult(group=agent.settings.group, action=action, pids=outcome.pids, event=outcome.event,
                         status=agent.status())


@commands.post(command_path("start"), response_model=CommandResult, responses={409: {}})
async def start(agent: AgentDep) -> CommandResult:
    """Start the group's torchrun (409 if it runs)."""
    return await _run(agent, "start", agent.supervisor.start)


@commands.post(command_path("rejoin"), response_model=CommandResult)
async def rejoin(agent: AgentDep) -> CommandResult:
    """Start a group that is down again; it heals from a live peer. A group that runs already
    (its agent restarted it by itself) stays as it is: ``already_running``."""
    try:
        return await _run(agent, "rejoin", agent.supervisor.start)
    except StateConflict:
        return CommandResult(group=agent.settings.group, action="rejoin", pids=agent.supervisor.pids(),
                             already_running=True, status=agent.status())


@commands.post(command_path("kill"), response_model=CommandResult, responses={409: {}})
async def kill(agent: AgentDep, body: KillRequest | None = None) -> CommandResult:
    """SIGKILL the group's whole process tree (409 if it is down)."""
    fault = body is not None and body.fault
    return await _run(agent, "kill", lambda: agent.supervisor.kill(fault))


@commands.post(command_path("evict"), response_model=CommandResult, responses={409: {}})
async def evict(agent: AgentDep) -> CommandResult:
    """SIGKILL the group's whole tree as a persistent straggler (409 if it is down); it is not
    restarted by itself: a rejoin brings it back (its warm spare, if ready)."""
    return await _run(agent, "evict", agent.supervisor.evict)


@commands.post(command_path("drain"), response_model=CommandResult, responses={409: {}})
async def drain(agent: AgentDep, body: DrainRequest | None = None) -> CommandResult:
    """Take the group out on purpose: it finishes and commits its step, leaves, and stays down
    until a rejoin (409 if it is down)."""
    reason = body.reason if body is not None else None
    return await _run(agent, "drain", lambda: agent.supervisor.drain(reason))


@commands.post(INJECT_PATH, response_model=InjectResult, responses={409: {}})
def inject(body: InjectRequest, agent: AgentDep) -> InjectResult:
    """Inject a drill's fault into the running group (409 if no rank is up)."""
    return agent.inject(body)


@commands.post(PROBE_PATH, response_model=ProbeResult)
async def probe(body: ProbeRequest, agent: AgentDep) -> ProbeResult:
    """Which of the other groups' agents this host reaches: the control plane's question when the
    groups stall or a commit fails (a partition between groups)."""
    return await probe_peers(agent.settings.group, body)


@commands.post(CUT_PATH, response_model=CutState, responses={409: {}})
def cut(body: CutRequest, agent: AgentDep) -> CutState:
    """The partition drill: this host stops reaching ``hosts`` (blackhole routes) for ``seconds``,
    then reaches them again by itself (409, nothing applied, when it cannot: no CAP_NET_ADMIN, a
    host that is this one, a cut already in place)."""
    return agent.netcut.apply(body)


@commands.delete(CUT_PATH, response_model=CutState, responses={409: {}})
def mend(agent: AgentDep) -> CutState:
    """Remove the cut's routes now (the drill ended early); the cut as it ended."""
    state = agent.netcut.mend()
    if state is None:
        raise StateConflict(f"group {agent.settings.group}'s host has not been cut")
    return state
