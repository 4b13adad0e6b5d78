"""The events a trainer rank writes, with plausible values: for the simulated groups, the ingest
load and the tests, which each change only the fields they are about."""

from __future__ import annotations

from typing import Any

from protocol.events import StepEvent

SEQ_LEN = 128
LOCAL_BATCH = 2


def step_fields(step: int, participants: int = 1, **overrides: Any) -> dict[str, Any]:
    """A committed step ``step`` (the manager's step after it) of a group that trained its share
    of a constant global batch split among ``participants`` groups."""
    batch, data_step = participants * LOCAL_BATCH, max(0, step - 1)
    fields = dict(step=step, committed=True, data_step=data_step, global_batch=batch, step_samples=batch, consumed=True,
                  sample_start=data_step * batch, samples=LOCAL_BATCH, tokens=LOCAL_BATCH * SEQ_LEN, loss=2.0,
                  lr=1e-3, step_s=0.3, compute_s=0.2, allreduce_s=0.05, commit_s=0.05, quorum_id=1,
                  participants=participants, participating=True, healed=False, batches_committed=step * participants)
    return {**fields, **overrides}


def step_event(group: int, step: int, ts: float, participants: int = 1, rank: int = 0, **overrides: Any) -> StepEvent:
    """Rank ``rank`` of ``group`` reports committed step ``step`` at ``ts`` (:func:`step_fields`)."""
    return StepEvent(group=group, rank=rank, ts=ts, **step_fields(step, participants, **overrides))


def start_fields(**overrides: Any) -> dict[str, Any]:
    """A rank's start: the job it trains and how long each stage of its start took."""
    fields = dict(pid=1, replica_id="group0:x", ranks_per_group=1, device="cpu", config="llama3_debugmodel_bytes",
                  model="llama3 debugmodel", dtype="fp32", tokenizer="bytes", dataset="stdlib", dataset_samples=65742,
                  seq_len=SEQ_LEN, local_batch_size=LOCAL_BATCH, global_batch_size=2 * LOCAL_BATCH,
                  batch_policy="constant", parameters=5, imports_s=1.0, process_group_s=1.0, data_s=1.0, model_s=1.0,
                  checkpoint_s=0.0, manager_s=1.0, resumed_step=0)
    return {**fields, **overrides}
