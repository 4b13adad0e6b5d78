"""The training loop of one rank of one replica group (run under torchrun, or forked by a zygote).

:func:`trainer.rank.build_rank` builds what the loop drives; the loop reads as its concerns:
:meth:`RankTrainer.step` trains one step and returns what happened (:class:`StepOutcome`);
:meth:`RankTrainer.report` turns that into events and progress lines; after a committed step the
fingerprinter and the checkpointer each decide, on their own interval, whether it is their turn.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from protocol.events import (
    CheckpointEvent,
    CommitFailedEvent,
    ExitEvent,
    FingerprintEvent,
    HealEvent,
    QuorumEvent,
    SdcEvent,
    StepEvent,
)
from protocol.files import write_model
from protocol.lighthouse import lighthouse_unreachable
from protocol.quarantine import Quarantine, quarantine_file
from trainer.checkpoint import Saved
from trainer.config import TrainerConfig
from trainer.data import next_data_step
from trainer.fault_tolerance import LIGHTHOUSE_PROBE_TIMEOUT_S
from trainer.gradient_check import CheckResult, Incident, against_others, group_norm, shard_norm
from trainer.rank import Rank, build_rank
from trainer.state import LiveState, local
from trainer.telemetry import EventSink

log = logging.getLogger("trainer")
LIGHTHOUSE_AWAY_EXIT = 75
"""EX_TEMPFAIL: the rank stopped because the Lighthouse is away, not because it failed."""


@dataclass
class StopRequest:
    """SIGTERM/SIGINT: finish the step in flight, then leave cleanly."""

    requested: bool = False
    signals: tuple[int, ...] = field(default=(signal.SIGTERM, signal.SIGINT))

    def install(self) -> None:
        for sig in self.signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True


@dataclass(frozen=True)
class StepOutcome:
    """What one step did, as torchft settled it. ``trained_step`` is the manager step whose
    batch it trained; ``step`` the manager step after it (one more when it committed)."""

    trained_step: int
    step: int
    committed: bool
    data_step: int
    global_batch: int
    step_samples: int
    """samples of the global batch the step trained over every group (0: no optimizer step)"""
    consumed: bool
    """the data position moved on: the batch is not trained again"""
    samples: range
    """the global samples this group trained (empty when it did not take part)"""
    tokens: int
    loss: float | None
    """this rank's mean token loss; None when it trained no sample"""
    lr: float
    step_s: float
    allreduce_s: float
    commit_s: float
    quorum_id: int
    participants: int
    participating: bool
    healed: bool
    batches_committed: int
    error: str | None
    check: CheckResult | None = None
    grad_norm: float | None = None
    clip_norm: float | None = None
    shard_grad_norm: float | None = None
    shard_update_norm: float | None = None

    @property
    def skipped(self) -> bool:
        """Committed without an optimizer step: a gradient failed the check."""
        return self.committed and self.check is not None and not self.check.passed

    @property
    def compute_s(self) -> float:
        """Forward, backward and optimizer (and a failed check's reruns): the step minus its waits."""
        return max(0.0, self.step_s - self.allreduce_s - self.commit_s)

    @property
    def rerun_s(self) -> float:
        return self.check.rerun_s if self.check else 0.0

    @property
    def healed_step(self) -> int:
        """The step the healed state was taken at."""
        return self.step - 1 if self.committed else self.step


class Fingerprinter:
    """Every ``every`` committed steps, a digest of this rank's shards (protocol: FingerprintEvent)."""

    def __init__(self, live: LiveState, sink: EventSink, every: int):
        self.live = live
        self.sink = sink
        self.every = every

    def after_commit(self, step: int) -> None:
        if step % self.every == 0:
            self.sink.emit(FingerprintEvent, step=step, digest=self.live.fingerprint())


class RankTrainer:
    """The training loop of one rank: :func:`trainer.rank.build_rank` built what it drives."""

    def __init__(self, rank: Rank):
        self.r = rank
        self.cfg = rank.cfg
        self.training = rank.training
        self.sink = rank.sink
        self.fingerprinter = Fingerprinter(rank.training.live, rank.sink, rank.cfg.fingerprint_every)
        self.quorum_id = -1  # the quorum the last reported step trained in
        self._left_quorum = False

    def _say(self, message: str) -> None:
        self.r.say(message)

    def _share(self, data_step: int) -> tuple[range, int]:
        """This group's samples at ``data_step``, and how many groups the split is among. With the
        ``constant`` policy the split follows the step's quorum, so the rank waits for it here
        (a wait on other groups); ``shrink`` needs only the group's own number."""
        manager, plan, group = self.r.manager, self.training.plan, self.cfg.group
        if plan.policy == "shrink":
            return plan.group_share(data_step, group, group, self.cfg.groups), self.cfg.groups
        self.r.beacon.enter("allreduce")
        participants = manager.num_participants()
        slot = manager.participating_rank() if manager.is_participating() else None
        self.r.beacon.enter("compute")
        return plan.group_share(data_step, group, slot, participants), participants

    def step(self) -> StepOutcome:
        """Train one step: quorum, forward and backward over this group's share of the global
        batch, the gradient check (when on), the gradients averaged across groups, and the
        optimizer step only if every rank of every group succeeded and every group's gradient
        passed the check."""
        r, training = self.r, self.training
        manager = r.manager
        start = time.perf_counter()
        before = manager.current_step()
        data_step = training.position.data_step
        r.beacon.enter("allreduce", before)  # torchft's start_quorum waits for the last quorum: other groups
        r.ft_optimizer.zero_grad()
        r.beacon.enter("compute")
        r.replicate.begin()
        r.hooks.stall(before)
        share, split_among = self._share(data_step)
        sync_only = self.cfg.init_sync and before == 0  # torchft copies one group's weights: nobody trains
        if sync_only:
            share = range(share.start, share.start)
        loss = training.forward_backward(share, split_among, training.plan.loss_divisor(split_among, share))
        check, grad_norm = None, None
        if r.check is not None:
            grad_norm = group_norm(r.replicate.shard_gradients(training.model), training.device)
            check = r.check.check(grad_norm, lambda group, other: self._rerun(data_step, group, other))
        if check is None or check.passed:
            r.replicate.finish()
        healed = r.internals.healing  # settled: the all-reduce waited for the quorum
        apply = (check is None or check.passed) and not sync_only
        clip_norm = self._clip() if apply and training.job.training.max_norm else None
        watched = r.hooks.watched and apply
        shard_grad_norm = shard_norm(r.replicate.shard_gradients(training.model)) if watched else None
        params = [local(p).detach() for p in training.model.parameters()] if watched else []
        was = [p.clone() for p in params]
        commit_start = time.perf_counter()
        r.beacon.enter("commit")
        if manager.should_commit() and apply:
            r.fence()
            training.optimizers.step()
        commit_s = time.perf_counter() - commit_start
        r.beacon.enter("compute")
        after = manager.current_step()
        committed = after > before
        participants = manager.num_participants()  # shrink split without waiting for the quorum: settled now
        contributed = manager.is_participating() and not healed and not sync_only
        data_step = training.position.data_step  # a heal, applied at the commit, loaded the step's own
        consumed = False
        if committed:
            training.schedulers.step()
            training.position.data_step = next_data_step(data_step, apply, check.verdict if check else None)
            consumed = training.position.data_step > data_step
        trained = share if contributed else range(share.start, share.start)
        return StepOutcome(
            trained_step=before, step=after, committed=committed, data_step=data_step,
            global_batch=training.plan.global_batch,
            step_samples=training.plan.step_samples(participants) if committed and apply else 0, consumed=consumed,
            samples=trained, tokens=len(trained) * training.seq_len, loss=loss if contributed else None,
            lr=training.live.lr(),
            step_s=time.perf_counter() - start,
            allreduce_s=r.replicate.seconds + (check.wait_s if check else 0.0), commit_s=commit_s,
            quorum_id=r.internals.quorum_id, participants=participants, participating=manager.is_participating(),
            healed=healed, batches_committed=manager.batches_committed(),
            error=repr(manager.errored().original_exception) if manager.errored() else None,
            check=check, grad_norm=grad_norm, clip_norm=clip_norm, shard_grad_norm=shard_grad_norm,
            shard_update_norm=shard_norm(torch._foreach_sub(params, was)) if watched else None,
        )

    def _rerun(self, data_step: int, group: int, slot: int) -> float:
        """The gradient check's rerun: recompute, from the unchanged state, the gradient of the
        share group ``group`` (participating rank ``slot``) trained, and its norm in this group."""
        training, manager = self.training, self.r.manager
        training.optimizers.zero_grad()  # the inner optimizers': torchft's would start a quorum
        self.r.replicate.begin()
        participants = manager.num_participants()
        share = training.plan.group_share(data_step, group, slot, participants)
        training.forward_backward(share, participants, training.plan.loss_divisor(participants, share))
        return group_norm(self.r.replicate.shard_gradients(training.model), training.device)

    def _clip(self) -> float:
        """Clip by the norm of the averaged gradient, as torchtitan does: it is the same in every
        group (every group holds the same average), so every group clips alike."""
        model = self.training.model
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, foreach=True)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), self.training.job.training.max_norm, total,
                                             foreach=True)
        return total.item()

    def _report_heal(self, step: int) -> None:
        live, fetch, r = self.training.live, self.r.transport.last_fetch, self.r
        found = [r.peers.groups.get(url, live.last_source_group) for url in fetch.sources]
        sources = [group for group in found if group is not None]  # a replica name without a group id
        self.sink.emit(HealEvent, step=step, source_group=live.last_source_group, sources=sources,
                       source_failures=len(fetch.failed), bytes=fetch.bytes, quorum_at=r.internals.quorum_answered_at(),
                       fetch_started_at=fetch.started_at, header_s=fetch.header_s, transfer_s=fetch.transfer_s,
                       checksum_s=fetch.checksum_s, fetch_s=fetch.seconds, load_s=live.last_load_s,
                       applied_at=live.last_applied_at)
        self._say(f"healed at step {step} from group(s) {', '.join(map(str, sources))}: {fetch.bytes / 2**20:.1f} MiB "
                  f"in {fetch.transfer_s:.2f}s ({fetch.bytes / 2**30 / max(fetch.transfer_s, 1e-9):.2f} GiB/s), "
                  f"applied in {live.last_load_s:.2f}s"
                  + (f"; {len(fetch.failed)} source(s) dropped: {fetch.failed}" if fetch.failed else ""))

    def note_quorum(self, quorum_id: int, step: int, participants: int, at_step: int) -> None:
        """A quorum event and line when the quorum changed."""
        if quorum_id != self.quorum_id:
            self.sink.emit(QuorumEvent, quorum_id=quorum_id, previous_quorum_id=self.quorum_id, step=step,
                           participants=participants)
            self._say(f"quorum {quorum_id}: {participants} group(s) training at step {at_step}")
            self.quorum_id = quorum_id

    def report(self, o: StepOutcome) -> None:
        """The step's events (quorum change, heal, the step, a failed commit) and its progress line."""
        self.note_quorum(o.quorum_id, o.step, o.participants, o.trained_step)
        if o.healed:
            self._report_heal(o.healed_step)
        self.emit_step(o)
        if o.check is not None and o.check.incidents:
            self._report_incidents(o)
        if not o.committed:
            self.sink.emit(CommitFailedEvent, step=o.trained_step, quorum_id=o.quorum_id, error=o.error)
            self._say(f"step {o.trained_step} not committed: {o.error or 'too few replicas'}")
        elif o.step % self.cfg.log_every == 0:
            self._say(f"step {o.step:>5}  loss {_fmt(o.loss)}  {o.participants} group(s)  "
                      f"{len(o.samples)} samples  {o.step_s:.2f}s/step (all-reduce {o.allreduce_s:.2f}s)")

    def emit_step(self, o: StepOutcome) -> None:
        self.sink.emit(
            StepEvent, step=o.step, committed=o.committed, loss=_finite(o.loss), lr=o.lr, step_s=o.step_s,
            compute_s=o.compute_s, allreduce_s=o.allreduce_s, commit_s=o.commit_s, quorum_id=o.quorum_id,
            participants=o.participants, participating=o.participating, healed=o.healed,
            batches_committed=o.batches_committed, data_step=o.data_step, global_batch=o.global_batch,
            step_samples=o.step_samples, consumed=o.consumed, sample_start=o.samples.start, samples=len(o.samples),
            tokens=o.tokens,
            grad_norm=_finite(o.grad_norm), clip_norm=o.clip_norm, shard_grad_norm=_finite(o.shard_grad_norm),
            shard_update_norm=_finite(o.shard_update_norm), skipped=o.skipped, rerun_s=o.rerun_s,
            checkpoint_stall_s=self.r.fence.take(),
        )

    def _report_incidents(self, o: StepOutcome) -> None:
        self.report_incidents(o.check.incidents, o.trained_step, o.rerun_s + o.check.wait_s, lambda i, ratio: (
            f"step {o.trained_step} skipped in every group: group {i.group}'s gradient norm is {ratio}; "
            f"rerun {i.rerun_norm:.3g}, checker {i.checker_group} {_fmt(i.checker_norm)}: {i.verdict}"))

    def report_incidents(self, incidents: list[Incident], step: int, check_s: float,
                         line: Callable[[Incident, str], str]) -> None:
        """A progress line per verdict (``line`` given the flagged norm's ratio to the others'), and
        the flagged group's ``sdc`` event."""
        for i in incidents:
            self._say(line(i, against_others(i.norms[i.group], i.reference)))
        mine = next((i for i in incidents if i.group == self.cfg.group), None)
        if mine is not None and self.r.rank == 0:
            self.sink.emit(SdcEvent, step=step, norms={g: _finite(n) for g, n in mine.norms.items()},
                           reference_norm=mine.reference, factor=self.cfg.sdc_factor,
                           rerun_norm=_finite(mine.rerun_norm), checker_group=mine.checker_group,
                           checker_norm=_finite(mine.checker_norm), verdict=mine.verdict,
                           action="quarantined" if mine.verdict == "persistent" else "skipped", check_s=check_s)

    def quarantined(self, o: StepOutcome) -> Incident | None:
        """This group's persistent corruption, found at this step: its ranks must leave."""
        mine = o.check.mine(self.cfg.group) if o.check else None
        return mine if mine is not None and mine.verdict == "persistent" else None

    def quarantine(self, incident: Incident, step: int) -> None:
        """Leave the job: rank 0 tells the agent why (``protocol/quarantine.py``), which then
        promotes the group's warm spare instead of restarting these ranks."""
        if self.r.rank == 0:
            write_model(quarantine_file(self.cfg.events_dir, self.cfg.group), Quarantine(
                step=step, reason=f"the gradient check found a persistent corruption in group {self.cfg.group} "
                f"at step {step} (its rerun {incident.rerun_norm:.3g}, group {incident.checker_group}'s "
                f"{_fmt(incident.checker_norm)}, others' median {_fmt(incident.reference)})"))
        self._say(f"quarantined: a persistent corruption at step {step}; leaving the job")

    def after_commit(self, step: int) -> None:
        """The components that act on committed steps, each on its own interval."""
        self.fingerprinter.after_commit(step)
        self.save_due(step - 1, step)

    def _report_saved(self, saved: list[Saved]) -> None:
        for s in saved:
            self.sink.emit(CheckpointEvent, action="saved", step=s.step, seconds=s.seconds, stall_s=s.stall_s,
                           path=str(s.path))

    def stop_agreed(self, stop: StopRequest) -> bool:
        """Whether any rank of the group was asked to stop, the same answer on every rank.

        The signal reaches the ranks one by one: a rank that saw it leaves after its step, while
        one that had not seen it yet has begun the next step and waits for it in FSDP's
        all-gather, then dies of the reset connection instead of stopping. So the ranks agree first, in an
        all-reduce of one number per step (0.2 ms with gloo over this machine's loopback)."""
        if self.r.ranks == 1:
            return stop.requested
        flag = torch.tensor([1.0 if stop.requested else 0.0], device=self.training.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def save_due(self, since: int, step: int) -> None:
        """A checkpoint when one is due between committed steps ``since`` and ``step``."""
        checkpointer = self.r.checkpointer
        if checkpointer and checkpointer.due(step, since) and self.r.manager.participating_rank() == 0:
            self.r.beacon.enter("checkpoint")
            stall_s, saved = checkpointer.save(step)
            self.r.fence.stall_s += stall_s
            self.r.beacon.enter("compute")
            self._report_saved(saved)

    def train(self, stop: StopRequest) -> str:
        while self.r.manager.current_step() < self.cfg.steps:
            if self.stop_agreed(stop):
                return "stopped"
            if self.r.checkpointer:
                self._report_saved(self.r.checkpointer.poll())
            outcome = self.step()
            self.report(outcome)
            if (incident := self.quarantined(outcome)) is not None:
                self.quarantine(incident, outcome.trained_step)
                return "quarantined"
            if outcome.committed:
                self.after_commit(outcome.step)
                if self.cfg.step_sleep_s:
                    self.r.beacon.enter("idle")
                    time.sleep(self.cfg.step_sleep_s)
            else:
                self.hold_back(stop)
        return "done"

    def hold_back(self, stop: StopRequest) -> None:
        """After a failed step: out of the next quorum while cut off from a lower-numbered peer
        (``trainer/collective_watch.py``)."""
        if self.r.watch is None:
            return
        self.r.beacon.enter("allreduce")  # waiting on other groups: never this group's hang
        self.r.watch.hold_back(self.cfg.quorum_timeout_s, lambda: stop.requested, self._say)
        self.r.beacon.enter("compute")

    def close(self, reason: str, error: str | None = None) -> None:
        """Leave the quorum first (a drained group's heartbeats end with its last commit: the
        Lighthouse lets the others' next quorum go without it sooner), then finish the rest."""
        self.leave_quorum()
        if self.r.checkpointer:
            self._report_saved(self.r.checkpointer.close(finish=reason != "error"))
        self.sink.emit(ExitEvent, reason=reason, step=self.r.manager.current_step(), error=error,
                       events_dropped=self.sink.dropped)
        self.sink.close()
        self.r.beacon.close()
        self.r.hooks.close()
        if self.r.semi:
            self.r.semi.close()
        if self.r.watch:
            self.r.watch.close()
        dist.destroy_process_group()

    def leave_quorum(self) -> None:
        """Stop this rank's torchft Manager, once: on rank 0 its heartbeats and its quorum requests
        to the Lighthouse end with it. A rank giving up on a quorum calls this first, before
        anything slower: a Lighthouse reached again meanwhile (a network back) would otherwise see
        a fresh heartbeat and a pending join from a process about to exit, and put it in the
        others' next quorum, where they wait a collective timeout for it (measured: 10 s, twice,
        and a survivor that gave up on its own quorum in between)."""
        if not self._left_quorum:
            self._left_quorum = True
            self.r.manager.shutdown(wait=False)


def _finite(value: float | None) -> float | None:
    """Events carry a norm that is not finite as null."""
    return value if value is not None and math.isfinite(value) else None


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def run(cfg: TrainerConfig, process_start: float, forked: bool = False) -> int:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    stop = StopRequest()
    stop.install()
    rank = build_rank(cfg, process_start, stop, forked)
    if rank.semi is not None:
        from trainer.window_loop import WindowTrainer  # which builds on RankTrainer

        trainer = WindowTrainer(rank)
    else:
        trainer = RankTrainer(rank)
    try:
        reason = trainer.train(stop)
    except Exception as err:
        away = None
        if isinstance(err, TimeoutError):
            trainer.leave_quorum()
            away = lighthouse_unreachable(cfg.lighthouse, LIGHTHOUSE_PROBE_TIMEOUT_S)
        if away is None:
            trainer.close("error", f"{type(err).__name__}: {err}")
            raise
        trainer.close("lighthouse-away", f"no quorum for {cfg.quorum_timeout_s:g} s (--quorum-timeout-s) and the "
                      f"Lighthouse at {cfg.lighthouse} takes no connection ({away}): stopping; the agent starts "
                      "the group again when it answers")
        log.error("the Lighthouse at %s is away (%s) past --quorum-timeout-s %g s: stopping", cfg.lighthouse, away,
                  cfg.quorum_timeout_s)
        return LIGHTHOUSE_AWAY_EXIT
    trainer.close(reason)
    return 0
