"""One fault's recovery, read from the job's events: the timeline every drill measures.

    fault ─▶ detected ─▶ survivors resume ─▶ ended ─▶ replacement up ─▶ healed commit ─▶ fingerprints
      (a survivor's     (a survivor commits   (its agent   (the group's      (its first       (every rank of
       quorum changed)   in a quorum without   reported     ranks are up:     committed step)  every group
                         the group)            its exit)    its start event)                   reported one step)

:class:`FaultTimeline` is a pure fold: the drill (or a test, on recorded events) feeds it
every event once, in arrival order, and reads the milestones. Events from different agents
arrive out of order: a fail-over to a warm spare can heal the group before the survivors'
first commit has even been received, so no milestone waits for another, and each is the
earliest time the events show (not the first one to arrive): any arrival order of the same
events gives the same timeline. Rank 0 speaks for its group (``protocol.events.speaks_for_group``);
fingerprints come from every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, Mapping

from protocol.events import (
    CommitFailedEvent,
    Event,
    FingerprintEvent,
    HealEvent,
    ProcessEvent,
    StartEvent,
    StepEvent,
    TorchftLogEvent,
    speaks_for_group,
)
from service.controlplane.fingerprints import FingerprintBook
from service.controlplane.groups import GroupView
from service.controlplane.recovery import RecoveryPhase, recovery_phases

RejoinedBy = Literal["drill", "agent", "network"]


class Milestone(Enum):
    DETECTED = "detected"
    SURVIVORS_RESUMED = "survivors resumed"
    ENDED = "ended"
    REJOINED = "rejoined"
    REPLACEMENT_UP = "replacement up"
    HEALED = "healed"
    FINGERPRINTS = "fingerprints compared"


@dataclass
class FaultTimeline:
    group: int
    fault_at: float
    survivors: frozenset[int]
    participants_before: int
    quorum_before: Mapping[int, int | None]
    ranks_per_group: int
    quorum_changed_at: float | None = None
    survivors_resumed_at: float | None = None
    commit_failures: dict[int, list[float]] = field(default_factory=dict)
    exit: ProcessEvent | None = None
    rejoined_at: float | None = None
    rejoined_by: RejoinedBy | None = None
    up_at: float | None = None
    start: StartEvent | None = None
    heal: HealEvent | None = None
    healed_commit_at: float | None = None
    healed_step: int | None = None
    fingerprints: FingerprintBook = field(default_factory=FingerprintBook)

    @staticmethod
    def survivors_of(group: int, views: Mapping[int, GroupView]) -> frozenset[int]:
        """The groups a fault of ``group`` leaves training."""
        return frozenset(g for g, v in views.items() if g != group and v.state == "training")

    @classmethod
    def begin(cls, group: int, fault_at: float, views: Mapping[int, GroupView], ranks_per_group: int) -> "FaultTimeline":
        """A fault of ``group`` at ``fault_at``; the survivors are the other groups training then."""
        survivors = cls.survivors_of(group, views)
        return cls(group=group, fault_at=fault_at, survivors=survivors,
                   participants_before=views[group].participants or len(survivors) + 1,
                   quorum_before={s: views[s].quorum_id for s in survivors}, ranks_per_group=ranks_per_group,
                   commit_failures={s: [] for s in survivors})

    @property
    def members(self) -> set[int]:
        return {*self.survivors, self.group}

    def observe(self, e: Event) -> None:
        if e.ts < self.fault_at:
            return
        if isinstance(e, FingerprintEvent) and e.group in self.members:
            self.fingerprints.add(e)
        if e.group == self.group:
            self._observe_replacement(e)
        elif e.group in self.survivors and speaks_for_group(e):
            self._observe_survivor(e)

    def rejoined(self, at: float, by: RejoinedBy) -> None:
        """The group was asked to come back (by the drill), or came back (by its agent), at ``at``."""
        if self.rejoined_at is None:
            self.rejoined_at, self.rejoined_by = at, by

    def returned(self, at: float) -> None:
        """The group's ranks were never ended: cut off from the others, they waited, and they are
        back once the network is, at ``at`` (a partition)."""
        self.rejoined(at, "network")
        if self.up_at is None:
            self.up_at = at

    def _observe_replacement(self, e: Event) -> None:
        """The group's own events come in order per source (its agent, each rank)."""
        if isinstance(e, ProcessEvent):
            if e.action == "started":
                self.rejoined(e.ts, "agent")
            elif self.exit is None:
                self.exit = e  # its processes ended: killed, crashed, or hung (the watchdog's kill)
            return
        if not speaks_for_group(e) or self.healed_commit_at is not None:
            return
        match e:
            case StartEvent() if self.up_at is None:
                self.up_at, self.start = e.ts, e
            case HealEvent():
                self.heal = e
            case StepEvent(committed=True) if self.up_at is not None and e.ts >= self.up_at:
                self.healed_commit_at, self.healed_step = e.ts, e.step

    def _observe_survivor(self, e: Event) -> None:
        match e:
            case TorchftLogEvent(logger="torchft_quorums"):
                self.quorum_changed_at = _earliest(self.quorum_changed_at, e.ts)
            case CommitFailedEvent():
                self.commit_failures[e.group].append(e.ts)
            case StepEvent(committed=True) if (e.participants < self.participants_before
                                               or e.quorum_id != self.quorum_before[e.group]):
                # a quorum without the group: shrunk, or already holding its promoted spare
                self.survivors_resumed_at = _earliest(self.survivors_resumed_at, e.ts)

    @property
    def detected_at(self) -> float | None:
        """A survivor's quorum changed; when torchft logged no change first, the survivors'
        resume is the detection."""
        return _earliest(self.quorum_changed_at, self.survivors_resumed_at)

    @property
    def fingerprint_step(self) -> int | None:
        """The first step, from the healed one on, at which every rank of every member reported."""
        if self.healed_step is None:
            return None
        return self.fingerprints.complete_step(self.members, self.ranks_per_group, self.healed_step)

    def reached(self, milestone: Milestone) -> bool:
        return {
            Milestone.DETECTED: self.detected_at,
            Milestone.SURVIVORS_RESUMED: self.survivors_resumed_at,
            Milestone.ENDED: self.exit,
            Milestone.REJOINED: self.rejoined_at,
            Milestone.REPLACEMENT_UP: self.up_at,
            Milestone.HEALED: self.healed_commit_at,
            Milestone.FINGERPRINTS: self.fingerprint_step,
        }[milestone] is not None

    def describe(self, milestone: Milestone) -> str:
        """What waiting for ``milestone`` waits for, in words."""
        g = self.group
        return {
            Milestone.DETECTED: f"a survivor's quorum to drop group {g}",
            Milestone.SURVIVORS_RESUMED: f"a survivor to commit without group {g}",
            Milestone.ENDED: f"group {g}'s processes to end",
            Milestone.REJOINED: f"group {g}'s agent to restart it",
            Milestone.REPLACEMENT_UP: f"group {g}'s ranks to start",
            Milestone.HEALED: f"group {g} to heal and commit",
            Milestone.FINGERPRINTS: "fingerprints from every rank of every group",
        }[milestone]

    def waiting_for(self) -> str | None:
        """The first milestone not reached yet, in words; None once the timeline is complete."""
        return next((self.describe(m) for m in Milestone if not self.reached(m)), None)

    # --- the durations a report shows (None until both ends are known)
    @staticmethod
    def _between(start: float | None, end: float | None) -> float | None:
        return end - start if start is not None and end is not None else None

    @property
    def detect_s(self) -> float | None:
        return self._between(self.fault_at, self.detected_at)

    @property
    def survivors_resume_s(self) -> float | None:
        return self._between(self.fault_at, self.survivors_resumed_at)

    @property
    def restart_s(self) -> float | None:
        """Rejoin → the group's ranks are up."""
        return self._between(self.rejoined_at, self.up_at)

    @property
    def heal_s(self) -> float | None:
        """The group's ranks up → its first committed step after the heal."""
        return self._between(self.up_at, self.healed_commit_at)

    @property
    def recovery(self) -> list[RecoveryPhase]:
        """The rejoin, phase by phase (``service/controlplane/recovery.py``)."""
        return recovery_phases(self.rejoined_at, self.start, self.heal, self.healed_commit_at)

    @property
    def rejoin_to_healed_commit_s(self) -> float | None:
        return self._between(self.rejoined_at, self.healed_commit_at)

    @property
    def kill_to_full_s(self) -> float | None:
        """The fault → the group's healed commit: every group trains again."""
        return self._between(self.fault_at, self.healed_commit_at)

    @property
    def survivor_steps_lost(self) -> int:
        """Steps the survivors could not commit between the fault and their resume (the most
        any survivor lost: they fail the same steps together)."""
        end = self.survivors_resumed_at if self.survivors_resumed_at is not None else float("inf")
        return max((len([ts for ts in failed if ts < end]) for failed in self.commit_failures.values()), default=0)


def _earliest(*times: float | None) -> float | None:
    """The earliest of the times known (None when none is)."""
    return min((t for t in times if t is not None), default=None)
