"""Data coverage (service/controlplane/coverage.py): the decision on recorded steps, and the
ledger in a real SQLite store fed step events in the orders groups send them."""

from __future__ import annotations

from bench import events
from protocol.events import StepEvent
from service.controlplane.coverage import CoverageLedger, StepRecord, superseded, tally
from service.controlplane.db import Store

T0 = 1_800_000_000.0


def record(step: int, data_step: int, samples: int = 16, consumed: bool = True, quorum: int = 1,
           ts: float | None = None) -> StepRecord:
    return StepRecord(step=step, quorum_id=quorum, ts=T0 + step if ts is None else ts, data_step=data_step,
                      global_batch=16, step_samples=samples, consumed=consumed)


def test_a_batch_is_planned_once_used_up_and_its_first_applied_step_trains_it():
    assert tally([record(3, 3)]) == (16, 16, 0, 0)
    assert tally([record(3, 3, samples=0, consumed=False)]).planned == 0, "to be trained again: not planned yet"
    transient = [record(3, 3, samples=0, consumed=False), record(4, 3)]
    assert tally(transient) == (16, 16, 0, 0), "a step skipped for a bad chip trains its batch next step"
    assert tally([record(3, 3, samples=0, consumed=True)]) == (16, 0, 0, 16), "a batch the check blamed is skipped"
    assert tally([record(3, 3, samples=8)]) == (16, 8, 0, 8), "shrink: a missing group's half is skipped"
    assert tally([record(3, 3), record(4, 3)]) == (16, 0, 16, 0), "the same batch applied twice"


def test_a_step_committed_again_after_a_restore_replaces_the_lost_ones_but_a_late_report_does_not():
    before = [record(s, s, quorum=1) for s in range(5, 9)]
    again = record(6, 6, quorum=7, ts=T0 + 60)
    assert superseded(before, again) == [6, 7, 8], "every group died after step 8 and resumed at step 6"
    after = [*before[:1], again, record(7, 7, quorum=7, ts=T0 + 61)]
    late = record(7, 7, quorum=1, ts=T0 + 7)
    assert superseded(after, late) == [], "a report of the lost lineage that arrives late replaces nothing"
    assert superseded(before, record(8, 8, quorum=1)) == [], "the same quorum's report of the same step"


def step_event(group: int, step: int, data_step: int, ts: float, participants: int = 2, **fields) -> StepEvent:
    return events.step_event(group, step, ts, participants, **{
        **dict(global_batch=16, step_samples=16, data_step=data_step, sample_start=16 * data_step, samples=8), **fields})


def test_the_ledger_counts_each_step_once_whoever_reports_it_and_survives_a_restart(tmp_path):
    store = Store(tmp_path / "control.db")
    ledger = CoverageLedger(store)
    with store.transaction():
        for step in range(1, 6):
            for group in (1, 0):  # the groups' reports interleave
                ledger.observe(step_event(group, step, step - 1, T0 + step + group / 10))
        ledger.observe(step_event(0, 6, 5, T0 + 6, committed=False, step_samples=0, consumed=False))
        ledger.observe(StepEvent(**{**step_event(1, 6, 5, T0 + 6).model_dump(), "rank": 1}))
    assert ledger.totals() == (80, 80, 0, 0), "5 batches of 16; a failed commit and rank 1 add nothing"
    store.close()
    again = CoverageLedger(Store(tmp_path / "control.db"))
    assert again.totals() == (80, 80, 0, 0)


def test_shrink_counts_the_missing_groups_share_and_a_rollback_is_not_counted_twice(tmp_path):
    ledger = CoverageLedger(Store(tmp_path / "control.db"))
    with ledger.store.transaction():
        for step in range(1, 4):
            ledger.observe(step_event(0, step, step - 1, T0 + step, step_samples=16))
        ledger.observe(step_event(0, 4, 3, T0 + 4, step_samples=8, participants=1))  # group 1 down: its half skipped
        assert ledger.totals() == (64, 56, 0, 8)
        # every group died; both resumed from the checkpoint of step 2 and commit steps 3, 4 again
        for step, ts in ((3, T0 + 60), (4, T0 + 61)):
            for group in (0, 1):
                ledger.observe(step_event(group, step, step - 1, ts + group / 10, quorum_id=9))
    assert ledger.totals() == (64, 64, 0, 0)
