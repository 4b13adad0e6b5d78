"""What every trainer builds before its loop: device, data, sharded model, optimizer, schedule.

Shared by the fault-tolerant trainer (``trainer.train``) and the classic baseline the
benchmarks compare it with (``bench/classic_trainer.py``).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from trainer.config import TrainerConfig
from trainer.corpus import read_corpus
from trainer.data import BatchPlan, TokenBatches
from trainer.model import VOCAB_SIZE, build_sharded_model, count_parameters
from trainer.state import LiveState, TrainingPosition, materialize_optimizer_state


def init_device(cfg: TrainerConfig) -> tuple[torch.device, str]:
    """The rank's device and its intra-group backend."""
    if cfg.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def lr_lambda(warmup_steps: int, total_steps: int, floor: float = 0.1):
    """Linear warm-up, then cosine decay to ``floor`` of the peak at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@dataclass
class Training:
    """One rank's model, optimizer, schedule and data, and how long building them took."""

    device: torch.device
    group: int
    rank: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    position: TrainingPosition
    live: LiveState
    batches: TokenBatches
    data_s: float = 0.0
    model_s: float = 0.0
    parameters: int = field(default=0)

    def forward_backward(self, step: int, group: int | None = None) -> torch.Tensor:
        """Loss of this rank's batch at ``step``, gradients accumulated (FSDP reduces them).
        ``group``: the batch another group's same rank trains at that step (a gradient check's rerun)."""
        inputs, targets = self.batches.batch(step, self.group if group is None else group, self.rank, self.device)
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE).float(), targets.reshape(-1))
        loss.backward()
        return loss


def build_training(cfg: TrainerConfig, mesh: DeviceMesh, device: torch.device, group: int, rank: int,
                   ranks_per_group: int) -> Training:
    start = time.time()
    corpus = read_corpus(cfg.data, cfg.data_max_bytes)
    plan = BatchPlan(len(corpus), cfg.seq_len, cfg.groups, ranks_per_group, cfg.per_rank_batch(ranks_per_group), cfg.seed)
    batches = TokenBatches(corpus, plan)
    data_done = time.time()
    model = build_sharded_model(cfg.flavor, mesh, device, cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    materialize_optimizer_state(optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.warmup_steps, cfg.steps))
    position = TrainingPosition()
    live = LiveState(group, model, optimizer, scheduler, position)
    return Training(device, group, rank, model, optimizer, scheduler, position, live, batches,
                    data_s=data_done - start, model_s=time.time() - data_done, parameters=count_parameters(model))
