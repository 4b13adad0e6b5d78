"""The corruption drill (the seed's corrupt_grad): a wrong gradient in one group, and what it reaches.

Phases: ``baseline`` (every training group measures its update norms, told through its agent,
while normal steps go by), ``injected`` (the largest element of one gradient shard of one rank
of the group is multiplied by ``scale`` at its next step, or at every step with ``persistent``).
With the gradient check on, the drill waits for the check's verdict (``trainer/gradient_check.py``),
and after a persistent one for the quarantine and the warm spare's healed commit (``replacing``).
With the check off nothing flags it: the drill watches ``after_steps`` steps and finds the
corrupted step where the applied gradient norm peaks (with ``--sync localsgd|diloco``, the sync
where the group's pseudo-gradient norm, its drift, peaks). Last, ``fingerprints``: every group must
hold bitwise identical state, polluted or not (which is why fingerprints cannot see corruption).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field
from rich.text import Text

from protocol.events import (
    Event,
    FingerprintEvent,
    Flag,
    HealEvent,
    ProcessEvent,
    SdcEvent,
    StepEvent,
    SyncEvent,
    Verdict,
)
from protocol.injection import InjectRequest
from service.controlplane.drills.base import (
    MAX_ID,
    Drill,
    DrillBody,
    GroupField,
    Prepared,
    TimeoutField,
    require_rank,
    require_training_with_another,
)
from service.controlplane.drills.context import DrillServices
from service.controlplane.drills.rows import EQUAL, Row, norm, per_group, shown
from service.controlplane.fingerprints import FingerprintBook

WATCH_MARGIN_S = 120.0
"""The groups measure their updates this long past the baseline: the drill's other phases."""


class CorruptIn(DrillBody):
    """Corrupt one gradient element on one rank of a group, once or every step; the gradient
    check must skip the step everywhere and attribute it (with the check off: see it applied)."""

    kind: Literal["corrupt"]
    group: int = GroupField
    scale: float = Field(1e4, ge=-1e30, le=1e30, description="the factor the element is multiplied by")
    persistent: Flag = Field(False, description="every step, as a bad chip would (default: once)")
    rank: int = Field(0, ge=0, le=MAX_ID, description="the rank whose gradient is corrupted")
    baseline_s: float = Field(5.0, gt=0, le=3600, description="normal steps watched before")
    after_steps: int = Field(5, ge=1, le=1000, description="steps watched after the corrupted one")
    timeout_s: float | None = TimeoutField


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
    sdc_check: bool | None = Field(None, description="whether the job runs with the gradient check (seen in its steps, "
                                   "or its syncs with --sync localsgd|diloco)")
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


class Corrupt(Drill):
    """Runs one corruption drill against the live job; the runner persists ``report`` as it goes."""

    kind = "corrupt"
    Request = CorruptIn
    Report = CorruptReport
    summary = "corrupt one gradient element of one rank, once or every step; the gradient check must catch it"

    @classmethod
    def prepare(cls, request: CorruptIn, services: DrillServices) -> Prepared:
        require_rank(services, request.group, request.rank)
        require_training_with_another(services, request.group, "the corruption drill (the check compares groups)")
        return Prepared(group=request.group, report=CorruptReport(**request.model_dump(exclude={"kind", "timeout_s"})))

    @classmethod
    def title(cls, drill: dict) -> str:
        r = drill["report"]
        return (f"corrupt · group {r['group']} rank {r['rank']} ×{r['scale']:g} "
                f"{'every step' if r['persistent'] else 'once'} · check "
                f"{ {True: 'on', False: 'OFF', None: '?'}[r.get('sdc_check')] }")

    @classmethod
    def rows(cls, r: dict) -> list[Row]:
        rows: list[Row] = [("phase", r.get("phase")), ("corrupted step", shown(r.get("step")))]
        if r.get("sdc_check"):
            found = r.get("detected_group")
            rows.append(("flagged", "nobody" if found is None else Text(
                f"group {found}, verdict after {r['detect_s']:.2f} s", style="green" if found == r["group"] else "red")))
            if r.get("norms"):
                rows += [("norms", ", ".join(f"g{g} {norm(n)}" for g, n in sorted(r["norms"].items()))
                          + f" (others' median {norm(r.get('reference_norm'))})"),
                         ("reruns", f"its own {norm(r.get('rerun_norm'))}; group {r.get('checker_group')}'s of its "
                                    f"batch {norm(r.get('checker_norm'))}")]
            rows.append(("verdict", Text(r.get("verdict") or "-", style="bold")))
        rows.append(("action", r.get("action") or "-"))
        if r.get("replace_s") is not None:
            rows.append(("quarantine → spare's healed commit", f"{r['replace_s']:.2f} s"))
        return rows + [
            ("largest update / usual", per_group(r.get("update_ratio") or {}, ".3g")),
            ("largest applied gradient / usual", per_group(r.get("applied_grad_ratio") or {}, ".3g")),
            ("loss after − before", per_group(r.get("loss_change") or {}, "+.3f")),
            ("fingerprints equal", EQUAL.get(r.get("fingerprints_equal"), "-")),
        ]

    @classmethod
    def problem(cls, r: dict) -> str | None:
        if r["sdc_check"] and r["detected_group"] != r["group"]:
            found = "nobody" if r["detected_group"] is None else f"group {r['detected_group']}"
            return (f"the gradient check flagged {found}, not group {r['group']}; a --scale this small may hide in "
                    "the norm: try a larger one")
        return super().problem(r)

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.ranks = self.ctx.settings.ranks_per_group
        self.steps: dict[tuple[int, int], _GroupStep] = {}
        self.fingerprints = FingerprintBook()
        self.groups: set[int] = set()
        self.healed = False
        self.stepped = False
        self.drifts: list[tuple[float, int]] = []
        """(drift, step) of the group's syncs since the injection (--sync localsgd|diloco)"""

    def _observe_step(self, e: StepEvent) -> None:
        trained = e.step - 1 if e.committed else e.step
        row = self.steps.setdefault((e.group, trained), _GroupStep())
        row.shard_grad[e.rank], row.shard_update[e.rank] = e.shard_grad_norm, e.shard_update_norm
        if e.rank == 0:
            # a healing or sitting-out step's forward ran on the state before the heal: its loss is not the job's
            row.loss = e.loss if e.participating and not e.healed else None
            row.skipped, row.grad_norm = e.skipped, e.grad_norm
            self.stepped = True
            if e.grad_norm is not None:
                self.r.sdc_check = True

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
            case SyncEvent(rank=0, joined=False):
                r.sdc_check = e.checked
                if e.group == r.group and r.injected_at is not None and e.ts >= r.injected_at and e.drift is not None:
                    self.drifts.append((e.drift, e.step))
            case ProcessEvent(action="quarantined") if e.group == r.group:
                r.quarantined_at = e.ts
            case HealEvent(rank=0) if e.group == r.group and r.quarantined_at is not None:
                self.healed = True
            case FingerprintEvent():
                self.fingerprints.add(e)

    def _last_step(self) -> int:
        return max((step for g, step in self.steps if g == self.r.group), default=-1)

    async def run(self) -> None:
        ctx, r = self.ctx, self.r
        queue = ctx.bus.subscribe()
        try:
            self.groups = set(ctx.control.board.training())
            watch = InjectRequest(kind="watch", seconds=r.baseline_s + WATCH_MARGIN_S + 3 * self.timeout_s)
            for g in sorted(self.groups):
                await ctx.control.inject(g, watch, ctx.drill_id)
            await self.watch(queue, "baseline", r.baseline_s)
            await self.until(queue, lambda: self.stepped, f"a step of group {r.group} (a sync, with --sync "
                             "localsgd|diloco) to learn whether the gradient check is on")
            r.sdc_check = bool(r.sdc_check)
            r.phase = "injected"
            first_after = self._last_step() + 1
            injected = await ctx.control.inject(
                r.group, InjectRequest(kind="corrupt", rank=r.rank, scale=r.scale, persistent=r.persistent,
                                       seconds=3 * self.timeout_s), ctx.drill_id)
            r.injected_at = injected.at
            ctx.save()
            if r.sdc_check:
                await self.until(queue, lambda: r.verdict is not None, f"the gradient check's verdict on group {r.group}")
                if r.verdict == "persistent":
                    r.phase = "replacing"
                    await self.until(queue, lambda: r.replaced_at is not None,
                                     f"group {r.group}'s warm spare to replace it and commit a healed step")
            await self.until(queue, lambda: self._last_step() >= max(first_after, r.step or 0) + r.after_steps,
                             f"{r.after_steps} steps of group {r.group} after the corruption")
            self._measure(first_after)
            r.phase = "fingerprints"
            ctx.save()
            await self.until(queue, lambda: self._fingerprint_step() is not None,
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
            peaks += [(drift, step - 1) for drift, step in self.drifts]
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
