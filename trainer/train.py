"""The training loop of one rank of one replica group (run under torchrun).

The loop reads as its concerns: :meth:`RankTrainer.step` trains one step and returns what
happened (:class:`StepOutcome`); :meth:`RankTrainer.report` turns that into events and progress
lines; after a committed step the fingerprinter and the checkpointer each decide, on their own
interval, whether it is their turn.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torchft
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from protocol.events import (
    CheckpointEvent,
    CommitFailedEvent,
    ExitEvent,
    FingerprintEvent,
    HealEvent,
    QuorumEvent,
    SdcEvent,
    StartEvent,
    StepEvent,
)
from protocol.files import write_model
from protocol.lighthouse import lighthouse_unreachable
from protocol.quarantine import Quarantine, quarantine_file
from protocol.spare import readiness_file
from trainer.advertise import use_advertised_interface
from trainer.checkpoint import Checkpointer, Found, Saved, step_of
from trainer.config import TrainerConfig
from trainer.fault_tolerance import (
    LIGHTHOUSE_PROBE_TIMEOUT_S,
    ManagerInternals,
    ReplicateAllReduce,
    build_manager,
    check_lighthouse_reachable,
)
from trainer.gradient_check import CheckResult, GradientCheck, Incident, group_norm, shard_norm
from trainer.injection import InjectedFaults
from trainer.setup import build_training, init_device
from trainer.state import LiveState, local
from trainer.telemetry import EventSink, ProgressBeacon, TorchftLogBridge

log = logging.getLogger("trainer")
LIGHTHOUSE_AWAY_EXIT = 75
"""EX_TEMPFAIL: the rank stopped because the Lighthouse is away, not because it failed."""
SPARE_POLL_S = 0.01
"""How often a warm spare looks for its promotion file: promotion is on the fail-over's critical path."""


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
    loss: float
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
    def __init__(self, cfg: TrainerConfig, process_start: float, stop: StopRequest, forked: bool = False):
        self.cfg = cfg
        t_imports = time.time()
        use_advertised_interface(cfg)  # gloo reads its interface when a process group is made
        check_lighthouse_reachable(cfg.lighthouse)
        self.device, backend = init_device(cfg)
        dist.init_process_group(backend)
        self.rank, self.ranks_per_group = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh(self.device.type, (self.ranks_per_group,), mesh_dim_names=("dp_shard",))
        t_pg = time.time()

        self.sink = EventSink(cfg.events_dir, cfg.group, self.rank)
        TorchftLogBridge(self.sink).install()
        self.training = build_training(cfg, mesh, self.device, cfg.group, self.rank, self.ranks_per_group)
        self.model, self.optimizer = self.training.model, self.training.optimizer
        self.scheduler, self.position, self.live = self.training.scheduler, self.training.position, self.training.live
        self.fingerprinter = Fingerprinter(self.live, self.sink, cfg.fingerprint_every)
        t_model = time.time()

        # The manager's own state (step, batches committed) as a checkpoint restores it; the
        # manager is created last, just before joining, so a warm spare has none while it waits.
        self.manager = None
        self._left_quorum = False
        self.manager_state = {"step": 0, "batches_committed": 0}
        self.checkpointer = None
        self.checkpoint_stall_s = 0.0  # the next step event's
        self.loaded: Found | None = None
        if cfg.checkpoint_dir is not None:
            self.checkpointer = Checkpointer(
                cfg.checkpoint_dir, cfg.group, cfg.checkpoint_keep, cfg.checkpoint_every,
                state=lambda: {**self.live.checkpoint_state(),
                               "torchft": self.manager.state_dict() if self.manager else dict(self.manager_state)},
                restore=self._restore_checkpoint, asynchronous=cfg.checkpoint_async,
                timeout=timedelta(seconds=cfg.timeout_s),
            )
            # a warm spare waits beside the live group: the live group's save in flight is not to be cleared
            self._resume(clear_unpublished=cfg.spare_promote_file is None)
        t_ckpt = time.time()

        spare_wait_s = self._wait_as_spare(stop) if cfg.spare_promote_file else 0.0
        t_promoted = time.time()
        # from here on this process is the group's: a waiting spare must not cover the live group's beacon
        self.beacon = ProgressBeacon(cfg.events_dir, cfg.group, self.rank)
        self.injected = InjectedFaults(cfg.events_dir, cfg.group)

        self.manager, self.transport = build_manager(cfg, self._load_live, self.live.state_dict)
        self.manager.load_state_dict(self.manager_state)
        self.internals = ManagerInternals(self.manager)
        self.replicate = ReplicateAllReduce(self.manager, self.beacon, defer=cfg.sdc_check, tamper=self.injected.corrupt)
        self.replicate.install(self.model)
        self.check = GradientCheck(self.manager, cfg.group, self.device, self.beacon, cfg.sdc_factor) \
            if cfg.sdc_check else None
        self.ft_optimizer = torchft.Optimizer(self.manager, self.optimizer)
        self.quorum_id = -1  # the quorum the last reported step trained in
        t_manager = time.time()

        resumed_step = self.manager.current_step()
        self.sink.emit(
            StartEvent, pid=os.getpid(), replica_id=self.internals.replica_id(),
            ranks_per_group=self.ranks_per_group, device=str(self.device), flavor=cfg.flavor,
            parameters=self.training.parameters, imports_s=t_imports - process_start,
            process_group_s=t_pg - t_imports, data_s=self.training.data_s, model_s=self.training.model_s,
            checkpoint_s=t_ckpt - t_model + (t_promoted - t_ckpt - spare_wait_s), manager_s=t_manager - t_promoted,
            resumed_step=resumed_step, spare_wait_s=spare_wait_s, forked=forked,
        )
        self._say(f"up in {t_manager - process_start - spare_wait_s:.1f}s"
                  + (" from a fork of the zygote" if forked else "")
                  + f" (imports {t_imports - process_start:.1f}s, "
                  f"model {self.training.model_s:.1f}s), {self.training.parameters / 1e6:.2f}M parameters"
                  + (f", resumed at step {resumed_step}" if resumed_step else "")
                  + (f", promoted after {spare_wait_s:.1f}s as a warm spare" if spare_wait_s else ""))

    def _wait_as_spare(self, stop: StopRequest) -> float:
        """A warm spare: everything is built; wait outside the quorum until the agent promotes us.

        Readiness is a file per rank beside the promotion file; promotion is the file itself
        (``protocol/spare.py``). A checkpoint published while we waited is loaded before joining.
        """
        promote = self.cfg.spare_promote_file
        promote.parent.mkdir(parents=True, exist_ok=True)
        readiness_file(promote, self.rank).touch()
        self._say("warm spare ready; waiting to be promoted")
        start = time.time()
        while not promote.exists():
            if stop.requested:
                raise SystemExit(0)
            time.sleep(SPARE_POLL_S)
        waited = time.time() - start
        if self.checkpointer is not None:
            self.checkpointer.clear_unpublished()  # the group's old processes are gone, their unfinished saves with them
            newest = self.checkpointer.newest_name()
            if newest is not None and (self.loaded is None or newest != self.loaded.path.name):
                self._resume()
        return waited

    def _say(self, message: str) -> None:
        if self.rank == 0:
            print(f"[group {self.cfg.group}] {message}", flush=True)

    def _fence(self) -> None:
        """Before the state changes in place: a checkpoint in flight must hold its copy first."""
        if self.checkpointer is not None:
            self.checkpoint_stall_s += self.checkpointer.fence()

    def _load_live(self, state: dict) -> None:
        """A heal: a peer's state, loaded in place (after the fence)."""
        self._fence()
        self.live.load_state_dict(state)

    def _restore_checkpoint(self, state: dict) -> None:
        self.live.restore_checkpoint(state)
        self.manager_state = dict(state["torchft"])  # the step count and batches committed

    def _resume(self, clear_unpublished: bool = True) -> None:
        def warn(path: Path, reason: str) -> None:
            log.warning("skipping checkpoint %s: %s", path, reason)
            self._say(f"warning: skipping incomplete checkpoint {path.name}: {reason}")
            self.sink.emit(CheckpointEvent, action="skipped", step=step_of(path),
                           seconds=0.0, path=str(path), reason=reason)

        found = self.checkpointer.choose(warn, clear_unpublished)
        if found is None:
            return
        seconds = self.checkpointer.load(found.path)
        self.loaded = found
        self.sink.emit(CheckpointEvent, action="loaded", step=found.step, seconds=seconds, path=str(found.path))

    def step(self) -> StepOutcome:
        """Train one step: quorum, forward and backward, the gradient check (when on), the
        gradients averaged across groups, and the optimizer step only if every rank of every
        group succeeded and every group's gradient passed the check."""
        manager = self.manager
        start = time.perf_counter()
        before = manager.current_step()
        self.beacon.enter("allreduce", before)  # torchft's start_quorum waits for the last quorum: other groups
        self.ft_optimizer.zero_grad()
        self.beacon.enter("compute")
        self.replicate.begin()
        self.injected.stall(before)
        loss = self.training.forward_backward(before)
        check, grad_norm = None, None
        if self.check is not None:
            grad_norm = group_norm(self.replicate.shard_gradients(self.model), self.device)
            check = self.check.check(grad_norm, lambda batch_group: self._rerun(before, batch_group))
            if check.passed:
                self.replicate.flush()
        healed = self.internals.healing  # settled: the all-reduce waited for the quorum
        apply = check is None or check.passed
        clip_norm = self._clip() if apply and self.cfg.max_norm else None
        watched = self.injected.watched and apply
        shard_grad_norm = shard_norm(self.replicate.shard_gradients(self.model)) if watched else None
        params = [local(p).detach() for p in self.model.parameters()] if watched else []
        was = [p.clone() for p in params]
        commit_start = time.perf_counter()
        self.beacon.enter("commit")
        if manager.should_commit() and apply:
            self._fence()
            self.optimizer.step()
        commit_s = time.perf_counter() - commit_start
        self.beacon.enter("compute")
        after = manager.current_step()
        committed = after > before
        participants = manager.num_participants()
        error = manager.errored()
        if committed:
            self.scheduler.step()
            skipped_groups = self.cfg.groups - (participants if apply else 0)
            self.position.batches_skipped += skipped_groups * self.ranks_per_group
        return StepOutcome(
            trained_step=before, step=after, committed=committed, loss=loss.item(),
            lr=self.optimizer.param_groups[0]["lr"], step_s=time.perf_counter() - start,
            allreduce_s=self.replicate.seconds + (check.wait_s if check else 0.0), commit_s=commit_s, quorum_id=self.internals.quorum_id,
            participants=participants, participating=manager.is_participating(), healed=healed,
            batches_committed=manager.batches_committed(),
            error=repr(error.original_exception) if error else None,
            check=check, grad_norm=grad_norm, clip_norm=clip_norm, shard_grad_norm=shard_grad_norm,
            shard_update_norm=shard_norm(torch._foreach_sub(params, was)) if watched else None,
        )

    def _rerun(self, step: int, batch_group: int) -> float:
        """The gradient check's rerun: recompute a batch's gradient from the unchanged state."""
        self.optimizer.zero_grad()  # the inner optimizer's: torchft's would start a quorum
        self.replicate.begin()
        self.training.forward_backward(step, batch_group)
        return group_norm(self.replicate.shard_gradients(self.model), self.device)

    def _clip(self) -> float:
        """Clip by the norm of the averaged gradient, as torchtitan does: it is the same in every
        group (every group holds the same average), so every group clips alike."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, foreach=True)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.cfg.max_norm, total, foreach=True)
        return total.item()

    def report(self, o: StepOutcome) -> None:
        """The step's events (quorum change, heal, the step, a failed commit) and its progress line."""
        if o.quorum_id != self.quorum_id:
            self.sink.emit(QuorumEvent, quorum_id=o.quorum_id, previous_quorum_id=self.quorum_id, step=o.step,
                           participants=o.participants)
            self._say(f"quorum {o.quorum_id}: {o.participants} group(s) training at step {o.trained_step}")
            self.quorum_id = o.quorum_id
        if o.healed:
            self.sink.emit(HealEvent, step=o.healed_step, source_group=self.live.last_source_group,
                           bytes=self.live.last_load_bytes, fetch_s=self.transport.last_fetch_s,
                           load_s=self.live.last_load_s)
            self._say(f"healed from group {self.live.last_source_group} at step {o.healed_step}: "
                      f"{self.live.last_load_bytes / 2**20:.1f} MiB in {self.transport.last_fetch_s:.2f}s")
        self.sink.emit(
            StepEvent, step=o.step, committed=o.committed, loss=_finite(o.loss), lr=o.lr, step_s=o.step_s,
            compute_s=o.compute_s, allreduce_s=o.allreduce_s, commit_s=o.commit_s, quorum_id=o.quorum_id,
            participants=o.participants, participating=o.participating, healed=o.healed,
            batches_committed=o.batches_committed, batches_skipped=self.position.batches_skipped,
            grad_norm=_finite(o.grad_norm), clip_norm=o.clip_norm, shard_grad_norm=_finite(o.shard_grad_norm),
            shard_update_norm=_finite(o.shard_update_norm), skipped=o.skipped, rerun_s=o.rerun_s,
            checkpoint_stall_s=self.checkpoint_stall_s,
        )
        self.checkpoint_stall_s = 0.0
        if o.check is not None and o.check.incidents:
            self._report_incidents(o)
        if not o.committed:
            self.sink.emit(CommitFailedEvent, step=o.trained_step, quorum_id=o.quorum_id, error=o.error)
            self._say(f"step {o.trained_step} not committed: {o.error or 'too few replicas'}")
        elif o.step % self.cfg.log_every == 0:
            self._say(f"step {o.step:>5}  loss {o.loss:.3f}  {o.participants} group(s)  "
                      f"{o.step_s:.2f}s/step (all-reduce {o.allreduce_s:.2f}s)")

    def _report_incidents(self, o: StepOutcome) -> None:
        for i in o.check.incidents:
            ratio = f"{i.norms[i.group] / i.reference:.3g}x the others'" if i.reference and math.isfinite(
                i.norms[i.group]) else "not finite"
            self._say(f"step {o.trained_step} skipped in every group: group {i.group}'s gradient norm is {ratio}; "
                      f"rerun {i.rerun_norm:.3g}, checker {i.checker_group} {_fmt(i.checker_norm)}: {i.verdict}")
        mine = o.check.mine(self.cfg.group)
        if mine is not None and self.rank == 0:
            self.sink.emit(SdcEvent, step=o.trained_step, norms={g: _finite(n) for g, n in mine.norms.items()},
                           reference_norm=mine.reference, factor=self.cfg.sdc_factor,
                           rerun_norm=_finite(mine.rerun_norm), checker_group=mine.checker_group,
                           checker_norm=_finite(mine.checker_norm), verdict=mine.verdict,
                           action="quarantined" if mine.verdict == "persistent" else "skipped",
                           check_s=o.rerun_s + o.check.wait_s)

    def quarantined(self, o: StepOutcome) -> Incident | None:
        """This group's persistent corruption, found at this step: its ranks must leave."""
        mine = o.check.mine(self.cfg.group) if o.check else None
        return mine if mine is not None and mine.verdict == "persistent" else None

    def quarantine(self, incident: Incident, step: int) -> None:
        """Leave the job: rank 0 tells the agent why (``protocol/quarantine.py``), which then
        promotes the group's warm spare instead of restarting these ranks."""
        if self.rank == 0:
            write_model(quarantine_file(self.cfg.events_dir, self.cfg.group), Quarantine(
                step=step, reason=f"the gradient check found a persistent corruption in group {self.cfg.group} "
                f"at step {step} (its rerun {incident.rerun_norm:.3g}, group {incident.checker_group}'s "
                f"{_fmt(incident.checker_norm)}, others' median {_fmt(incident.reference)})"))
        self._say(f"quarantined: a persistent corruption at step {step}; leaving the job")

    def after_commit(self, step: int) -> None:
        """The components that act on committed steps, each on its own interval."""
        self.fingerprinter.after_commit(step)
        if self.checkpointer and self.checkpointer.due(step) and self.manager.participating_rank() == 0:
            self.beacon.enter("checkpoint")
            self.checkpoint_stall_s, saved = self.checkpointer.save(step)
            self.beacon.enter("compute")
            self._report_saved(saved)

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
        if self.ranks_per_group == 1:
            return stop.requested
        flag = torch.tensor([1.0 if stop.requested else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def train(self, stop: StopRequest) -> str:
        while self.manager.current_step() < self.cfg.steps:
            if self.stop_agreed(stop):
                return "stopped"
            if self.checkpointer:
                self._report_saved(self.checkpointer.poll())
            outcome = self.step()
            self.report(outcome)
            if (incident := self.quarantined(outcome)) is not None:
                self.quarantine(incident, outcome.trained_step)
                return "quarantined"
            if outcome.committed:
                self.after_commit(outcome.step)
                if self.cfg.step_sleep_s:
                    self.beacon.enter("idle")
                    time.sleep(self.cfg.step_sleep_s)
        return "done"

    def close(self, reason: str, error: str | None = None) -> None:
        if self.checkpointer:
            self._report_saved(self.checkpointer.close(finish=reason != "error"))
        self.sink.emit(ExitEvent, reason=reason, step=self.manager.current_step(), error=error,
                       events_dropped=self.sink.dropped)
        self.sink.close()
        self.beacon.close()
        self.injected.close()
        self.leave_quorum()
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
            self.manager.shutdown(wait=False)


def _finite(value: float | None) -> float | None:
    """Events carry a norm that is not finite as null."""
    return value if value is not None and math.isfinite(value) else None


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def run(cfg: TrainerConfig, process_start: float, forked: bool = False) -> int:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    stop = StopRequest()
    stop.install()
    trainer = RankTrainer(cfg, process_start, stop, forked)
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
