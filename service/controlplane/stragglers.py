"""Stragglers: the group every other group waits for, found in the step events (seed ch. 8).

Synchronous training runs at the pace of its slowest group. The slow group computes long and
waits little in the cross-group all-reduce; the others compute as usual and wait long. Over the
last ``window`` committed steps of every training group, :func:`judge` flags a group whose median
compute time exceeds its peers' median by ``factor`` while its median wait is the lowest, with
two scores as NVRx's straggler detector keeps them:

- *relative*: the fastest group's median compute over this group's (1.0 for the fastest);
- *individual*: this group's best window median since it started over its current one (below 1
  when it slowed down, even when every group did).

A flagged group is a *persistent* straggler when it was the slowest group in at least
``PERSISTENT_SHARE`` of the steps every group reported; a slowdown that moves from group to
group (data imbalance, the common case) is *rotating* and never acted on.

Acting on a persistent one (``--straggler-policy evict``) pays only when keeping it costs more
than losing it: a straggler that slows every group by ``s`` costs ``1 - 1/s`` of the throughput,
evicting one of ``N`` groups costs ``1/N``. :func:`eviction_pays` is that line.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.events import Event, ProcessEvent, StartEvent, StepEvent, StragglerEvent, speaks_for_group

PERSISTENT_SHARE = 0.6
"""A straggler slowest in at least this share of the window's steps is the same group step after step."""

JUDGE_EVERY_S = 1.0
"""The tracker judges at most once per second of the events' own time: a verdict costs
O(groups × window), and a thousand groups report five steps a second each."""

Pattern = Literal["none", "persistent", "rotating"]


@dataclass(frozen=True)
class StepSample:
    step: int
    compute_s: float
    allreduce_s: float


class GroupScore(BaseModel):
    """One group's score over the window (``GET /stragglers`` shows it as it is)."""

    model_config = ConfigDict(frozen=True)

    group: int
    compute_s: float = Field(0.0, description="median compute time over the window")
    wait_s: float = Field(0.0, description="median wait in the cross-group all-reduce over the window")
    relative: float = Field(1.0, description="the fastest group's median compute over this group's")
    individual: float = Field(1.0, description="this group's best median compute over its current one")
    slowest_share: float = Field(0.0, description="share of the window's steps in which it computed longest")
    slowdown: float = Field(1.0, description="its median compute over the median of the other groups' medians")


@dataclass(frozen=True)
class Verdict:
    pattern: Pattern
    scores: dict[int, GroupScore]
    group: int | None = None
    """the persistent straggler"""
    slowdown: float | None = None
    """its median compute over its peers' median: how much it slows every group"""


def judge(windows: Mapping[int, Sequence[StepSample]], best_s: Mapping[int, float], factor: float) -> Verdict:
    """The stragglers among groups that each reported a full window (at least two groups)."""
    if len(windows) < 2:
        return Verdict("none", {})
    medians = {g: statistics.median(s.compute_s for s in w) for g, w in windows.items()}
    waits = {g: statistics.median(s.allreduce_s for s in w) for g, w in windows.items()}
    fastest = min(medians.values())
    compute_at = {g: {s.step: s.compute_s for s in w} for g, w in windows.items()}
    by_step = [{g: at[step] for g, at in compute_at.items()}
               for step in sorted(set.intersection(*(set(at) for at in compute_at.values())))]
    slowest = [max(step, key=step.get) for step in by_step]
    share = {g: (slowest.count(g) / len(slowest) if slowest else 0.0) for g in windows}
    peers = _medians_of_the_others(medians)
    scores = {g: GroupScore(group=g, compute_s=medians[g], wait_s=waits[g],
                            relative=fastest / medians[g] if medians[g] > 0 else 1.0,
                            individual=min(1.0, best_s.get(g, medians[g]) / medians[g]) if medians[g] > 0 else 1.0,
                            slowest_share=share[g], slowdown=medians[g] / peers[g] if peers[g] > 0 else 1.0)
              for g in windows}
    least_wait = min(waits.values())
    for g, score in scores.items():
        if score.slowdown > factor and waits[g] == least_wait and share[g] >= PERSISTENT_SHARE:
            return Verdict("persistent", scores, g, score.slowdown)
    slow_steps = sum(1 for step in by_step if _stands_out(step, factor))
    if by_step and slow_steps >= len(by_step) / 2:
        return Verdict("rotating", scores)
    return Verdict("none", scores)


def _medians_of_the_others(values: Mapping[int, float]) -> dict[int, float]:
    """For each key, the median of the other keys' values: one sort, not one per key (1,000 groups)."""
    ordered = sorted(values.values())
    n = len(ordered) - 1

    def median_without(i: int) -> float:
        def kth(k: int) -> float:
            return ordered[k] if k < i else ordered[k + 1]
        return kth(n // 2) if n % 2 else (kth(n // 2 - 1) + kth(n // 2)) / 2

    return {g: median_without(bisect.bisect_left(ordered, v)) for g, v in values.items()}


def _stands_out(step: Mapping[int, float], factor: float) -> bool:
    """One group computed ``factor`` longer than the median of the others in this step."""
    g = max(step, key=step.get)
    return step[g] > factor * statistics.median(c for h, c in step.items() if h != g)


def eviction_pays(slowdown: float, groups: int) -> bool:
    """Keeping a straggler costs ``1 - 1/slowdown`` of the throughput, evicting it ``1/groups``."""
    return 1 - 1 / slowdown > 1 / groups


class StragglerTracker:
    """Keeps every training group's last ``window`` committed steps and judges them at most once
    every :data:`JUDGE_EVERY_S` of event time; returns the straggler events a change of verdict
    causes (flagged, cleared). Judging by the events' clock, not this server's, gives recorded
    events the verdicts they had live."""

    def __init__(self, window: int, factor: float, policy: Literal["flag", "evict"], flagged: int | None = None):
        """``flagged``: the group a previous run of the control plane left flagged (the board's)."""
        self.window = window
        self.factor = factor
        self.policy = policy
        self.samples: dict[int, deque[StepSample]] = {}
        self.best_s: dict[int, float] = {}
        self.verdict = Verdict("none", {})
        self.flagged = flagged
        self._judged_ts = float("-inf")

    def forget(self, group: int) -> None:
        """The group's processes ended or started again: its past says nothing of its next steps."""
        self.samples.pop(group, None)
        self.best_s.pop(group, None)

    def observe(self, event: Event) -> list[StragglerEvent]:
        match event:
            case ProcessEvent() | StartEvent() if speaks_for_group(event):
                self.forget(event.group)
                return self._clear(event.ts, "its processes ended or restarted") if event.group == self.flagged else []
            case StepEvent(committed=True, participating=True, healed=False) if speaks_for_group(event):
                window = self.samples.setdefault(event.group, deque(maxlen=self.window))
                window.append(StepSample(event.step, event.compute_s, event.allreduce_s))
                if len(window) == self.window:
                    median = statistics.median(s.compute_s for s in window)
                    self.best_s[event.group] = min(self.best_s.get(event.group, median), median)
                if event.ts < self._judged_ts + JUDGE_EVERY_S:
                    return []
                self._judged_ts = event.ts
                return self._judge(event.ts)
        return []

    def _judge(self, now: float) -> list[StragglerEvent]:
        full = {g: w for g, w in self.samples.items() if len(w) == self.window}
        self.verdict = judge(full, self.best_s, self.factor)
        if self.verdict.pattern == "persistent":
            if self.verdict.group == self.flagged:
                return []
            out = self._clear(now, f"group {self.verdict.group} is the straggler now") if self.flagged is not None else []
            return out + [self._flag(now, len(full))]
        scores = self.verdict.scores
        if self.flagged is not None and (self.flagged not in scores or scores[self.flagged].slowdown <= self.factor):
            return self._clear(now, f"computes within {self.factor:g}x of its peers again")
        return []

    def _flag(self, now: float, groups: int) -> StragglerEvent:
        v = self.verdict
        score = v.scores[v.group]
        self.flagged = v.group
        slowdown = v.slowdown or 1.0
        pays = eviction_pays(slowdown, groups)
        keep, evict = 1 - 1 / slowdown, 1 / groups
        side = (f"keeping it costs {keep:.0%} of the throughput, evicting it {evict:.0%}: "
                + ("evicting pays" if pays else "keeping it is cheaper"))
        action = "evict" if self.policy == "evict" and pays else "flag"
        return StragglerEvent(
            group=v.group, ts=now, action="flagged", policy_action=action, relative=score.relative,
            individual=score.individual, slowdown=slowdown, slowest_share=score.slowest_share,
            compute_s=score.compute_s, wait_s=score.wait_s, keep_cost=keep, evict_cost=evict,
            detail=f"computes {slowdown:.2f}x its peers' median and waits least, slowest in "
                   f"{score.slowest_share:.0%} of the last {self.window} steps; {side}")

    def _clear(self, now: float, why: str) -> list[StragglerEvent]:
        group, self.flagged = self.flagged, None
        return [StragglerEvent(group=group, ts=now, action="cleared", detail=why)]
