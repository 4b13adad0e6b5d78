"""Real text as byte-level tokens, and the batch each (step, group, rank) trains.

The batch is a pure function of (seed, step, group, rank, ranks per group, groups): the
corpus is cut into windows of ``seq_len + 1`` bytes, every epoch visits all windows in a
seeded random order, and the global sample number of sample j of rank r of group g at step s
is ``((s * groups + g) * ranks_per_group + r) * per_rank_batch + j``. No two (step, group, rank) share a
sample inside an epoch, and a restarted or healed rank trains exactly the samples its step
says: nothing is trained twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from trainer.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    """Where each rank's samples come from: a pure function of its arguments."""

    num_tokens: int
    seq_len: int
    groups: int
    ranks_per_group: int
    per_rank_batch: int
    seed: int

    @property
    def windows(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def sample_numbers(self, step: int, group: int, rank: int) -> list[int]:
        first = ((step * self.groups + group) * self.ranks_per_group + rank) * self.per_rank_batch
        return list(range(first, first + self.per_rank_batch))

    def window_indices(self, step: int, group: int, rank: int) -> list[int]:
        out = []
        for n in self.sample_numbers(step, group, rank):
            epoch, position = divmod(n, self.windows)
            out.append(int(_epoch_order(self.seed, epoch, self.windows)[position]))
        return out


@lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, windows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(windows, generator=generator)


class TokenBatches:
    """Turns the batch plan into (inputs, targets) tensors of byte tokens."""

    def __init__(self, corpus: bytes, plan: BatchPlan):
        if plan.windows < 1:
            raise ConfigError(f"the corpus has {len(corpus)} bytes, fewer than one sample of --seq-len {plan.seq_len}")
        self.tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        self.plan = plan

    def batch(self, step: int, group: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        span = self.plan.seq_len + 1
        rows = [self.tokens[i * self.plan.seq_len: i * self.plan.seq_len + span]
                for i in self.plan.window_indices(step, group, rank)]
        block = torch.stack(rows).to(device=device, dtype=torch.long)
        return block[:, :-1], block[:, 1:]
