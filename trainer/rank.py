"""Building one rank of a fault-tolerant replica group, in the order its start needs.

:func:`build_rank` makes the group's process group, the training parts torchtitan's components
give (:func:`trainer.builder.build_training`), the checkpointer and the resume from the newest
complete checkpoint, then (for a warm spare) waits outside the quorum until promoted, and only
then the torchft Manager and what hangs on it: the replicate all-reduce, the gradient check,
torchft's optimizer wrapper, the drill hooks and the progress beacon. What it returns,
:class:`Rank`, is everything the loop (:mod:`trainer.train`) drives; its start event says how
long each stage took.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torchft

from protocol.events import CheckpointEvent, StartEvent
from protocol.spare import readiness_file
from trainer.advertise import use_advertised_interface
from trainer.builder import Training, build_training, init_device, parallel_dims
from trainer.checkpoint import Checkpointer, Found, step_of
from trainer.collective_watch import CollectiveWatch
from trainer.config import TrainerConfig
from trainer.fault_tolerance import (
    FailFastManager,
    ManagerInternals,
    ReplicateAllReduce,
    build_manager,
    check_lighthouse_reachable,
    watch_collectives,
)
from trainer.gradient_check import GradientCheck, group_norm
from trainer.heal_peers import LighthousePeers
from trainer.heal_transport import StreamTransport
from trainer.hooks import DrillHooks
from trainer.job import describe
from trainer.semi_sync import SemiSync
from trainer.telemetry import EventSink, ProgressBeacon, TorchftLogBridge

log = logging.getLogger("trainer")
SPARE_POLL_S = 0.01
"""How often a warm spare looks for its promotion file: promotion is on the fail-over's critical path."""


class ManagerState:
    """torchft's own counters (step, batches committed) as a checkpoint holds them: read from the
    Manager once it exists; before that (a checkpoint loaded while building, or while waiting as
    a spare, which has no Manager yet) from what the checkpoint restored."""

    def __init__(self) -> None:
        self.manager: FailFastManager | None = None
        self.restored: dict[str, int] = {"step": 0, "batches_committed": 0}

    def state_dict(self) -> dict[str, int]:
        return self.manager.state_dict() if self.manager else dict(self.restored)

    def restore(self, state: dict[str, int]) -> None:
        self.restored = dict(state)


@dataclass
class Rank:
    """Everything one rank of a fault-tolerant group holds while it trains."""

    cfg: TrainerConfig
    rank: int
    ranks: int
    training: Training
    sink: EventSink
    checkpointer: Checkpointer | None
    manager: FailFastManager
    transport: StreamTransport
    peers: LighthousePeers
    internals: ManagerInternals
    replicate: ReplicateAllReduce | None
    """hsdp: each step's gradients averaged across groups (None with --sync localsgd|diloco)"""
    check: GradientCheck | None
    watch: CollectiveWatch | None
    ft_optimizer: Any
    semi: SemiSync | None
    """--sync localsgd|diloco: torchft's DiLoCo and the window around it"""
    beacon: ProgressBeacon
    hooks: DrillHooks
    fence: "Fence"

    def say(self, message: str) -> None:
        say(self.cfg.group, self.rank, message)


def say(group: int, rank: int, message: str) -> None:
    """A progress line in the group's log, from its rank 0."""
    if rank == 0:
        print(f"[group {group}] {message}", flush=True)


class Fence:
    """Before the state changes in place (the optimizer step, a heal's load), a checkpoint in
    flight must hold its copy first; ``stall_s`` counts the waiting until the next step event."""

    def __init__(self, checkpointer: Checkpointer | None):
        self.checkpointer = checkpointer
        self.stall_s = 0.0

    def __call__(self) -> None:
        if self.checkpointer is not None:
            self.stall_s += self.checkpointer.fence()

    def take(self) -> float:
        stall, self.stall_s = self.stall_s, 0.0
        return stall


class _Resume:
    """Loads the newest complete checkpoint into the training state, reporting what it skipped."""

    def __init__(self, checkpointer: Checkpointer, sink: EventSink, say):
        self.checkpointer = checkpointer
        self.sink = sink
        self.say = say
        self.loaded: Found | None = None

    def __call__(self, clear_unpublished: bool = True) -> None:
        def warn(path: Path, reason: str) -> None:
            log.warning("skipping checkpoint %s: %s", path, reason)
            self.say(f"warning: skipping incomplete checkpoint {path.name}: {reason}")
            self.sink.emit(CheckpointEvent, action="skipped", step=step_of(path), seconds=0.0, path=str(path),
                           reason=reason)

        found = self.checkpointer.choose(warn, clear_unpublished)
        if found is None:
            return
        seconds = self.checkpointer.load(found.path)
        self.loaded = found
        self.sink.emit(CheckpointEvent, action="loaded", step=found.step, seconds=seconds, path=str(found.path))

    def newer_published(self) -> bool:
        newest = self.checkpointer.newest_name()
        return newest is not None and (self.loaded is None or newest != self.loaded.path.name)


def _wait_as_spare(cfg: TrainerConfig, rank: int, stop, say) -> float:
    """A warm spare: everything is built; wait outside the quorum until the agent promotes us.
    Readiness is a file per rank beside the promotion file; promotion is the file itself
    (``protocol/spare.py``). Returns the seconds waited."""
    promote = cfg.spare_promote_file
    promote.parent.mkdir(parents=True, exist_ok=True)
    readiness_file(promote, rank).touch()
    say("warm spare ready; waiting to be promoted")
    start = time.time()
    while not promote.exists():
        if stop.requested:
            raise SystemExit(0)
        time.sleep(SPARE_POLL_S)
    return time.time() - start


def build_rank(cfg: TrainerConfig, process_start: float, stop, forked: bool = False) -> Rank:
    t_imports = time.time()
    use_advertised_interface(cfg)  # gloo reads its interface when a process group is made
    check_lighthouse_reachable(cfg.lighthouse)
    device, backend = init_device(cfg)
    dist.init_process_group(backend)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    dims = parallel_dims(device, replicate=1, shard=ranks)
    t_pg = time.time()

    sink = EventSink(cfg.events_dir, cfg.group, rank)
    TorchftLogBridge(sink).install()

    def tell(message: str) -> None:
        say(cfg.group, rank, message)

    training = build_training(cfg, dims, device, cfg.group, rank, ranks)
    t_model = time.time()

    counters = ManagerState()
    semi = None
    if training.sync.semi_sync:
        semi = SemiSync(training.sync, training.model, training.optimizers, training.schedulers, training.position,
                        training.live, training.plan.policy, cfg.group, cfg.sdc_factor if cfg.sdc_check else None)

    def restore(state: dict) -> None:
        training.live.restore_checkpoint(state)
        counters.restore(state["torchft"])
        if semi is not None:
            semi.restore_checkpoint(state)

    checkpointer = resume = None
    if cfg.checkpoint_dir is not None:
        checkpointer = Checkpointer(
            cfg.checkpoint_dir, cfg.group, cfg.checkpoint_keep, cfg.checkpoint_every,
            state=lambda: {**training.live.checkpoint_state(), "torchft": counters.state_dict(),
                           **(semi.checkpoint_state() if semi else {})},
            restore=restore, asynchronous=cfg.checkpoint_async, timeout=timedelta(seconds=cfg.timeout_s))
        resume = _Resume(checkpointer, sink, tell)
        # a warm spare waits beside the live group: the live group's save in flight is not to be cleared
        resume(clear_unpublished=cfg.spare_promote_file is None)
    t_ckpt = time.time()

    spare_wait_s = 0.0
    if cfg.spare_promote_file:
        spare_wait_s = _wait_as_spare(cfg, rank, stop, tell)
        if checkpointer is not None:
            checkpointer.clear_unpublished()  # the group's old processes are gone, their unfinished saves with them
            if resume.newer_published():
                resume()  # published while we waited
    t_promoted = time.time()

    # from here on this process is the group's: a waiting spare must not cover the live group's beacon
    beacon = ProgressBeacon(cfg.events_dir, cfg.group, rank)
    hooks = DrillHooks(cfg.events_dir, cfg.group)
    fence = Fence(checkpointer)

    def load_live(state: dict) -> None:
        """A heal: a peer's state, loaded in place (after the fence)."""
        fence()
        training.live.load_state_dict(state)

    manager, transport, peers = build_manager(cfg, rank, load_live, training.live.state_dict,
                                              async_quorum=semi is None)
    manager.load_state_dict(counters.restored)
    counters.manager = manager
    internals = ManagerInternals(manager)
    watch = watch_collectives(cfg, manager)
    replicate = check = ft_optimizer = None
    if semi is not None:
        semi.attach(manager, internals, beacon, lambda shards: group_norm(shards, device), tamper=hooks.corrupt)
    else:
        replicate = ReplicateAllReduce(manager, beacon, defer=cfg.sdc_check, tamper=hooks.corrupt, watch=watch)
        replicate.install(training.model)
        check = GradientCheck(manager, cfg.group, device, beacon, cfg.sdc_factor, watch) if cfg.sdc_check else None
        ft_optimizer = torchft.Optimizer(manager, training.optimizers)
    built = Rank(
        cfg=cfg, rank=rank, ranks=ranks, training=training, sink=sink, checkpointer=checkpointer, manager=manager,
        transport=transport, peers=peers, internals=internals, replicate=replicate, check=check, watch=watch,
        ft_optimizer=ft_optimizer, semi=semi, beacon=beacon, hooks=hooks, fence=fence)
    t_manager = time.time()

    resumed_step = semi.step if semi is not None else manager.current_step()
    sink.emit(
        StartEvent, pid=os.getpid(), replica_id=built.internals.replica_id(), ranks_per_group=ranks,
        device=str(device), **training.start_fields(cfg), imports_s=t_imports - process_start,
        process_group_s=t_pg - t_imports, checkpoint_s=t_ckpt - t_model + (t_promoted - t_ckpt - spare_wait_s),
        manager_s=t_manager - t_promoted, resumed_step=resumed_step, spare_wait_s=spare_wait_s, forked=forked)
    job = training.job
    tell(f"up in {t_manager - process_start - spare_wait_s:.1f}s" + (" from a fork of the zygote" if forked else "")
        + f" (imports {t_imports - process_start:.1f}s, model {training.model_s:.1f}s): {describe(job)}, "
        f"{training.parameters / 1e6:.2f}M parameters, {cfg.precision}"
        + (f", resumed at step {resumed_step}" if resumed_step else "")
        + (f"; {training.sync.mode} across groups, a sync every {training.sync.every} steps" if semi else "")
        + (f", promoted after {spare_wait_s:.1f}s as a warm spare" if spare_wait_s else ""))
    return built
