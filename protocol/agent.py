"""The agent's HTTP API (``python -m service.agent``), as the control plane calls it.

``GET`` :data:`STATUS_PATH` answers :class:`AgentStatus`; ``POST /{action}`` for each
:data:`AgentAction`, with the bearer token, answers :class:`CommandResult`, or 409 when the
action does not fit the group's state (kill, evict or drain of a group that is down, start of
one that runs). ``kill`` takes an optional :class:`KillRequest` (a person's kill, or a drill's
fault), ``drain`` an optional :class:`DrainRequest`. ``evict`` is a kill whose reason is
``evicted``: the agent does not restart it by itself. ``rejoin`` is the exception: it asks for
a running group, so when the group already runs (its agent restarted it by itself) it answers
with ``already_running`` set. ``POST``
:data:`PROBE_PATH` with a :class:`ProbeRequest` answers :class:`ProbeResult`: which other groups'
agents this agent's host reaches (``service/controlplane/partition.py``). ``POST``
:data:`CUT_PATH` with a :class:`CutRequest` cuts this agent's host off from other hosts for a
while (the partition drill; ``service/agent/netcut.py``) and answers :class:`CutState`, or 409
when it cannot; ``DELETE`` :data:`CUT_PATH` mends it at once.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, StringConstraints

from protocol.events import ExitKind, Flag, ProcessEvent

STATUS_PATH = "/status"
PROBE_PATH = "/probe"
CUT_PATH = "/cut"
HEALTH_PATH = "/healthz"
AgentAction = Literal["start", "rejoin", "kill", "evict", "drain"]
SpareState = Literal["starting", "ready"]


def command_path(action: AgentAction) -> str:
    return f"/{action}"


class LastExit(BaseModel):
    kind: ExitKind
    returncode: int | None
    ts: float


class CutState(BaseModel):
    """A cut of this agent's host: blackhole routes to ``addresses`` from ``at`` until mended."""

    addresses: list[str] = Field(description="the addresses this host no longer reaches")
    at: float = Field(description="when the routes were added (Unix time)")
    until: float = Field(description="when the agent removes them by itself")
    mended_at: float | None = Field(None, description="when they were removed; null while the cut lasts")


class AgentStatus(BaseModel):
    group: int
    state: Literal["running", "down"]
    pid: int | None = Field(description="the group's torchrun, while it runs")
    pids: list[int] = Field(description="torchrun and every rank")
    starts: int
    restarts: int
    last_step: int | None = Field(description="the last committed step rank 0 wrote")
    last_exit: LastExit | None
    restart_at: float | None = Field(None, description="when the agent starts the group again by itself: a restart "
                                     "it planned after the group went down (a backoff, a crash-loop hold)")
    events_buffered: int
    events_dropped: int = Field(description="events dropped so far: the buffer was full")
    events_refused: int = Field(0, description="events the control plane refused (a 4xx), dropped and counted")
    events_invalid: int = Field(0, description="lines in the event files that are no event, skipped")
    events_forwarded: int
    control_plane_reachable: bool
    spare: SpareState | None = Field(None, description="the warm spare, when the agent keeps one")
    cut: CutState | None = Field(None, description="the partition drill's last cut of this host, if any")


class KillRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fault: Flag = Field(False, description="a drill's stand-in for a node loss: the group comes back by "
                        "itself as after a crash (when its agent restarts groups), and the kill is not counted "
                        "against it; otherwise a person's kill, and the group stays down until a rejoin")


DrainReason = Annotated[str, StringConstraints(min_length=1, max_length=200)]
"""Why a group is taken out (firmware, a dataset switch …): its drained event's detail."""


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: DrainReason | None = Field(None, description="why the group is taken out: the drained event's detail")


class CommandResult(BaseModel):
    group: int
    action: AgentAction
    pids: list[int] = Field([], description="the processes the action signalled or started")
    already_running: bool = Field(
        False, description="rejoin only: the group was running already (its agent had restarted it)")
    event: ProcessEvent | None = Field(
        None, description="the process event the command caused (killed, evicted, started, stopped), as the agent's "
        "forwarder also sends it: same eid")
    status: AgentStatus


class ProbeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    peers: dict[int, AnyHttpUrl] = Field(max_length=100_000, description="group → its agent's API: reached when a TCP "
                                         "connection to its host and port opens (or is refused: the host answered)")
    timeout_s: float = Field(1.0, gt=0, le=30, description="a peer that has not answered within this is not reached")


class ProbeResult(BaseModel):
    group: int = Field(description="the group whose agent probed")
    reached: dict[int, bool] = Field(description="peer group → whether this group's host reached it")


Host = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:_-]+$")]


class CutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    hosts: list[Host] = Field(max_length=100_000, description="hosts (names or addresses) this group's host must stop "
                              "reaching: each gets a blackhole route")
    job_services: Flag = Field(False, description="the Lighthouse's and the control plane's hosts too, as this agent "
                               "reaches them: the host cut off from the whole job (an isolated node)")
    seconds: float = Field(gt=0, le=3600, description="the agent removes the routes by itself after this")
