"""The corruption drill (the seed's corrupt_grad): a wrong gradient in one group, and what it reaches.

Phases: ``baseline`` (every training group measures its update norms, told through its agent,
while normal steps go by), ``injected`` (the largest element of one gradient shard of one rank
of the group is multiplied by ``scale`` at its next step, or at every step with ``persistent``).
With the gradient check on, the drill waits for the check's verdict (``trainer/gradient_check.py``),
and after a persistent one for the quarantine and the warm spare's healed commit (``replacing``).
With the check off nothing flags it: the drill watches ``after_steps`` steps and finds the
corrupted step where the applied gradient norm peaks. Last, ``fingerprints``: every group must
hold bitwise identical state, polluted or not (which is why fingerprints cannot see corruption).
"""

from __future__ import annotations

import asyncio
import math
import statistics
from dataclasses import dataclass, field

from protocol.events import Event, FingerprintEvent, HealEvent, ProcessEvent, SdcEvent, StepEvent
from protocol.injection import InjectRequest
from service.controlplane.bus import StoredEvent
from service.controlplane.drill_context import DrillContext
from service.controlplane.errors import DrillConflict
from service.controlplane.fingerprints import FingerprintBook
from service.controlplane.models import CorruptReport, CorruptStep

WATCH_MARGIN_S = 120.0
"""The groups measure their updates this long past the baseline: the drill's other phases."""


@dataclass
class _GroupStep:
    loss: float | None = None
    skipped: bool = False
    grad_norm: float | None = None
    shard_grad: dict[int, float | None] = field(default_factory=dict)
    shard_update: dict[int, float | None] = field(default_factory=dict)


def _root_of_squares(shards: dict[int, float | None], ranks: int) -> float | None:
    if len(shards) < ranks or any(v is None for v in shards.values()):
        return None
    return math.sqrt(sum(v * v for v in shards.values()))


def _ratio(values_before: list[float], values_from: list[float]) -> float | None:
    if not values_before or not values_from or statistics.median(values_before) == 0:
        return None
    return max(values_from) / statistics.median(values_before)


class CorruptRun:
    """Runs one corruption drill against the live job; the runner persists ``report`` as it goes."""

    def __init__(self, ctx: DrillContext, report: CorruptReport, timeout_s: float):
        self.ctx = ctx
        self.r = report
        self.timeout_s = timeout_s
        self.ranks = ctx.settings.ranks_per_group
        self.steps: dict[tuple[int, int], _GroupStep] = {}
        self.fingerprints = FingerprintBook()
        self.groups: set[int] = set()
        self.healed = False

    def _observe_step(self, e: StepEvent) -> None:
        trained = e.step - 1 if e.committed else e.step
        row = self.steps.setdefault((e.group, trained), _GroupStep())
        row.shard_grad[e.rank], row.shard_update[e.rank] = e.shard_grad_norm, e.shard_update_norm
        if e.rank == 0:
            # a healing or sitting-out step's forward ran on the state before the heal: its loss is not the job's
            row.loss = e.loss if e.participating and not e.healed else None
            row.skipped, row.grad_norm = e.skipped, e.grad_norm
            if self.r.sdc_check is None:
                self.r.sdc_check = e.grad_norm is not None

    def _observe_sdc(self, e: SdcEvent) -> None:
        r = self.r
        if r.detected_group is not None or r.injected_at is None or e.ts < r.injected_at:
            return
        r.detected_group, r.step, r.detect_s = e.group, e.step, e.ts - r.injected_at
        r.norms = {str(g): n for g, n in e.norms.items()}
        r.reference_norm, r.rerun_norm = e.reference_norm, e.rerun_norm
        r.checker_group, r.checker_norm, r.verdict, r.action = e.checker_group, e.checker_norm, e.verdict, e.action

    def observe(self, e: Event) -> None:
        r = self.r
        match e:
            case StepEvent():
                self._observe_step(e)
                if self.healed and e.group == r.group and e.rank == 0 and e.committed and r.replaced_at is None:
                    r.replaced_at = e.ts
                    r.replace_s = e.ts - r.quarantined_at
            case SdcEvent():
                self._observe_sdc(e)
            case ProcessEvent(action="quarantined") if e.group == r.group:
                r.quarantined_at = e.ts
            case HealEvent(rank=0) if e.group == r.group and r.quarantined_at is not None:
                self.healed = True
            case FingerprintEvent():
                self.fingerprints.add(e)

    async def _until(self, queue: asyncio.Queue[StoredEvent], done, what: str) -> None:
        if not done():
            await self.ctx.bus.wait_for(queue, lambda e: (self.observe(e), done())[1], self.timeout_s, what)
        self.ctx.save()

    async def _phase(self, queue: asyncio.Queue[StoredEvent], name: str, seconds: float) -> None:
        self.r.phase = name
        self.ctx.save()
        try:
            await self.ctx.bus.wait_for(queue, lambda e: (self.observe(e), False)[1], seconds, name)
        except TimeoutError:
            pass

    def _last_step(self) -> int:
        return max((step for g, step in self.steps if g == self.r.group), default=-1)

    async def run(self) -> None:
        ctx, r = self.ctx, self.r
        queue = ctx.bus.subscribe()
        try:
            self.groups = {g for g, v in ctx.control.board.views.items() if v.state == "training"}
            watch = InjectRequest(kind="watch", seconds=r.baseline_s + WATCH_MARGIN_S + 3 * self.timeout_s)
            for g in sorted(self.groups):
                await ctx.control.inject(g, watch, ctx.drill_id)
            await self._phase(queue, "baseline", r.baseline_s)
            if r.sdc_check is None:
                raise DrillConflict(f"group {r.group} reported no step in {r.baseline_s:g} s of baseline")
            r.phase = "injected"
            first_after = self._last_step() + 1
            injected = await ctx.control.inject(
                r.group, InjectRequest(kind="corrupt", rank=r.rank, scale=r.scale, persistent=r.persistent,
                                       seconds=3 * self.timeout_s), ctx.drill_id)
            r.injected_at = injected.at
            ctx.save()
            if r.sdc_check:
                await self._until(queue, lambda: r.verdict is not None, f"the gradient check's verdict on group {r.group}")
                if r.verdict == "persistent":
                    r.phase = "replacing"
                    await self._until(queue, lambda: r.replaced_at is not None,
                                      f"group {r.group}'s warm spare to replace it and commit a healed step")
            await self._until(queue, lambda: self._last_step() >= max(first_after, r.step or 0) + r.after_steps,
                              f"{r.after_steps} steps of group {r.group} after the corruption")
            self._measure(first_after)
            r.phase = "fingerprints"
            ctx.save()
            await self._until(queue, lambda: self._fingerprint_step() is not None,
                              "a fingerprint of every rank of every group at one step after the corruption")
            r.fingerprint_step = self._fingerprint_step()
            r.fingerprints_equal = self.fingerprints.equal_at(r.fingerprint_step)
        finally:
            ctx.bus.unsubscribe(queue)

    def _fingerprint_step(self) -> int | None:
        after = max(self.r.step or 0, self._last_step() - self.r.after_steps) + 1
        return self.fingerprints.complete_step(self.groups, self.ranks, after)

    def _measure(self, first_after: int) -> None:
        """The rows around the step, and each group's jump in update, applied gradient and loss."""
        r = self.r
        rows = {key: self._row(*key, s) for key, s in self.steps.items()}
        if r.step is None:  # no check: the step where the applied gradient norm peaked
            peaks = [(row.applied_grad_norm, step) for (g, step), row in rows.items()
                     if g == r.group and step >= first_after and row.applied_grad_norm is not None]
            r.step = max(peaks)[1] if peaks else None
            r.action = "applied" if peaks else None
        if r.step is None:
            return
        r.steps = [row for (g, step), row in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0]))
                   if r.step - 3 <= step <= r.step + r.after_steps]
        for g in sorted(self.groups):
            mine = {step: row for (group, step), row in rows.items() if group == g}
            before = [row for step, row in mine.items() if step < first_after]
            since = [row for step, row in mine.items() if step >= r.step]

            def values(rows_: list[CorruptStep], name: str) -> list[float]:
                return [v for row in rows_ if (v := getattr(row, name)) is not None and math.isfinite(v)]

            r.update_ratio[str(g)] = _ratio(values(before, "update_norm"), values(since, "update_norm"))
            r.applied_grad_ratio[str(g)] = _ratio(values(before, "applied_grad_norm"), values(since, "applied_grad_norm"))
            after_losses = values([row for step, row in mine.items() if step > r.step], "loss")
            before_losses = values(before, "loss")
            r.loss_change[str(g)] = (statistics.mean(after_losses) - statistics.mean(before_losses)
                                     if after_losses and before_losses else None)

    def _row(self, group: int, step: int, s: _GroupStep) -> CorruptStep:
        return CorruptStep(step=step, group=group, loss=s.loss, skipped=s.skipped, grad_norm=s.grad_norm,
                           applied_grad_norm=_root_of_squares(s.shard_grad, self.ranks),
                           update_norm=_root_of_squares(s.shard_update, self.ranks))
