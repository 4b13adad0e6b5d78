"""The classic path the benchmarks compare against: one torchrun job, no torchft.

The same model, data, optimizer and group shape as the fault-tolerant trainer, but the G × K
ranks form ONE job: a 2-D mesh ("dp_replicate", "dp_shard") = (G, K) and FSDP2's own HSDP
(reduce-scatter inside a group, all-reduce across groups through a plain process group).
Recovery is what torchrun --max-restarts gives: every rank restarts and resumes from the
newest complete DCP checkpoint, redoing the steps since.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node G*K --max-restarts 3 \\
        -m bench.classic_trainer --groups G --ranks-per-group K --checkpoint-dir D ...

(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torch 2.13 and gloo a restart otherwise fails,
workers reading the previous attempt's addresses; pytorch/pytorch#135712.)
"""

from __future__ import annotations

import os
import sys
import time

PROCESS_START = time.time()

import torch.distributed as dist  # noqa: E402

from protocol.events import CheckpointEvent, StartEvent, StepEvent  # noqa: E402
from protocol.settings import parse_settings  # noqa: E402
from trainer.checkpoint import Checkpointer  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.builder import build_training, init_device, parallel_dims  # noqa: E402
from trainer.telemetry import EventSink  # noqa: E402


class StepCount:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def main() -> int:
    cfg = parse_settings(TrainerConfig, "classic", sys.argv[1:])
    t_imports = time.time()
    device, backend = init_device(cfg)
    dist.init_process_group(backend)
    world, global_rank = dist.get_world_size(), dist.get_rank()
    ranks_per_group = cfg.ranks_per_group
    assert world == cfg.groups * ranks_per_group, f"world {world} != groups {cfg.groups} x {ranks_per_group} ranks"
    group, rank = divmod(global_rank, ranks_per_group)
    dims = parallel_dims(device, replicate=cfg.groups, shard=ranks_per_group)
    t_pg = time.time()
    sink = EventSink(cfg.events_dir, group, rank)
    training = build_training(cfg, dims, device, group, rank, ranks_per_group)
    counter = StepCount()
    checkpointer = None
    t_ckpt0 = time.time()
    if cfg.checkpoint_dir is not None:
        def restore(state: dict) -> None:
            training.live.restore_checkpoint(state)
            counter.load_state_dict(state["progress"])

        checkpointer = Checkpointer(cfg.checkpoint_dir, 0, cfg.checkpoint_keep, cfg.checkpoint_every,
                                    state=lambda: {**training.live.checkpoint_state(), "progress": counter.state_dict()},
                                    restore=restore, asynchronous=False)  # the classic path: saves on the step
        found = checkpointer.choose(lambda path, reason: None)
        if found is not None:
            seconds = checkpointer.load(found.path)
            sink.emit(CheckpointEvent, action="loaded", step=found.step, seconds=seconds, path=str(found.path))
    t_ckpt = time.time()
    sink.emit(StartEvent, pid=os.getpid(), replica_id=f"classic-restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
              ranks_per_group=ranks_per_group, device=str(device), **training.start_fields(cfg),
              imports_s=t_imports - PROCESS_START, process_group_s=t_pg - t_imports,
              checkpoint_s=t_ckpt - t_ckpt0, manager_s=0.0, resumed_step=counter.step)
    while counter.step < cfg.steps:
        start = time.perf_counter()
        training.optimizers.zero_grad()
        share = training.plan.group_share(counter.step, group, group, cfg.groups)
        # FSDP's own HSDP sums over every group: each rank divides by the whole global batch
        loss = training.forward_backward(share, cfg.groups, training.plan.global_batch)
        training.optimizers.step()
        training.schedulers.step()
        counter.step += 1
        step_s = time.perf_counter() - start
        sink.emit(StepEvent, step=counter.step, committed=True, data_step=counter.step - 1,
                  global_batch=training.plan.global_batch, step_samples=training.plan.global_batch, consumed=True,
                  sample_start=share.start, samples=len(share), tokens=len(share) * training.seq_len, loss=loss,
                  lr=training.live.lr(), step_s=step_s, compute_s=step_s, allreduce_s=0.0, commit_s=0.0, quorum_id=0,
                  participants=cfg.groups, participating=True, healed=False,
                  batches_committed=counter.step * cfg.groups)
        if checkpointer and checkpointer.due(counter.step, counter.step - 1):
            for saved in checkpointer.save(counter.step)[1]:
                sink.emit(CheckpointEvent, action="saved", step=saved.step, seconds=saved.seconds,
                          stall_s=saved.stall_s, path=str(saved.path))
        if cfg.step_sleep_s:
            time.sleep(cfg.step_sleep_s)
    sink.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
