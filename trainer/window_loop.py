"""The training loop with ``--sync localsgd|diloco``: windows of inner steps, a sync after each.

Each inner step trains this group's share of one global batch, as the window assigned it
(``trainer/semi_sync.py``), and steps the inner optimizer; torchft's DiLoCo, hooked on that
optimizer, syncs after the window's last. What the window's steps did is known only then: their
step events are written at the sync, committed or not with it, so the control plane's coverage
and commit counts read them as they read ``hsdp``'s steps. A sync writes its own event
(:class:`protocol.events.SyncEvent`), and after a committed one each rank a fingerprint of the
last synced state (the same in every group) and, when due, the group a checkpoint.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext
from typing import Callable

from protocol.events import CommitFailedEvent, FingerprintEvent, SyncEvent
from trainer.semi_sync import SyncOutcome
from trainer.gradient_check import CheckResult
from trainer.train import RankTrainer, StepOutcome, StopRequest, _fmt


class WindowTrainer(RankTrainer):
    """:class:`trainer.train.RankTrainer` for ``--sync localsgd|diloco``."""

    def __init__(self, rank) -> None:
        super().__init__(rank)
        self.semi = rank.semi
        self.pending: list[StepOutcome] = []

    def train(self, stop: StopRequest) -> str:
        semi = self.semi
        while semi.step < self.cfg.steps:
            if self.stop_agreed(stop):
                return "stopped"
            if self.r.checkpointer:
                self._report_saved(self.r.checkpointer.poll())
            if semi.window is None or semi.window.slot is None:
                outcome = self.sync(stop, join=semi.join)
            else:
                self.pending.append(self.inner_step())
                outcome = self.sync(stop) if semi.synced_now else None
            if outcome is not None and (incident := outcome.mine(self.cfg.group)) is not None \
                    and incident.verdict == "persistent":
                self.quarantine(incident, outcome.checked_step)
                return "quarantined"
            if not self.r.manager.errored() and self.cfg.step_sleep_s:
                self.r.beacon.enter("idle")
                time.sleep(self.cfg.step_sleep_s)
                self.r.beacon.enter("compute")
        return "done"

    def inner_step(self) -> StepOutcome:
        """Forward and backward over this group's share of the next global batch, then the inner
        optimizer step (and the sync, when it is the window's last: timed apart)."""
        r, training, semi = self.r, self.training, self.semi
        start = time.perf_counter()
        window, step, data_step = semi.window, semi.step, training.position.data_step
        r.beacon.enter("compute", step)  # progress: the watchdog's clock starts again
        training.optimizers.zero_grad()
        r.hooks.stall(step)
        group = self.cfg.group if window.shares_of is None else window.shares_of
        share = training.plan.group_share(data_step, group, window.slot, window.size)
        loss = training.forward_backward(share, window.size, training.plan.loss_divisor(window.size, share))
        clip_norm = self._clip() if training.job.training.max_norm else None
        lr = training.live.lr()
        r.fence()
        ends_window = semi.local + 1 == semi.settings.every
        with r.watch.waiting() if ends_window and r.watch else nullcontext():
            training.optimizers.step()  # the post-hooks count the step; DiLoCo's syncs after the window's last
        return StepOutcome(
            trained_step=step, step=step + 1, committed=False, data_step=data_step,
            global_batch=training.plan.global_batch, step_samples=0, consumed=False, samples=share,
            tokens=len(share) * training.seq_len, loss=loss, lr=lr, step_s=time.perf_counter() - start,
            allreduce_s=0.0, commit_s=0.0, quorum_id=-1, participants=window.size, participating=True,
            healed=False, batches_committed=0, error=None, clip_norm=clip_norm)

    def sync(self, stop: StopRequest, join: Callable[[], None] | None = None) -> SyncOutcome:
        """Settle the sync the window's last step ran (``join``: run one first, to join the others
        at theirs) and report it; after a failed one, hold back while cut off from a peer."""
        r, semi = self.r, self.semi
        if join is not None:
            with r.watch.waiting() if r.watch else nullcontext():
                join()
        o = semi.settle(joined=join is not None)
        self.report_sync(o)
        if o.committed or o.skipped:
            self.sink.emit(FingerprintEvent, step=o.step, digest=semi.fingerprint())
            self.save_due(o.step - len(self.pending), o.step)
        self.pending = []
        if not o.committed:
            self.hold_back(stop)
        return o

    def report_sync(self, o: SyncOutcome) -> None:
        """The sync's events: a quorum change, a heal, the window's steps (committed or not with
        it), the sync itself; and a progress line."""
        quorum_id = self.r.internals.quorum_id
        participants = self.r.manager.num_participants()  # averaged at the sync: a healed group is not one
        self.note_quorum(quorum_id, o.step, o.window.size if o.window else participants, o.step)
        if o.healed:
            self._report_heal(o.step)
        step_samples = self.training.plan.step_samples(o.members_at_sync) if o.committed else 0
        if self.pending:  # the window's last step waited for the sync
            last = self.pending[-1]
            self.pending[-1] = dataclasses.replace(last, allreduce_s=min(o.seconds, last.step_s))
        used = o.committed or o.skipped  # a skipped window's samples are used up, trained by nobody
        skipped = CheckResult(False, o.incidents) if o.skipped else None
        for s in self.pending:
            self.emit_step(dataclasses.replace(
                s, committed=used, step=s.step if used else o.step, consumed=used, step_samples=step_samples,
                samples=s.samples if o.committed else range(s.samples.start, s.samples.start), check=skipped,
                quorum_id=quorum_id, batches_committed=self.r.manager.batches_committed()))
        self.report_incidents(o.incidents, o.checked_step, o.seconds, lambda i, ratio: (
            f"the window from step {o.checked_step}: group {i.group}'s pseudo-gradient norm was {ratio}; "
            f"trained again, its own {_fmt(i.rerun_norm)} on group {i.checker_group}'s shares and group "
            f"{i.checker_group}'s {_fmt(i.checker_norm)} on its shares: {i.verdict}"))
        self.sink.emit(SyncEvent, step=o.step, outer_step=o.outer_step, committed=o.committed, joined=o.joined,
                       fragment=o.fragment, seconds=o.seconds, bytes=o.bytes, drift=o.drift,
                       participants=participants, members=o.members_at_sync, quorum_id=quorum_id, healed=o.healed,
                       checked=self.semi.check is not None, skipped=o.skipped, error=o.error)
        if o.skipped:
            self._say(f"the window from step {o.checked_step} is skipped: its samples are abnormal in any group")
            return
        if not o.committed:
            first = self.pending[0].trained_step if self.pending else o.step
            self.sink.emit(CommitFailedEvent, step=first, quorum_id=quorum_id, error=o.error)
            self._say(f"sync after step {first + len(self.pending)} not committed ({o.error or 'too few replicas'}): "
                      f"back to step {o.step}, the window is trained again")
            return
        losses = [s.loss for s in self.pending if s.loss is not None]
        window_s = sum(s.step_s for s in self.pending)
        self._say(f"step {o.step:>5}  " + ("joined" if o.joined else f"loss {_fmt(losses[-1] if losses else None)}")
                  + f"  sync {o.outer_step} of {participants} group(s) in {o.seconds:.2f}s, "
                  f"{o.bytes * self.r.ranks / 2**20:.1f} MiB per group"
                  + (f", drift {o.drift:.3g}" if o.drift is not None else "")
                  + (f"  {(window_s - o.seconds) / len(self.pending):.2f}s/inner step" if self.pending else ""))
