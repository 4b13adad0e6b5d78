"""Request and response bodies of the control plane's REST API."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.agent import CommandResult
from protocol.events import ExitKind, SdcEvent, Verdict
from protocol.health import Served
from protocol.lighthouse import LighthouseStatus
from service.controlplane.groups import Shown
from service.controlplane.stragglers import GroupScore


class TransitionOut(BaseModel):
    state: str
    reason: str | None = None
    ts: float


class HealOut(BaseModel):
    ts: float
    step: int
    source_group: int
    bytes: int
    fetch_s: float
    load_s: float


class StragglerOut(BaseModel):
    """The straggler detector flagged this group (its ``flagged`` event)."""

    since: float
    slowdown: float | None = Field(description="its median compute over its peers' median")
    relative: float | None = Field(description="the fastest group's median compute over this group's")
    individual: float | None = Field(description="this group's best median compute over its current one")
    policy_action: Literal["flag", "evict"] | None
    detail: str


class SdcIncidentOut(BaseModel):
    """The gradient check's latest incident in this group (its ``sdc`` event)."""

    ts: float
    step: int
    verdict: Verdict
    action: Literal["skipped", "quarantined"]
    norm: float | None = Field(description="its gradient norm (null: not finite)")
    reference_norm: float | None = Field(description="the other groups' median")


class SyncOut(BaseModel):
    """The group's latest sync across groups (``--sync localsgd|diloco``: its ``sync`` event)."""

    ts: float
    step: int = Field(description="inner steps committed after it")
    outer_step: int = Field(description="syncs committed after it")
    committed: bool
    seconds: float = Field(description="waiting for the other groups, the quorum, a heal, the all-reduce, the outer step")
    bytes: int = Field(description="its rank 0's pseudo-gradient")
    drift: float | None = Field(description="norm of its pseudo-gradient; null at a join")
    participants: int


class GroupOut(BaseModel):
    group: int
    state: Shown
    down_reason: ExitKind | None = Field(None, description="killed, crashed, hung, lost, evicted, quarantined, stopped or finished, "
                                         "when down")
    down_detail: str | None = Field(None, description="when down, why, as its agent said: a crashed group's last error "
                                    "line, a hung group's watchdog verdict, …")
    since: float | None = Field(None, description="when the group entered its state")
    step: int | None = Field(None, description="last committed step its rank 0 reported")
    loss: float | None = Field(None, description="last committed loss of a step that trained samples (its rank 0's "
                               "mean token loss); null before any, or when it was not finite")
    diverged: bool = Field(False, description="the last such loss was not finite: the training diverged")
    participants: int | None = None
    quorum_id: int | None = None
    step_s: float | None = None
    last_event_ts: float | None = None
    last_heal: HealOut | None = None
    pid: int | None = None
    restarts: int = 0
    straggler: StragglerOut | None = Field(None, description="set while the detector flags the group")
    last_sdc: SdcIncidentOut | None = Field(None, description="the gradient check's latest incident in the group")
    last_sync: SyncOut | None = Field(None, description="its latest sync across groups (--sync localsgd|diloco)")
    transitions: list[TransitionOut] | None = Field(None, description="every transition (GET /groups/{g} only)")


SECRET = "null without the job's token"


class QuorumMemberOut(BaseModel):
    group: int | None
    replica_id: str | None = Field(description=f"torchft's name:uuid; {SECRET}")
    step: int
    manager_address: str | None = Field(description=f"{SECRET}")
    store_address: str | None = Field(description=f"{SECRET}")
    world_size: int
    recovering: bool
    state: str | None = Field(None, description="the group's state in the control plane")
    last_reported_step: int | None = None
    participants: int | None = None


class HeartbeatOut(BaseModel):
    replica_id: str | None = Field(description=f"torchft's name:uuid; {SECRET}")
    group: int | None
    age_s: float
    stale: bool


class QuorumOut(BaseModel):
    lighthouse_reachable: bool
    lighthouse_error: str | None = None
    quorum_id: int | None = None
    next_quorum_status: str | None = None
    heartbeating: int | None = None
    members: list[QuorumMemberOut] = []
    heartbeats: list[HeartbeatOut] = []
    groups: list[GroupOut] = Field(description="every group, members of the quorum or not")
    raw: LighthouseStatus | None = Field(None, description=f"the wrapper's whole answer; {SECRET}")


class EventOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: int
    ts: float
    group: int
    type: str
    rank: int | None = None


class EventPage(BaseModel):
    events: list[EventOut]
    next_after_id: int | None = Field(description="pass as after_id for the next page; null at the end")


class CommandOut(BaseModel):
    group: int
    action: Literal["kill", "rejoin", "evict", "drain"]
    group_state: GroupOut
    agent: CommandResult
    replaced_by_spare: bool | None = Field(None, description="evict: the group's warm spare was promoted at once")


class SdcOut(BaseModel):
    """The gradient check's incidents: each an abnormal gradient norm, the step skipped in every
    group, and the reruns' verdict."""

    counts: dict[Verdict, int] = Field(description="incidents by verdict, since the job began")
    incidents: list[SdcEvent] = Field(description="the newest incidents, oldest first")


class StragglersOut(BaseModel):
    pattern: Literal["none", "persistent", "rotating"] = Field(
        description="persistent: the same group is slow step after step; rotating: the slow group changes")
    flagged: int | None = Field(description="the group flagged as a persistent straggler")
    slowdown: float | None = Field(description="how much it slows every group")
    policy: Literal["flag", "evict"]
    factor: float
    window: int
    groups: list[GroupScore] = Field(description="every training group with a full window")


class Health(Served):
    checks: dict[str, str] = {}
