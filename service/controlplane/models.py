"""Request and response bodies of the control plane's REST API."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from protocol.agent import CommandResult
from protocol.events import ExitKind, SdcEvent, Verdict
from protocol.health import Served
from protocol.injection import HangKind
from protocol.lighthouse import MAX_HOLD_S, LighthouseStatus


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


class GroupOut(BaseModel):
    group: int
    state: Literal["unknown", "starting", "joining", "healing", "training", "down"]
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
    action: Literal["kill", "rejoin", "evict"]
    group_state: GroupOut
    agent: CommandResult
    replaced_by_spare: bool | None = Field(None, description="evict: the group's warm spare was promoted at once")


MAX_ID = 1_000_000
"""No group or rank number beyond this exists (a job has at most thousands of groups)."""


class DrillBody(BaseModel):
    """Every drill's request: no unknown field, no number that is not finite."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class KillHealIn(DrillBody):
    """Kill one group, wait for the survivors, rejoin it, wait for its heal, compare fingerprints."""

    kind: Literal["kill-heal"]
    group: int = Field(ge=0, le=MAX_ID)
    timeout_s: float | None = Field(None, gt=0, le=3600, description="per phase; default from settings")


class HangIn(DrillBody):
    """Hang one group (its ranks stopped, or one stuck inside its step); the watchdog must end it."""

    kind: Literal["hang"]
    group: int = Field(ge=0, le=MAX_ID)
    rank: int | None = Field(None, ge=0, le=MAX_ID, description="only this rank of the group (default: every rank)")
    mode: HangKind = Field("stop", description="stop: SIGSTOP the ranks; stuck: the rank sleeps inside its step")
    timeout_s: float | None = Field(None, gt=0, le=3600, description="per phase; default from settings")


class LighthouseIn(DrillBody):
    """SIGKILL torchft's Lighthouse (its wrapper restarts it); every group must pause, not restart."""

    kind: Literal["lighthouse"]
    down_s: float = Field(0.0, ge=0, le=MAX_HOLD_S, description="keep it down this long (default: the wrapper's "
                          "restart delay); past the trainers' --quorum-timeout-s the groups stop and are restarted")
    timeout_s: float | None = Field(None, gt=0, le=3600, description="per phase; default from settings")


class ChaosIn(DrillBody):
    """Kill random groups at exponentially distributed intervals; measure goodput."""

    kind: Literal["chaos"]
    mtbf_s: float = Field(gt=0, le=86_400, description="mean seconds between kills")
    duration_s: float = Field(gt=0, le=86_400, description="length of the chaos window")
    seed: int = Field(0, ge=0, le=2**63 - 1)
    rejoin_delay_s: float = Field(5.0, ge=0, le=3600, description="a killed group is rejoined after this")
    baseline_s: float = Field(20.0, gt=0, le=3600, description="failure-free measurement before the chaos")


class StragglerIn(DrillBody):
    """Slow one group down at run time (a sleep before every forward); the detector must name it."""

    kind: Literal["straggler"]
    group: int = Field(ge=0, le=MAX_ID)
    delay_ms: float = Field(30.0, gt=0, le=60_000, description="the sleep before every forward")
    duration_s: float = Field(30.0, gt=0, le=3600, description="how long the group stays slow")
    baseline_s: float = Field(10.0, gt=0, le=3600, description="throughput measured before")
    after_s: float = Field(10.0, gt=0, le=3600, description="throughput measured after")
    policy: Literal["flag", "evict"] | None = Field(None, description="the straggler policy while the drill runs "
                                                     "(default: the job's --straggler-policy)")


class CorruptIn(DrillBody):
    """Corrupt one gradient element on one rank of a group, once or every step; the gradient
    check must skip the step everywhere and attribute it (with the check off: see it applied)."""

    kind: Literal["corrupt"]
    group: int = Field(ge=0, le=MAX_ID)
    scale: float = Field(1e4, ge=-1e30, le=1e30, description="the factor the element is multiplied by")
    persistent: bool = Field(False, description="every step, as a bad chip would (default: once)")
    rank: int = Field(0, ge=0, le=MAX_ID, description="the rank whose gradient is corrupted")
    baseline_s: float = Field(5.0, gt=0, le=3600, description="normal steps watched before")
    after_steps: int = Field(5, ge=1, le=1000, description="steps watched after the corrupted one")
    timeout_s: float | None = Field(None, gt=0, le=3600, description="per phase; default from settings")


class PartitionIn(DrillBody):
    """Cut two groups' hosts apart (``cut``; both still reach the rest), or one group's host off
    from the whole job (``isolate``), for ``duration_s``; the agents make the cut (blackhole
    routes) and undo it. Needs each group on a host of its own, and agents with CAP_NET_ADMIN."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["cut"]}, {"required": ["isolate"]}]})

    kind: Literal["partition"]
    cut: Annotated[list[Annotated[int, Field(ge=0, le=MAX_ID)]] | None, WithJsonSchema(
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_ID}, "minItems": 2,
         "maxItems": 2, "uniqueItems": True})] = Field(
        None, min_length=2, max_length=2, description="two groups whose hosts stop reaching each other")
    isolate: Annotated[int | None, WithJsonSchema({"type": "integer", "minimum": 0, "maximum": MAX_ID})] = Field(
        None, ge=0, le=MAX_ID, description="the group whose host stops reaching the Lighthouse, the control plane "
        "and every other group")
    duration_s: float = Field(20.0, gt=0, le=3600, description="how long the cut lasts; the agents undo it")
    timeout_s: float | None = Field(None, gt=0, le=3600, description="per phase; default from settings")

    @property
    def groups(self) -> list[int]:
        """The groups named: the cut pair, or the isolated group."""
        return self.cut if self.cut is not None else [self.isolate]

    @model_validator(mode="after")
    def _one_fault(self) -> "PartitionIn":
        if (self.cut is None) == (self.isolate is None):
            raise ValueError("name either cut (two groups) or isolate (one group)")
        if self.cut is not None and self.cut[0] == self.cut[1]:
            raise ValueError(f"cut needs two different groups, not {self.cut[0]} twice")
        return self


DrillIn = Annotated[Union[KillHealIn, HangIn, LighthouseIn, ChaosIn, StragglerIn, CorruptIn, PartitionIn],
                    Field(discriminator="kind")]


class ChaosKill(BaseModel):
    group: int
    killed_at: float
    rejoined_at: float | None = None
    detected_at: float | None = None
    started_at: float | None = Field(None, description="the group's ranks were up again (its start event)")
    healed_commit_at: float | None = None
    survivor_steps_lost: int = 0
    detect_s: float | None = None
    restart_s: float | None = None
    heal_s: float | None = None


class ChaosReport(BaseModel):
    mtbf_s: float
    duration_s: float
    seed: int
    rejoin_delay_s: float
    baseline_s: float
    phase: str = "starting"
    baseline_rate: float | None = Field(None, description="samples trained by committed steps per second, "
                                        "failure-free (× the sequence length: tokens)")
    chaos_rate: float | None = Field(None, description="samples trained by committed steps per second under chaos")
    goodput: float | None = Field(None, description="chaos_rate / baseline_rate")
    median_step_s: float | None = None
    baseline_step_s: float | None = Field(None, description="median step time, failure-free")
    chaos_step_s: float | None = Field(
        None, description="median step time under chaos: above baseline_step_s when restarts and spare rebuilds "
        "share the CPU (or network) with training, a loss none of lost_s's terms holds")
    kills: list[ChaosKill] = []
    lost_s: dict[str, float] = Field(default_factory=dict, description="time lost per term, summed over kills")


class KillHealReport(BaseModel):
    """What a kill-heal drill measured. Times are Unix seconds; *_s are durations."""

    group: int
    survivors: list[int] = []
    participants_before: int | None = None
    killed_at: float | None = None
    quorum_shrunk_at: float | None = Field(None, description="a survivor's quorum dropped the killed group")
    survivors_first_commit_at: float | None = Field(
        None, description="a survivor's first commit in a quorum without the killed group (shrunk, or with its spare)")
    survivors_steps_lost: int | None = Field(None, description="survivor steps not committed between kill and resume")
    rejoined_at: float | None = None
    rejoined_by: Literal["drill", "agent", "control-plane", "network"] | None = Field(
        None, description="agent: the group's agent restarted it by itself (--auto-rejoin-delay) before the drill "
        "asked; control-plane: a partition drill's evicted group, rejoined once it reached everyone; network: a "
        "partition drill's isolated group, whose ranks waited through the cut")
    heal_started_at: float | None = Field(None, description="the group's heal event: state fetched and loaded")
    healed_commit_at: float | None = Field(None, description="the rejoined group's first committed step after its heal")
    healed_step: int | None = None
    heal_bytes: int | None = None
    heal_fetch_s: float | None = None
    detect_s: float | None = Field(None, description="kill → survivors' quorum shrank (T_d)")
    survivors_resume_s: float | None = Field(None, description="kill → survivors' first commit without the group")
    rejoin_to_healed_commit_s: float | None = None
    kill_to_full_s: float | None = Field(None, description="kill → the group's healed commit: all groups training again")
    fingerprint_step: int | None = None
    fingerprints: dict[str, dict[str, str]] | None = Field(None, description="group → rank → digest at fingerprint_step")
    fingerprints_equal: bool | None = None
    phase: str = "starting"


class HangReport(KillHealReport):
    """A kill-heal drill whose fault is a hang: nothing dies until the watchdog ends the group."""

    mode: HangKind = "stop"
    rank: int | None = None
    ended_at: float | None = Field(None, description="the group's processes ended (the watchdog's kill)")
    detected_by: Literal["watchdog", "agent"] | None = Field(
        None, description="watchdog: the agent's hang watchdog ended the group; agent: its processes exited")
    detected_group: int | None = Field(None, description="the group the watchdog ended")
    verdict: str | None = Field(None, description="the watchdog's reason")
    fault_to_end_s: float | None = Field(None, description="the hang began → the group was ended")


class PartitionReport(KillHealReport):
    """What a partition drill measured. ``group`` is the group the others lose: the isolated one,
    or the one of the cut pair the rule evicts (predicted from the rule, checked against what the
    control plane did); ``killed_at`` is the cut. Times are Unix seconds; *_s are durations."""

    cut: list[int] | None = None
    isolate: int | None = None
    duration_s: float
    addresses: dict[str, str] = Field(default_factory=dict, description="group → its host's address, as cut")
    mended_at: float | None = Field(None, description="the agents removed the cut's routes")
    verdict_at: float | None = Field(None, description="cut: the control plane evicted a group for the partition")
    cut_to_verdict_s: float | None = Field(None, description="cut → the control plane's eviction")
    evicted: list[int] = Field(default_factory=list, description="the groups the control plane evicted for it")
    kept: list[int] = Field(default_factory=list, description="the largest set of groups that all reach each other")
    rule: str | None = Field(None, description="the control plane's reason, as its partition event says it")
    mend_to_healed_commit_s: float | None = Field(None, description="mended → the group's healed commit")


class LighthousePause(BaseModel):
    """One group through the Lighthouse's absence, from its rank 0's committed steps."""

    last_commit_at: float | None = Field(None, description="its last commit before the Lighthouse answered again")
    resumed_at: float | None = Field(None, description="its first commit after the Lighthouse answered again")
    pause_s: float | None = Field(None, description="resumed_at − last_commit_at: the group's gap in commits")
    resume_after_back_s: float | None = Field(None, description="the Lighthouse answered → this group committed")
    steps_lost: int = Field(0, description="steps that failed their commit between the kill and resumed_at")


class LighthouseReport(BaseModel):
    """What a Lighthouse drill measured. Times are Unix seconds; *_s are durations."""

    down_s: float
    groups: list[int] = []
    phase: str = "starting"
    lighthouse_pid: int | None = Field(None, description="the Lighthouse process the drill SIGKILLed")
    killed_at: float | None = None
    detected_at: float | None = Field(None, description="the control plane's first failed health check after it")
    detected_by: Literal["health-check"] | None = None
    detect_s: float | None = Field(None, description="killed_at → detected_at")
    back_at: float | None = Field(None, description="the wrapper's restarted Lighthouse answered its health check")
    away_s: float | None = Field(None, description="killed_at → back_at")
    pauses: dict[str, LighthousePause] = Field(default_factory=dict, description="group → its pause")
    max_pause_s: float | None = None
    max_resume_after_back_s: float | None = Field(None, description="Lighthouse back → the last group committed")
    steps_lost: int | None = Field(None, description="failed commits, all groups")
    process_exits: list[str] = Field(default_factory=list, description="group processes that ended meanwhile: "
                                     "none is the goal")
    fingerprint_step: int | None = None
    fingerprints: dict[str, dict[str, str]] | None = None
    fingerprints_equal: bool | None = None


class StragglerReport(BaseModel):
    """What a straggler drill measured. Times are Unix seconds; *_s are durations; throughput in
    samples trained by committed steps per second."""

    group: int
    delay_ms: float
    duration_s: float
    baseline_s: float
    after_s: float
    policy: Literal["flag", "evict"]
    phase: str = "starting"
    injected_at: float | None = None
    flagged_before: int | None = Field(None, description="the group the detector flagged already when the delay began")
    detected_group: int | None = Field(None, description="the first group the detector flagged after the injection")
    detected_at: float | None = None
    detect_s: float | None = Field(None, description="injection → flagged")
    relative: float | None = None
    individual: float | None = None
    slowdown: float | None = None
    slowest_share: float | None = None
    keep_cost: float | None = Field(None, description="share of the throughput keeping it costs: 1 - 1/slowdown")
    evict_cost: float | None = Field(None, description="share of the throughput evicting it costs: 1/groups")
    action: Literal["none", "flagged", "evicted"] | None = Field(
        None, description="none: never flagged; flagged: flagged and kept; evicted: the policy ended it")
    detail: str | None = Field(None, description="the detector's reason, and which side of the eviction line")
    others_flagged: list[int] = Field(default_factory=list, description="other groups flagged meanwhile: none is "
                                      "the goal")
    evicted_at: float | None = None
    ended: str | None = Field(None, description="the group went down otherwise meanwhile (hung: the delay was over "
                              "its hang watchdog's step bound), with the reason")
    cleared_at: float | None = Field(None, description="the detector cleared the group")
    throughput: dict[str, float | None] = Field(default_factory=dict, description="before, during, after")
    median_step_s: dict[str, float | None] = Field(default_factory=dict, description="before, during, after")


class CorruptStep(BaseModel):
    """One group's step around the corruption. The group's norms are the root of its ranks' squares."""

    step: int = Field(description="the step whose batch was trained")
    group: int
    loss: float | None = Field(None, description="null on a step that trained no batch of the job's state (healing, "
                               "not participating)")
    skipped: bool = False
    grad_norm: float | None = Field(None, description="the group's own gradient norm before crossing (the check)")
    applied_grad_norm: float | None = Field(None, description="norm of the averaged gradient the optimizer took")
    update_norm: float | None = Field(None, description="norm of the parameter update applied")


class CorruptReport(BaseModel):
    """What a corruption drill measured. Times are Unix seconds; *_s are durations."""

    group: int
    scale: float
    persistent: bool
    rank: int
    baseline_s: float
    after_steps: int
    phase: str = "starting"
    sdc_check: bool | None = Field(None, description="whether the job runs with the gradient check (seen in its steps)")
    injected_at: float | None = None
    step: int | None = Field(None, description="the corrupted step (with the check off: where the applied gradient "
                             "norm peaked)")
    detected_group: int | None = Field(None, description="the group the check flagged")
    detect_s: float | None = Field(None, description="injection → the check's verdict reached the control plane")
    norms: dict[str, float | None] = Field(default_factory=dict, description="group → its norm at the step")
    reference_norm: float | None = None
    rerun_norm: float | None = None
    checker_group: int | None = None
    checker_norm: float | None = None
    verdict: Verdict | None = None
    action: Literal["skipped", "quarantined", "applied"] | None = Field(
        None, description="skipped: every group skipped the step; quarantined: the group left, its spare took its "
        "place; applied: no check, the corrupted gradient reached every group's optimizer")
    quarantined_at: float | None = None
    replaced_at: float | None = Field(None, description="the replacement's healed commit")
    replace_s: float | None = Field(None, description="quarantine → the replacement's healed commit")
    update_ratio: dict[str, float | None] = Field(
        default_factory=dict, description="group → its largest update norm from the step on, over its median before")
    applied_grad_ratio: dict[str, float | None] = Field(
        default_factory=dict, description="group → its largest applied gradient norm from the step on, over its "
        "median before")
    loss_change: dict[str, float | None] = Field(
        default_factory=dict, description="group → mean loss of the steps after the corrupted one minus that of "
        "the steps before")
    steps: list[CorruptStep] = Field(default_factory=list, description="the watched steps around it")
    fingerprint_step: int | None = None
    fingerprints_equal: bool | None = None


class SdcOut(BaseModel):
    """The gradient check's incidents: each an abnormal gradient norm, the step skipped in every
    group, and the reruns' verdict."""

    counts: dict[Verdict, int] = Field(description="incidents by verdict, since the job began")
    incidents: list[SdcEvent] = Field(description="the newest incidents, oldest first")


class StragglerScoreOut(BaseModel):
    group: int
    compute_s: float = Field(description="median compute time over the window")
    wait_s: float = Field(description="median wait in the cross-group all-reduce over the window")
    relative: float = Field(description="the fastest group's median compute over this group's")
    individual: float = Field(description="this group's best median compute over its current one")
    slowest_share: float = Field(description="share of the window's steps in which it computed longest")
    slowdown: float = Field(description="its median compute over the median of the other groups' medians")


class StragglersOut(BaseModel):
    pattern: Literal["none", "persistent", "rotating"] = Field(
        description="persistent: the same group is slow step after step; rotating: the slow group changes")
    flagged: int | None = Field(description="the group flagged as a persistent straggler")
    slowdown: float | None = Field(description="how much it slows every group")
    policy: Literal["flag", "evict"]
    factor: float
    window: int
    groups: list[StragglerScoreOut] = Field(description="every training group with a full window")


class DrillOut(BaseModel):
    id: int
    kind: str
    group: int | None
    status: Literal["running", "done", "failed", "cancelled"]
    created: float
    updated: float
    error: str | None = None
    fingerprints_equal: bool | None = None
    goodput: float | None = None
    report: (PartitionReport | HangReport | KillHealReport | LighthouseReport | ChaosReport | StragglerReport
             | CorruptReport)


class DrillList(BaseModel):
    drills: list[DrillOut]


class Health(Served):
    checks: dict[str, str] = {}
