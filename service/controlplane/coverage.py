"""Data coverage: which samples of the job's global order committed steps trained, and how often.

Every committed step event says which data step (global batch) it trained, whether its update was
applied, how many of the batch's samples that update trained over every group (``step_samples``)
and whether the batch was used up (``consumed``: not trained again next step). Every group of
the step's quorum says the same of the step, so the first report of a step is its record; a
group whose last events died with it (a SIGKILL right after the commit) loses nothing here.

A global batch is *planned* once a step consumed it. Its first applied step trained
``step_samples`` of it (all of it with ``--batch-policy constant``); the rest were *skipped*
(the shares of groups missing with ``shrink``; a batch the gradient check blamed); a later
applied step of the same batch trained samples *twice* (never, unless something is wrong).

A job that loses every group resumes from its newest checkpoint and commits the same step
numbers again: what the steps from there had trained was rolled back with them, so a step
reported again from another quorum, newer than the records of that step and later, replaces
them (:func:`superseded`).

:func:`tally` is the whole decision for one global batch, a pure function tested on recorded
steps; :class:`CoverageLedger` keeps the records and each batch's tally in SQLite, beside the
events they came from, so the figures survive a control-plane restart and the events' retention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pydantic import BaseModel, Field

from protocol.events import Event, StartEvent, StepEvent, speaks_for_group
from service.controlplane.db import Store


@dataclass(frozen=True)
class StepRecord:
    """What a committed step did to its global batch."""

    step: int
    """the step trained (the manager's step before the commit)"""
    quorum_id: int
    ts: float
    data_step: int
    global_batch: int
    step_samples: int
    consumed: bool


class Tally(NamedTuple):
    """Samples of global batches: planned = once + twice + skipped."""

    planned: int
    once: int
    twice: int
    skipped: int


def tally(records: list[StepRecord]) -> Tally:
    """One global batch's coverage from the records of the steps that trained it, in step order."""
    consumed = any(r.consumed for r in records)
    if not consumed:
        return Tally(0, 0, 0, 0)  # still being trained: not planned yet
    batch = max(r.global_batch for r in records)
    applied = [min(batch, r.step_samples) for r in records if r.step_samples > 0]
    first = applied[0] if applied else 0
    again = min(first, sum(applied[1:]))
    return Tally(planned=batch, once=first - again, twice=again, skipped=batch - first)


def superseded(known: list[StepRecord], new: StepRecord) -> list[int]:
    """The steps whose records ``new`` replaces: those of its step and later, from another quorum,
    older than it. A step re-committed after every group resumed from a checkpoint comes seconds
    after the lost ones; a lagging group's report of an earlier step is older than the later
    steps' records, and a report from the same quorum is the same step."""
    return [r.step for r in known if r.step >= new.step and r.quorum_id != new.quorum_id and r.ts < new.ts]


def record_of(event: StepEvent) -> StepRecord:
    return StepRecord(step=event.step - 1, quorum_id=event.quorum_id, ts=event.ts, data_step=event.data_step,
                      global_batch=event.global_batch, step_samples=event.step_samples, consumed=event.consumed)


RATE_WINDOW_S = 60.0
"""The job's training rate is measured over its committed steps of the last minute."""


def samples_rate(steps: list[tuple[float, int]]) -> float | None:
    """Samples per second over (time, samples) of consecutive committed steps: every step's
    samples but the first's, over the time from the first to the last (None: under two steps)."""
    if len(steps) < 2 or steps[-1][0] <= steps[0][0]:
        return None
    return sum(samples for _, samples in steps[1:]) / (steps[-1][0] - steps[0][0])


class CoverageLedger:
    """The records of committed steps and each global batch's tally, in the control plane's store."""

    def __init__(self, store: Store):
        self.store = store

    def observe(self, event: Event) -> None:
        """Fold in a committed step event (rank 0's: it speaks for its group). Call inside the
        store's transaction that stores the event."""
        if not (isinstance(event, StepEvent) and event.committed and speaks_for_group(event)):
            return
        new = record_of(event)
        known = [StepRecord(**row) for row in self.store.step_records(since_step=new.step)]
        if any(r.step == new.step and r.quorum_id == new.quorum_id for r in known):
            return  # another group's report of the same step
        gone = superseded(known, new)
        if any(r.step == new.step for r in known) and new.step not in gone:
            return  # a stale report of a step already recorded from a newer quorum
        touched = {r.data_step for r in known if r.step in gone} | {new.data_step}
        self.store.replace_step_records(gone, new)
        for data_step in touched:
            t = tally([StepRecord(**row) for row in self.store.step_records(data_step=data_step)])
            self.store.set_coverage(data_step, t.planned, t.once, t.twice, t.skipped)

    def totals(self) -> Tally:
        return Tally(**self.store.coverage_totals())

    def samples_per_s(self, now: float, window_s: float = RATE_WINDOW_S) -> float | None:
        """Samples the committed steps of the last ``window_s`` trained, per second."""
        return samples_rate(self.store.steps_since(now - window_s))


class JobDataOut(BaseModel):
    """The job's data as its groups' start events describe it (the newest start of a rank 0)."""

    config: str
    model: str
    dtype: str
    tokenizer: str
    dataset: str
    dataset_samples: int = Field(description="samples in one epoch of the tokenized dataset")
    seq_len: int
    global_batch_size: int
    local_batch_size: int
    batch_policy: str
    steps: int | None = Field(None, description="the step the job trains to (--steps)")


class DataOut(BaseModel):
    job: JobDataOut | None = Field(description="null until a group has started")
    samples_planned: int = Field(description="samples of every global batch a committed step used up")
    trained_once: int = Field(description="samples a committed step trained exactly once")
    trained_twice: int = Field(description="samples committed steps trained more than once (0 unless something is "
                               "wrong)")
    skipped: int = Field(description="planned samples no committed step trained: the shares of missing groups with "
                         "--batch-policy shrink, batches the gradient check blamed")
    tokens_trained: int = Field(description="tokens of the samples trained (once or more)")
    epochs: float | None = Field(description="samples planned over the samples of one epoch")
    tokens_per_s: float | None = Field(description="tokens the committed steps of the last minute trained, per "
                                       "second (null: fewer than two steps in it)")


def data_out(ledger: CoverageLedger, start: StartEvent | None, now: float) -> DataOut:
    t = ledger.totals()
    job = JobDataOut(**start.model_dump(include=set(JobDataOut.model_fields))) if start else None
    rate = ledger.samples_per_s(now)
    return DataOut(job=job, samples_planned=t.planned, trained_once=t.once, trained_twice=t.twice,
                   skipped=t.skipped, tokens_trained=(t.once + t.twice) * (job.seq_len if job else 0),
                   epochs=t.planned / job.dataset_samples if job and job.dataset_samples else None,
                   tokens_per_s=rate * job.seq_len if job and rate is not None else None)
