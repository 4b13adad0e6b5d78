"""The straggler drill (the seed's slow_rank): slow one live group down and watch the detector.

Phases: ``baseline`` (the job's committed throughput before), ``injected`` (every rank of the
group sleeps ``delay_ms`` before each forward for ``duration_s``, told through its agent, with
no restart; the detector in ``stragglers.py`` should flag it, and the straggler policy act),
``after`` (the throughput once the delay is over). Throughput is trained samples per
second (``throughput.py``), as the chaos drill counts it: with ``--batch-policy constant`` an
evicted group's share goes to the others, and the throughput says what that costs them.
The drill may run under another straggler policy than the job's (``policy``), to see what
eviction would do; the job's comes back when it ends.
"""

from __future__ import annotations

import asyncio
import time
from typing import Literal

from pydantic import BaseModel, Field
from rich.text import Text

from protocol.events import Event, ProcessEvent, StepEvent, StragglerEvent, speaks_for_group
from protocol.injection import InjectRequest
from service.controlplane.drills.base import (
    Drill,
    DrillBody,
    GroupField,
    Prepared,
    require_training_with_another,
)
from service.controlplane.drills.context import DrillServices
from service.controlplane.drills.rows import Row, none_is_good
from service.controlplane.throughput import ThroughputMeter

TICK_S = 0.2
CATCH_UP_S = 2.0
"""After a phase: time for its last step events to reach the control plane."""


class StragglerIn(DrillBody):
    """Slow one group down at run time (a sleep before every forward); the detector must name it."""

    kind: Literal["straggler"]
    group: int = GroupField
    delay_ms: float = Field(30.0, gt=0, le=60_000, description="the sleep before every forward")
    duration_s: float = Field(30.0, gt=0, le=3600, description="how long the group stays slow")
    baseline_s: float = Field(10.0, gt=0, le=3600, description="throughput measured before")
    after_s: float = Field(10.0, gt=0, le=3600, description="throughput measured after")
    policy: Literal["flag", "evict"] | None = Field(None, description="the straggler policy while the drill runs "
                                                     "(default: the job's --straggler-policy)")


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


class Straggler(Drill):
    """Runs one straggler drill against the live job; the runner persists ``report`` as it goes."""

    kind = "straggler"
    Request = StragglerIn
    Report = StragglerReport
    summary = "slow a group down (a sleep before every forward); the detector must name it, the policy act"

    @classmethod
    def prepare(cls, request: StragglerIn, services: DrillServices) -> Prepared:
        require_training_with_another(services, request.group, "the straggler drill")
        report = StragglerReport(**request.model_dump(exclude={"kind", "policy"}),
                                 policy=request.policy or services.settings.straggler_policy)
        return Prepared(group=request.group, report=report)

    @classmethod
    def title(cls, drill: dict) -> str:
        r = drill["report"]
        return f"straggler · group {r['group']} +{r['delay_ms']:g} ms for {r['duration_s']:g}s · policy {r['policy']}"

    @classmethod
    def rows(cls, r: dict) -> list[Row]:
        found = r.get("detected_group")
        rates, steps = r.get("throughput") or {}, r.get("median_step_s") or {}

        def throughput(when: str) -> str:
            rate, step = rates.get(when), steps.get(when)
            return (f"{rate:.2f} samples/s" if rate is not None else "-") + (
                f" · {step:.2f} s/step" if step is not None else "")

        return [
            ("phase", r.get("phase")),
            ("flagged", "nobody" if found is None else Text(f"group {found} after {r['detect_s']:.1f} s",
                                                            style="green" if found == r["group"] else "red")),
            *([("slowdown · relative · individual",
                f"{r['slowdown']:.2f}× · {r['relative']:.2f} · {r['individual']:.2f}"),
               ("verdict", r.get("detail") or "-")] if found is not None else []),
            ("action", r.get("action") or "-"),
            *([("went down", Text(r["ended"], style="red"))] if r.get("ended") else []),
            ("others flagged", none_is_good(r.get("others_flagged") or [])),
            *((f"throughput {when}", throughput(when)) for when in ("before", "during", "after")),
        ]

    @classmethod
    def problem(cls, r: dict) -> str | None:
        if r.get("ended"):
            return (f"group {r['group']} went down during it ({r['ended']}); a delay over the hang watchdog's step "
                    "bound is a hang, not a straggler: use a shorter --delay-ms")
        if r["detected_group"] != r["group"]:
            found = "nobody" if r["detected_group"] is None else f"group {r['detected_group']}"
            return (f"the detector flagged {found}, not group {r['group']}; a delay too short for "
                    "--straggler-factor is not a straggler (try a longer --delay-ms)")
        return None

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.tracker = self.ctx.stragglers
        self.meter = ThroughputMeter()

    def observe(self, e: Event) -> None:
        r = self.r
        match e:
            case StepEvent(committed=True) if speaks_for_group(e):
                self.meter.observe(e)
            case StragglerEvent(action="flagged") if r.injected_at is not None and e.ts >= r.injected_at:
                if r.detected_group is None:
                    r.detected_group, r.detected_at, r.detect_s = e.group, e.ts, e.ts - r.injected_at
                    r.relative, r.individual, r.slowdown = e.relative, e.individual, e.slowdown
                    r.slowest_share, r.keep_cost, r.evict_cost = e.slowest_share, e.keep_cost, e.evict_cost
                    r.action, r.detail = "flagged", e.detail
                if e.group != r.group and e.group not in r.others_flagged:
                    r.others_flagged.append(e.group)
            case StragglerEvent(action="cleared") if e.group == r.detected_group and r.cleared_at is None:
                r.cleared_at = e.ts
            case ProcessEvent(action="evicted") if e.group == r.group:
                r.action, r.evicted_at = "evicted", e.ts
            case ProcessEvent(action=reason) if e.group == r.group and reason != "started" and r.ended is None:
                r.ended = f"{reason}: {e.detail}" if e.detail else reason

    async def _phase(self, name: str, seconds: float) -> None:
        self.r.phase = name
        self.ctx.save()
        end = time.time() + seconds
        while time.time() < end:
            await asyncio.sleep(TICK_S)

    async def run(self) -> None:
        r = self.r
        policy, self.tracker.policy = self.tracker.policy, r.policy
        try:
            async with self.observing():
                started = time.time()
                await self._phase("baseline", r.baseline_s)
                injected = await self.ctx.control.inject(
                    r.group, InjectRequest(kind="slow", delay_ms=r.delay_ms, seconds=r.duration_s), self.ctx.drill_id)
                r.injected_at, r.flagged_before = injected.at, self.tracker.flagged
                await self._phase("injected", r.duration_s)
                ended = injected.at + r.duration_s
                await self._phase("after", r.after_s + CATCH_UP_S)
                spans = {"before": (started, injected.at), "during": (injected.at, ended),
                         "after": (ended, ended + r.after_s)}
                r.throughput = {k: self.meter.rate(*span) for k, span in spans.items()}
                r.median_step_s = {k: self.meter.median_step_s(*span) for k, span in spans.items()}
                if r.detected_group is None:
                    r.action = "none"
        finally:
            self.tracker.policy = policy
