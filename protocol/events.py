"""The trainer's event schema: one JSON object per line, one file per rank.

Every rank writes ``{events_dir}/g{group}-r{rank}.jsonl`` (``protocol/layout.py``); the group's agent tails those files
and forwards the events to the control plane. This module is the single definition of that
stream: the trainer builds these models, the agent and the control plane parse them with
:data:`EVENT_ADAPTER`. Times are Unix seconds (``ts``) or durations in seconds (``*_s``).
"""

from __future__ import annotations

import itertools
import secrets
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, model_validator

INT64_MAX = 2**63 - 1
"""Every integer an event carries fits SQLite's (and Prometheus') 64-bit integers."""
JSON_INT_MAX = 2**53 - 1
"""The largest integer a JSON number (an IEEE double) holds exactly: a bound stated in the OpenAPI
document above it reads differently in a client's validator (2^63 - 1 rounds up to 2^63, so a
client takes 2^63 + 191 for a valid count) than in this server's."""


def not_a_bool(value: Any) -> Any:
    """JSON's ``true`` is not the number 1 (pydantic's lax mode takes it as one)."""
    if isinstance(value, bool):
        raise ValueError("a number, not a boolean")
    return value


Count = Annotated[int, Field(ge=0, le=JSON_INT_MAX), BeforeValidator(not_a_bool)]
"""A step, an id, a number of things: never negative. The bounds come before the validator: so
the OpenAPI document states them as JSON Schema's minimum and maximum (after it, pydantic can
only write them as unknown keys, and a client that fuzzes the document sends numbers past them)."""
QuorumId = Annotated[int, Field(ge=-1, le=JSON_INT_MAX), BeforeValidator(not_a_bool)]
"""The Lighthouse's id of a quorum (-1: before the first)."""
Flag = Annotated[bool, Field(strict=True)]
"""Yes or no: JSON's ``true`` or ``false`` only (pydantic's lax mode takes 0, 1 and "yes" too)."""
Seconds = Annotated[float, Field(ge=0)]
"""A duration (finite: no event carries NaN or infinity)."""

ExitKind = Literal["killed", "crashed", "hung", "lost", "evicted", "quarantined", "drained", "finished", "crash-loop"]
"""How a group's processes ended, as its agent saw it: the reason a group is down. ``hung``:
its agent's watchdog ended it (the event's detail says why). ``lost``: the control plane's
verdict, not the agent's: the agent does not answer and the Lighthouse has no heartbeat from
the group (a node lost with everything on it). ``evicted``: the control plane ended it as a
persistent straggler (``--straggler-policy evict``), or as a group on the far side of a
partition (``service/controlplane/partition.py``). ``quarantined``: its ranks left after the
gradient check found a persistent silent data corruption in them (``trainer/gradient_check.py``); like an evicted
group it is not restarted by itself, its warm spare takes its place. ``drained``: taken
out on purpose (``ftctl drain``, a SIGTERM to its agent or container): it finished its step in
flight, committed it and left; it stays down until a rejoin. ``crash-loop``: no exit of its
own but its agent's hold after one: the group went down by itself too often lately
(``service/agent/restarts.py``) and stays down for a cool-down before it is tried again."""
Verdict = Literal["transient", "persistent", "data"]
"""The gradient check's attribution of an abnormal gradient norm, as Megatron's rerun state
machine attributes one: the flagged group's rerun of the batch was normal (``transient``); it was
abnormal again and another group's rerun of that batch was normal (``persistent``: the flagged
group's hardware); or both were abnormal (``data``: the batch itself)."""


def _within_int64(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, int):
        return -INT64_MAX - 1 <= value <= INT64_MAX
    if isinstance(value, dict):
        return all(_within_int64(k) and _within_int64(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(map(_within_int64, value))
    return True


class GroupEvent(BaseModel):
    """What every event carries. Floats are finite (``allow_inf_nan=False``: a value that is
    not finite travels as null in the fields that allow it) and integers fit 64 bits, so the
    control plane can store and export whatever validates here."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    ts: float = Field(description="Unix time the event happened")
    group: Count = Field(description="stable replica-group id g (never torchft's uuid)")
    eid: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$",
                            description="the event's own id: its writer and its number there. A retry or a "
                            "re-read carries the same id and is stored once")

    @model_validator(mode="after")
    def _integers_fit_64_bits(self) -> "GroupEvent":
        if not all(_within_int64(v) for v in self.__dict__.values()):
            raise ValueError("an integer does not fit in 64 bits")
        return self


class BaseEvent(GroupEvent):
    """An event a trainer rank writes."""

    rank: Count = Field(description="rank inside the replica group")


class ProcessEvent(GroupEvent):
    """The group's agent started, lost or stopped the group's torchrun process tree."""

    type: Literal["process"] = "process"
    action: Literal["started"] | ExitKind
    pid: Count | None = None
    returncode: int | None = None
    detail: str | None = None


class StartEvent(BaseEvent):
    """A rank is up and about to join the quorum; the startup time split."""

    type: Literal["start"] = "start"
    pid: Count
    replica_id: str = Field(description="torchft replica id of this start (name:uuid on rank 0)")
    ranks_per_group: Count
    device: str
    config: str = Field(description="the torchtitan config-registry entry the job trains (--config)")
    model: str = Field(description="the model it builds: torchtitan's name and flavor")
    dtype: Literal["bf16", "fp32"] = Field(description="compute precision (FSDP2 mixed precision)")
    tokenizer: str = Field(description="the tokenizer: its folder, or 'bytes'")
    dataset: str = Field(description="the dataset (--dataset), or the standard library's sources")
    dataset_samples: Count = Field(description="samples in one epoch of the tokenized dataset")
    seq_len: Count
    local_batch_size: Count = Field(description="samples a rank computes at once (a microbatch)")
    global_batch_size: Count = Field(description="samples a committed step trains over every group")
    batch_policy: Literal["constant", "shrink"]
    steps: Count | None = Field(None, description="the step the job trains to (--steps); null from older trainers")
    parameters: Count = Field(description="model parameters (whole model, not the local shard)")
    imports_s: Seconds = Field(description="process start until torch and torchft are imported")
    process_group_s: Seconds = Field(description="intra-group process group and device mesh")
    data_s: Seconds = Field(description="opening the tokenized dataset (tokenizing it, the first time)")
    model_s: Seconds = Field(description="model build, FSDP sharding, optimizer state")
    checkpoint_s: Seconds = Field(description="looking for and loading a checkpoint")
    manager_s: Seconds = Field(description="torchft Manager and replicate process group")
    resumed_step: Count = Field(description="step loaded from a checkpoint, 0 when none")
    spare_wait_s: Seconds = Field(0.0, description="time spent built and waiting as a warm spare")
    forked: Flag = Field(False, description="forked by the agent's zygote, which had imported everything and "
                         "read the corpus before: the split starts at the fork")


class StepEvent(BaseEvent):
    """One training step, committed or not."""

    type: Literal["step"] = "step"
    step: Count = Field(description="manager step after this step (the step count committed)")
    committed: Flag
    data_step: Count = Field(description="the data position the step trained: its global batch is the samples "
                             "[data_step × global_batch, (data_step + 1) × global_batch) of the job's order")
    global_batch: Count = Field(description="samples in the step's global batch (--global-batch-size)")
    step_samples: Count = Field(description="samples of the global batch the step trained over every group: all of "
                                "it with --batch-policy constant, the participants' shares with shrink; 0 when the "
                                "optimizer did not step")
    consumed: Flag = Field(description="the step used up its global batch: trained it, or the gradient check blamed "
                           "the batch itself; false when the same batch is trained again next step")
    sample_start: Count = Field(description="the first global sample this group trained at the step")
    samples: Count = Field(description="how many samples (from sample_start) this group trained: 0 when it did "
                           "not take part (healing, a spare)")
    tokens: Count = Field(description="tokens of this group's samples")
    loss: float | None = Field(description="this rank's mean token loss; null when it trained no sample, or when "
                               "not finite: the training diverged")
    lr: float
    step_s: Seconds = Field(description="wall time of the whole step")
    compute_s: Seconds = Field(description="forward, backward and optimizer, minus the waits")
    allreduce_s: Seconds = Field(description="waiting on the cross-group collectives: the gradient all-reduce and "
                               "the gradient check's exchange of norms")
    commit_s: Seconds = Field(description="should_commit: agreeing inside and across groups")
    quorum_id: QuorumId
    participants: Count
    participating: Flag
    healed: Flag = Field(description="this step loaded state fetched from a peer")
    batches_committed: Count = Field(description="torchft's count of replica-batches committed")
    grad_norm: float | None = Field(
        None, description="this group's own gradient norm before it crossed groups (the gradient check; null "
        "when the check is off or the norm was not finite)")
    clip_norm: float | None = Field(
        None, description="--max-norm: norm of the averaged gradient, over every group, that clipping scaled by")
    shard_grad_norm: float | None = Field(
        None, description="norm of this rank's shard of the averaged gradient the optimizer was given; set while "
        "a drill watches the group (the group's norm is the root of the ranks' squares)")
    shard_update_norm: float | None = Field(
        None, description="norm of this rank's shard of the parameter update the step applied; set while a drill "
        "watches the group")
    skipped: Flag = Field(False, description="committed without an optimizer step: a gradient failed the check")
    rerun_s: Seconds = Field(0.0, description="a failed gradient check's reruns (in compute_s too; the norms' "
                           "exchanges are in allreduce_s)")
    checkpoint_stall_s: Seconds = Field(0.0, description="before this step, how long the rank waited for a "
                                        "checkpoint: its copy into CPU memory (the whole save when synchronous)")


class QuorumEvent(BaseEvent):
    """The quorum this rank trains in changed."""

    type: Literal["quorum"] = "quorum"
    quorum_id: QuorumId
    previous_quorum_id: QuorumId
    step: Count
    participants: Count


class HealEvent(BaseEvent):
    """This rank fetched live state from its peers' same rank and loaded it: each phase timed.

    In order: its Manager's quorum answered (``quorum_at``) → torchft asked the source's Manager
    for its checkpoint metadata and called the transport (``fetch_started_at``) → the sources
    found and the state's header read (``header_s``) → the tensor bytes, checked as they arrived
    (``transfer_s``; ``checksum_s`` of CPU within it) → the step's forward and backward end →
    the state applied (``load_s``, ending at ``applied_at``). The times are absent from older
    trainers."""

    type: Literal["heal"] = "heal"
    step: Count = Field(description="step the state was taken at")
    source_group: Count = Field(description="the group torchft named as the source (the non-tensor values are its)")
    sources: list[Count] = Field([], description="the groups that sent a share of the tensor bytes")
    source_failures: Count = Field(0, description="sources dropped mid-heal, whose pieces came from the others")
    bytes: Count
    quorum_at: float | None = Field(None, description="Unix time its Manager's quorum (the one that healed it) answered")
    fetch_started_at: float | None = Field(None, description="Unix time torchft asked the transport for the state")
    header_s: Seconds = Field(0.0, description="finding the live sources and reading the state's header")
    transfer_s: Seconds = Field(0.0, description="the tensor bytes, every segment's CRC-32C checked as it arrived")
    checksum_s: Seconds = Field(0.0, description="CPU time of the checks, within transfer_s (all sources together)")
    fetch_s: Seconds = Field(description="header_s + transfer_s: fetching the state over the checkpoint transport")
    load_s: Seconds = Field(description="applying it: copying it into the model, optimizer and scheduler")
    applied_at: float | None = Field(None, description="Unix time the state was applied")


class CommitFailedEvent(BaseEvent):
    type: Literal["commit_failed"] = "commit_failed"
    step: Count
    quorum_id: QuorumId
    error: str | None = None


class CheckpointEvent(BaseEvent):
    type: Literal["checkpoint"] = "checkpoint"
    action: Literal["saved", "loaded", "skipped"]
    step: Count
    seconds: Seconds
    path: str
    reason: str | None = Field(None, description="why a checkpoint was skipped")
    stall_s: Seconds | None = Field(None, description="saved: how long the training step waited for this save "
                                    "(seconds is the whole save, mostly written in the background)")


class FingerprintEvent(BaseEvent):
    """Hash of this rank's local parameter and optimizer shards at a committed step.

    Rank r of every group holds the same shard, so equal digests for (step, rank) across
    groups mean the groups hold bitwise identical state.
    """

    type: Literal["fingerprint"] = "fingerprint"
    step: Count
    digest: str


class SyncEvent(BaseEvent):
    """A sync across groups (``--sync localsgd|diloco``): the quorum, a heal, the all-reduce of
    the groups' pseudo-gradients and the outer step, after ``H`` inner steps inside the group."""

    type: Literal["sync"] = "sync"
    step: Count = Field(description="inner steps committed after the sync (what --steps counts)")
    outer_step: Count = Field(description="syncs committed after it (torchft's step)")
    committed: Flag = Field(description="false: every group went back to the last synced parameters, data "
                            "position and schedule, and trains the window again")
    joined: Flag = Field(description="the group joined the others at this sync without having trained a window "
                         "(its start, a restart)")
    fragment: Count = Field(description="the model fragment this sync averaged (streaming DiLoCo; 0 with one)")
    seconds: Seconds = Field(description="from the window's last inner step to the end of the sync: waiting for the "
                             "other groups, the quorum, a heal, the all-reduce and the outer step")
    bytes: Count = Field(description="this rank's pseudo-gradient, sent into the cross-group all-reduce")
    drift: float | None = Field(description="norm of this group's pseudo-gradient (how far its window moved it "
                                "from the last synced parameters); null at a join")
    participants: Count = Field(description="groups whose pseudo-gradients the sync averaged")
    members: Count = Field(description="groups that trained the window and took part in its sync")
    quorum_id: QuorumId
    healed: Flag = Field(description="this group loaded a peer's state at the sync")
    checked: Flag = Field(False, description="the groups' pseudo-gradients are checked at their syncs (--sdc-check)")
    skipped: Flag = Field(False, description="the check found the window's samples abnormal in any group: "
                          "the window is not trained again, its samples are counted skipped")
    error: str | None = None


class ExitEvent(BaseEvent):
    type: Literal["exit"] = "exit"
    reason: Literal["done", "stopped", "error", "lighthouse-away", "quarantined"] = Field(
        description="lighthouse-away: no quorum within --quorum-timeout-s and the Lighthouse takes no connection; "
        "quarantined: the gradient check attributed a persistent corruption to this group")
    step: Count
    error: str | None = None
    events_dropped: Count = Field(0, description="events this rank dropped: its queue was full")


class StragglerEvent(GroupEvent):
    """The control plane's straggler detector flagged the group, or cleared it
    (``service/controlplane/stragglers.py``). The scores are set when flagged."""

    type: Literal["straggler"] = "straggler"
    action: Literal["flagged", "cleared"]
    policy_action: Literal["flag", "evict"] | None = Field(
        None, description="flagged only: what the straggler policy does with it (evict only when that pays)")
    relative: float | None = Field(None, description="the fastest group's median compute over this group's")
    individual: float | None = Field(None, description="this group's best median compute over its current one")
    slowdown: float | None = Field(None, description="its median compute over its peers' median")
    slowest_share: float | None = Field(None, description="share of the window's steps it computed longest in")
    compute_s: Seconds | None = Field(None, description="its median compute time over the window")
    wait_s: Seconds | None = Field(None, description="its median wait in the cross-group all-reduce")
    keep_cost: float | None = Field(None, description="share of the throughput keeping it costs: 1 - 1/slowdown")
    evict_cost: float | None = Field(None, description="share of the throughput evicting it costs: 1/groups")
    detail: str


class PartitionEvent(GroupEvent):
    """The control plane evicted the group because it does not reach some other group while all
    of them reach the Lighthouse, or rejoined it once it reaches every up group again
    (``service/controlplane/partition.py``)."""

    type: Literal["partition"] = "partition"
    action: Literal["evicted", "rejoined"]
    kept: list[Count] = Field(description="evicted: the groups kept, the largest set that all reach each other; "
                              "rejoined: the groups it reaches again")
    unreached: list[Count] = Field(description="evicted: the groups it and they do not both reach")
    detail: str


class SdcEvent(BaseEvent):
    """The gradient check found an abnormal norm and every group skipped the step; written by
    rank 0 of the flagged group once the reruns attributed it. Norms are null where not finite."""

    type: Literal["sdc"] = "sdc"
    step: Count = Field(description="the step whose batch was checked (its optimizer step skipped everywhere)")
    norms: dict[Count, float | None] = Field(description="group → its gradient norm before crossing groups")
    reference_norm: float | None = Field(description="median norm of the groups not flagged")
    factor: float = Field(description="a norm above factor × the others' median is abnormal")
    rerun_norm: float | None = Field(description="this group's norm when it recomputed the batch")
    checker_group: Count | None = Field(description="the group that recomputed this group's batch")
    checker_norm: float | None = Field(description="the norm the checker group computed for it")
    verdict: Verdict
    action: Literal["skipped", "quarantined"] = Field(
        description="skipped: the step was skipped and training goes on; quarantined: the group leaves and its "
        "warm spare takes its place")
    check_s: Seconds = Field(description="time the reruns and the exchanges took")


class TorchftLogEvent(BaseEvent):
    """A record of torchft's own ``torchft_quorums`` / ``torchft_commits`` / ``torchft_errors``."""

    type: Literal["torchft"] = "torchft"
    logger: str
    quorum_id: QuorumId | None = None
    step: Count | None = None
    commit_result: Flag | None = None
    replica_id: str | None = None
    error: str | None = None


Event = Annotated[
    Union[
        StartEvent,
        StepEvent,
        QuorumEvent,
        HealEvent,
        CommitFailedEvent,
        CheckpointEvent,
        FingerprintEvent,
        ExitEvent,
        TorchftLogEvent,
        ProcessEvent,
        StragglerEvent,
        PartitionEvent,
        SdcEvent,
        SyncEvent,
    ],
    Field(discriminator="type"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
EVENT_TYPES: tuple[str, ...] = tuple(get_args(m.model_fields["type"].annotation)[0]
                                     for m in get_args(get_args(Event)[0]))
EventType = Literal[EVENT_TYPES]  # type: ignore[valid-type]


class EventIds:
    """Ids for the events one writer makes, ``{writer}-{random}:{n}``: unique across writers and
    their restarts, so the control plane can store each event once however often it is sent."""

    def __init__(self, writer: str):
        self.prefix = f"{writer}-{secrets.token_hex(6)}"
        self._numbers = itertools.count(1)

    def next(self) -> str:
        return f"{self.prefix}:{next(self._numbers)}"


def parse_event(line: str | bytes) -> Event:
    return EVENT_ADAPTER.validate_json(line)


def speaks_for_group(event: Event) -> bool:
    """Rank 0 speaks for its group: every rank steps, heals and changes quorum together, so
    the group's step, loss, heal and quorum are what its rank 0 reports. The agent's process
    events and the control plane's verdicts speak for the group too; the other ranks' events
    count only where each rank matters on its own (fingerprints, exits)."""
    return not isinstance(event, BaseEvent) or event.rank == 0
