"""The training loop of one rank of one replica group (run under torchrun)."""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torchft
from torchft.manager import REPLICA_ID_KEY
from torch.distributed.device_mesh import init_device_mesh

from protocol.events import (
    CheckpointEvent,
    CommitFailedEvent,
    ExitEvent,
    FingerprintEvent,
    HealEvent,
    QuorumEvent,
    StartEvent,
    StepEvent,
)
from trainer.checkpoint import Checkpointer, Found
from trainer.config import TrainerConfig
from trainer.fault_tolerance import ReplicateAllReduce, build_manager, check_lighthouse_reachable
from trainer.setup import build_training, init_device
from trainer.telemetry import EventSink, TorchftLogBridge

log = logging.getLogger("trainer")


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


class RankTrainer:
    def __init__(self, cfg: TrainerConfig, process_start: float, stop: "StopRequest"):
        self.cfg = cfg
        t_imports = time.time()
        check_lighthouse_reachable(cfg.lighthouse)
        self.device, backend = init_device(cfg)
        dist.init_process_group(backend)
        self.rank, self.ranks = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh(self.device.type, (self.ranks,), mesh_dim_names=("dp_shard",))
        t_pg = time.time()

        self.sink = EventSink(cfg.events_dir, cfg.group, self.rank)
        TorchftLogBridge(self.sink).install()
        self.training = build_training(cfg, mesh, self.device, cfg.group, self.rank, self.ranks)
        self.model, self.optimizer = self.training.model, self.training.optimizer
        self.scheduler, self.position, self.live = self.training.scheduler, self.training.position, self.training.live
        t_model = time.time()

        # The manager's own state (step, batches committed) as a checkpoint restores it; the
        # manager is created last, just before joining, so a warm spare has none while it waits.
        self.manager = None
        self.manager_state = {"step": 0, "batches_committed": 0}
        self.checkpointer = None
        self.loaded: Found | None = None
        if cfg.checkpoint_dir is not None:
            self.checkpointer = Checkpointer(
                cfg.checkpoint_dir, cfg.group, cfg.checkpoint_keep,
                state=lambda: {**self.live.checkpoint_state(),
                               "torchft": self.manager.state_dict() if self.manager else dict(self.manager_state)},
                restore=self._restore_checkpoint,
            )
            self._resume()
        t_ckpt = time.time()

        spare_wait_s = self._wait_as_spare(stop) if cfg.spare_promote_file else 0.0
        t_promoted = time.time()

        self.manager, self.transport = build_manager(cfg, self.live.load_state_dict, self.live.state_dict)
        self.manager.load_state_dict(self.manager_state)
        self.replicate = ReplicateAllReduce(self.manager)
        self.replicate.install(self.model)
        self.ft_optimizer = torchft.Optimizer(self.manager, self.optimizer)
        t_manager = time.time()

        resumed_step = self.manager.current_step()
        self.sink.emit(
            StartEvent, pid=os.getpid(), replica_id=self._replica_id(),
            ranks_per_group=self.ranks, device=str(self.device), flavor=cfg.flavor,
            parameters=self.training.parameters, imports_s=t_imports - process_start,
            process_group_s=t_pg - t_imports, data_s=self.training.data_s, model_s=self.training.model_s,
            checkpoint_s=t_ckpt - t_model + (t_promoted - t_ckpt - spare_wait_s), manager_s=t_manager - t_promoted,
            resumed_step=resumed_step, spare_wait_s=spare_wait_s,
        )
        self._say(f"up in {t_manager - process_start - spare_wait_s:.1f}s (imports {t_imports - process_start:.1f}s, "
                  f"model {self.training.model_s:.1f}s), {self.training.parameters / 1e6:.2f}M parameters"
                  + (f", resumed at step {resumed_step}" if resumed_step else "")
                  + (f", promoted after {spare_wait_s:.1f}s as a warm spare" if spare_wait_s else ""))

    def _wait_as_spare(self, stop: "StopRequest") -> float:
        """A warm spare: everything is built; wait outside the quorum until the agent promotes us.

        Readiness is a file per rank beside the promotion file; promotion is the file itself.
        A checkpoint published while we waited is loaded before joining.
        """
        promote = self.cfg.spare_promote_file
        promote.parent.mkdir(parents=True, exist_ok=True)
        promote.with_name(f"{promote.name}.ready-r{self.rank}").touch()
        self._say("warm spare ready; waiting to be promoted")
        start = time.time()
        while not promote.exists():
            if stop.requested:
                raise SystemExit(0)
            time.sleep(0.01)
        waited = time.time() - start
        if self.checkpointer is not None:
            newest = self.checkpointer.newest_name()
            if newest is not None and (self.loaded is None or newest != self.loaded.path.name):
                self._resume()
        return waited

    def _replica_id(self) -> str:
        """``group{g}:{uuid}``, as rank 0's manager registered it with the Lighthouse."""
        return self.manager._store.get(REPLICA_ID_KEY).decode()

    def _say(self, message: str) -> None:
        if self.rank == 0:
            print(f"[group {self.cfg.group}] {message}", flush=True)

    def _restore_checkpoint(self, state: dict) -> None:
        self.live.restore_checkpoint(state)
        self.manager_state = dict(state["torchft"])  # the step count and batches committed

    def _resume(self) -> None:
        def warn(path: Path, reason: str) -> None:
            log.warning("skipping checkpoint %s: %s", path, reason)
            self._say(f"warning: skipping incomplete checkpoint {path.name}: {reason}")
            self.sink.emit(CheckpointEvent, action="skipped", step=int(path.name.removeprefix("step-")),
                           seconds=0.0, path=str(path), reason=reason)

        found = self.checkpointer.choose(warn)
        if found is None:
            return
        seconds = self.checkpointer.load(found.path)
        self.loaded = found
        self.sink.emit(CheckpointEvent, action="loaded", step=found.step, seconds=seconds, path=str(found.path))

    def train(self, stop: StopRequest) -> str:
        cfg, manager = self.cfg, self.manager
        quorum_id = -1
        while manager.current_step() < cfg.steps:
            if stop.requested:
                return "stopped"
            start = time.perf_counter()
            self.replicate.seconds = 0.0
            self.ft_optimizer.zero_grad()
            step = manager.current_step()
            loss = self.training.forward_backward(step)
            healed = manager._healing  # settled: the all-reduce waited for the quorum
            commit_start = time.perf_counter()
            self.ft_optimizer.step()
            commit_s = time.perf_counter() - commit_start
            committed = manager.current_step() > step
            participants = manager.num_participants()
            error = manager.errored()
            if committed:
                self.scheduler.step()
                self.position.batches_skipped += (cfg.groups - participants) * self.ranks
            step_s = time.perf_counter() - start
            now_step = manager.current_step()

            if manager._quorum_id != quorum_id:
                self.sink.emit(QuorumEvent, quorum_id=manager._quorum_id, previous_quorum_id=quorum_id,
                               step=now_step, participants=participants)
                self._say(f"quorum {manager._quorum_id}: {participants} group(s) training at step {step}")
                quorum_id = manager._quorum_id
            if healed:
                healed_step = now_step - 1 if committed else now_step  # the step the state was taken at
                self.sink.emit(HealEvent, step=healed_step, source_group=self.live.last_source_group,
                               bytes=self.live.last_load_bytes, fetch_s=self.transport.last_fetch_s,
                               load_s=self.live.last_load_s)
                self._say(f"healed from group {self.live.last_source_group} at step {healed_step}: "
                          f"{self.live.last_load_bytes / 2**20:.1f} MiB in {self.transport.last_fetch_s:.2f}s")
            loss_value = loss.item()
            self.sink.emit(
                StepEvent, step=now_step, committed=committed, loss=loss_value,
                lr=self.optimizer.param_groups[0]["lr"], step_s=step_s,
                compute_s=max(0.0, step_s - self.replicate.seconds - commit_s),
                allreduce_s=self.replicate.seconds, commit_s=commit_s, quorum_id=quorum_id,
                participants=participants, participating=manager.is_participating(), healed=healed,
                batches_committed=manager.batches_committed(), batches_skipped=self.position.batches_skipped,
            )
            if not committed:
                reason = repr(error.original_exception) if error else None
                self.sink.emit(CommitFailedEvent, step=step, quorum_id=quorum_id, error=reason)
                self._say(f"step {step} not committed: {reason or 'too few replicas'}")
                continue
            if now_step % cfg.fingerprint_every == 0:
                self.sink.emit(FingerprintEvent, step=now_step, digest=self.live.fingerprint())
            if self.checkpointer and now_step % cfg.checkpoint_every == 0 and manager.participating_rank() == 0:
                path, seconds = self.checkpointer.save(now_step)
                self.sink.emit(CheckpointEvent, action="saved", step=now_step, seconds=seconds, path=str(path))
            if now_step % cfg.log_every == 0:
                self._say(f"step {now_step:>5}  loss {loss_value:.3f}  {participants} group(s)  "
                          f"{step_s:.2f}s/step (all-reduce {self.replicate.seconds:.2f}s)")
            if cfg.step_sleep_s:
                time.sleep(cfg.step_sleep_s)
        return "done"

    def close(self, reason: str, error: str | None = None) -> None:
        self.sink.emit(ExitEvent, reason=reason, step=self.manager.current_step(), error=error,
                       events_dropped=self.sink.dropped)
        self.sink.close()
        self.manager.shutdown(wait=False)
        dist.destroy_process_group()


def run(cfg: TrainerConfig, process_start: float) -> int:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    stop = StopRequest()
    stop.install()
    trainer = RankTrainer(cfg, process_start, stop)
    try:
        reason = trainer.train(stop)
    except Exception as err:
        trainer.close("error", f"{type(err).__name__}: {err}")
        raise
    trainer.close(reason)
    return 0
