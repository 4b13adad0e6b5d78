"""The Lighthouse drill: SIGKILL torchft's Lighthouse and measure that the job pauses, not dies.

torchft's Lighthouse is the job's one single point of failure: every step's quorum asks it.
The drill kills it through its wrapper (which restarts it, ``down_s`` later at the soonest),
times the control plane's first failed health check and the restarted one's first answer, and
then reads the groups' events: each group's gap in commits and how soon after the Lighthouse
answered it committed again, steps that failed their commit, any group process that ended
(none should), and every rank's fingerprint at a common step afterwards.

:class:`LighthouseTimeline` is a pure fold over the events, as the kill-heal drill's
``FaultTimeline`` is; :class:`Lighthouse` makes the fault and waits for each milestone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field

from protocol.events import CommitFailedEvent, Event, FingerprintEvent, ProcessEvent, StepEvent, speaks_for_group
from protocol.lighthouse import MAX_HOLD_S
from service.controlplane.drills.base import Drill, DrillBody, FaultClass, Prepared, TimeoutField
from service.controlplane.drills.context import DrillServices
from service.controlplane.drills.rows import EQUAL, Row, none_is_good, secs, shown
from service.controlplane.errors import DrillConflict
from service.controlplane.fingerprints import FingerprintBook
from service.controlplane.groups import GroupView
from service.controlplane.lighthouse import LighthouseUnreachable

HEALTH_POLL_S = 0.1


class LighthouseIn(DrillBody):
    """SIGKILL torchft's Lighthouse (its wrapper restarts it); every group must pause, not restart."""

    kind: Literal["lighthouse"]
    down_s: float = Field(0.0, ge=0, le=MAX_HOLD_S, description="keep it down this long (default: the wrapper's "
                          "restart delay); past the trainers' --quorum-timeout-s the groups stop and are restarted")
    timeout_s: float | None = TimeoutField


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


@dataclass
class LighthouseTimeline:
    groups: frozenset[int]
    ranks_per_group: int
    killed_at: float
    back_at: float | None = None
    commits: dict[int, list[tuple[float, int]]] = field(default_factory=dict)
    failed: dict[int, list[float]] = field(default_factory=dict)
    exits: list[ProcessEvent] = field(default_factory=list)
    fingerprints: FingerprintBook = field(default_factory=FingerprintBook)

    @classmethod
    def begin(cls, groups: list[int], views: Mapping[int, GroupView], ranks_per_group: int,
              killed_at: float) -> "LighthouseTimeline":
        """Each group's last commit as the board knew it at the kill: the start of its pause."""
        t = cls(frozenset(groups), ranks_per_group, killed_at)
        for g in groups:
            v = views[g]
            if v.committed_at is not None and v.step is not None:
                t.commits[g] = [(v.committed_at, v.step)]
        return t

    def observe(self, e: Event) -> None:
        if e.group not in self.groups or not speaks_for_group(e) and not isinstance(e, FingerprintEvent):
            return
        match e:
            case ProcessEvent() if e.ts >= self.killed_at and e.action != "started":
                self.exits.append(e)
            case StepEvent(committed=True):
                self.commits.setdefault(e.group, []).append((e.ts, e.step))
            case CommitFailedEvent() if e.ts >= self.killed_at:
                self.failed.setdefault(e.group, []).append(e.ts)
            case FingerprintEvent():
                self.fingerprints.add(e)

    def pause(self, group: int) -> LighthousePause:
        if self.back_at is None:
            return LighthousePause()
        commits = sorted(self.commits.get(group, []))
        before = [ts for ts, _ in commits if ts <= self.back_at]
        after = [ts for ts, _ in commits if ts > self.back_at]
        last, resumed = (before[-1] if before else None), (after[0] if after else None)
        lost = sum(1 for ts in self.failed.get(group, []) if resumed is None or ts <= resumed)
        return LighthousePause(
            last_commit_at=last, resumed_at=resumed, steps_lost=lost,
            pause_s=resumed - last if resumed is not None and last is not None else None,
            resume_after_back_s=resumed - self.back_at if resumed is not None else None)

    @property
    def resumed(self) -> bool:
        return self.back_at is not None and all(self.pause(g).resumed_at is not None for g in self.groups)

    @property
    def resumed_step(self) -> int:
        """The highest step any group committed first after the Lighthouse came back."""
        return max(step for g in self.groups for ts, step in sorted(self.commits.get(g, []))
                   if self.back_at is not None and ts > self.back_at)

    @property
    def fingerprint_step(self) -> int | None:
        if not self.resumed:
            return None
        return self.fingerprints.complete_step(set(self.groups), self.ranks_per_group, self.resumed_step)

    def fill(self, r: LighthouseReport) -> None:
        r.back_at = self.back_at
        r.away_s = self.back_at - self.killed_at if self.back_at is not None else None
        pauses = {g: self.pause(g) for g in sorted(self.groups)}
        r.pauses = {str(g): p for g, p in pauses.items()}
        gaps = [p.pause_s for p in pauses.values() if p.pause_s is not None]
        waits = [p.resume_after_back_s for p in pauses.values() if p.resume_after_back_s is not None]
        r.max_pause_s = max(gaps) if gaps else None
        r.max_resume_after_back_s = max(waits) if len(waits) == len(pauses) else None
        r.steps_lost = sum(p.steps_lost for p in pauses.values())
        r.process_exits = [f"group {e.group} {e.action}" + (f": {e.detail}" if e.detail else "") for e in self.exits]
        step = self.fingerprint_step
        if step is not None:
            r.fingerprint_step = step
            r.fingerprints = self.fingerprints.digests(step, set(self.groups), self.ranks_per_group)
            r.fingerprints_equal = self.fingerprints.equal_at(step)


class Lighthouse(Drill):
    kind = "lighthouse"
    Request = LighthouseIn
    Report = LighthouseReport
    fault_class = FaultClass("lighthouse", "max_pause_s")
    summary = "SIGKILL torchft's Lighthouse; every group must pause and go on, none restart"
    timeline: LighthouseTimeline

    @classmethod
    def prepare(cls, request: LighthouseIn, services: DrillServices) -> Prepared:
        board = services.control.board
        not_up = [g for g in sorted(board.views) if g not in board.up()]
        if not_up:
            raise DrillConflict("the Lighthouse drill needs every group up (it measures that none goes down); " +
                                ", ".join(f"group {g} is {board.views[g].state}" for g in not_up))
        return Prepared(group=None, report=LighthouseReport(down_s=request.down_s, groups=sorted(board.views)))

    @classmethod
    def title(cls, drill: dict) -> str:
        return "lighthouse"

    @classmethod
    def rows(cls, r: dict) -> list[Row]:
        pauses = sorted((r.get("pauses") or {}).items(), key=lambda kv: int(kv[0]))
        return [
            ("phase", r.get("phase")),
            ("Lighthouse killed → noticed", secs(r.get("detect_s"))),
            ("Lighthouse away", secs(r.get("away_s"))),
            *((f"group {g}", f"paused {secs(p.get('pause_s'))}, committed {secs(p.get('resume_after_back_s'))} "
                             f"after it answered, {p.get('steps_lost', 0)} step(s) lost") for g, p in pauses),
            ("group processes ended", none_is_good(r.get("process_exits") or [])),
            ("fingerprints at step", shown(r.get("fingerprint_step"))),
            ("fingerprints equal", EQUAL.get(r.get("fingerprints_equal"), "-")),
        ]

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.timeout_s += self.r.down_s  # per phase; the wait for it to come back

    async def _poll_health(self, healthy: bool) -> float:
        """The time the wrapper first answers ``healthy`` (True) or not (False)."""
        async with asyncio.timeout(self.timeout_s):
            while True:
                try:
                    await self.ctx.lighthouse.check_health()
                    ok = True
                except LighthouseUnreachable:
                    ok = False
                if ok == healthy:
                    return time.time()
                await asyncio.sleep(HEALTH_POLL_S)

    def observe(self, e: Event) -> None:
        self.timeline.observe(e)

    def fill(self) -> None:
        self.timeline.fill(self.r)

    async def run(self) -> None:
        ctx, r = self.ctx, self.r
        queue = ctx.bus.subscribe()
        try:
            r.phase = "kill"
            killed = await ctx.lighthouse.kill(r.down_s)
            r.lighthouse_pid, r.killed_at = killed.pid, killed.killed_at
            self.timeline = t = LighthouseTimeline.begin(r.groups, ctx.control.board.views,
                                                         ctx.settings.ranks_per_group, killed.killed_at)
            r.detected_at, r.detected_by = await self._poll_health(False), "health-check"
            r.detect_s = r.detected_at - r.killed_at
            ctx.save()

            r.phase = "away"
            try:
                t.back_at = await self._poll_health(True)
            except TimeoutError:
                raise TimeoutError(f"the Lighthouse did not answer within {self.timeout_s:.0f}s of its kill") from None
            while not queue.empty():  # what arrived meanwhile, before waiting on what is to come
                t.observe(queue.get_nowait().event)
            self.fill()
            ctx.save()

            r.phase = "resume"
            await self.until(queue, lambda: t.resumed, "every group to commit after the Lighthouse came back")
            r.phase = "fingerprints"
            await self.until(queue, lambda: t.fingerprint_step is not None, "every rank's fingerprint at a common step")
        finally:
            ctx.bus.unsubscribe(queue)
