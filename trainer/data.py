"""The job's global sample order, and which samples each committed step trains.

The job reads its samples in one global order: sample ``n`` is window ``order(epoch)[n % W]`` of
the token store (W windows per epoch, each epoch a seeded permutation). Step ``d`` of the data
(``TrainingPosition.data_step``: steps whose batch was consumed) trains the global batch
``[d * B, (d + 1) * B)``. Who trains which part is decided per step from the step's quorum alone,
so every group computes the same split and a healed or restarted group needs no data-loader
state from anyone: its position is part of the state it heals or loads.

Two policies:

- ``constant`` (the default): the groups participating in the step (the quorum's ``P``
  up-to-date groups, by their participating rank) split all ``B`` samples; a group with more
  than its ranks' ``local_batch_size`` accumulates gradients over microbatches. The global batch
  the user chose holds whatever the quorum, so the optimizer sees the same batch size and the
  data is trained exactly once; a missing group costs the others ``N / (N - 1)`` in step time.
- ``shrink``: each group ``g`` always takes its own ``1/N`` of the batch; while it is down its
  share is skipped (and counted), and the batch shrinks with the quorum: the step time stays.

Every function here is pure: tested on recorded quorums (``tests/test_data_plan.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from protocol.job import BatchPolicy


def split(total: int, parts: int, index: int) -> range:
    """Part ``index`` of ``range(total)`` cut into ``parts`` contiguous pieces that differ by at most one."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def offset(r: range, by: int) -> range:
    return range(r.start + by, r.stop + by)


@dataclass(frozen=True)
class DataPlan:
    """Which global samples each (data step, group, rank) trains."""

    windows: int
    """samples in one epoch of the token store"""
    global_batch: int
    """B: samples one committed step trains in all"""
    local_batch: int
    """samples one rank computes at once (a microbatch)"""
    ranks: int
    groups: int
    policy: BatchPolicy = "constant"
    seed: int = 0

    def group_share(self, data_step: int, group: int, slot: int | None, participants: int) -> range:
        """The global sample numbers group ``group`` trains at ``data_step``: in ``constant`` its
        ``slot`` (participating rank) of the ``participants`` split; in ``shrink`` its own ``1/N``.
        Empty for a group that is not participating (healing, or a spare)."""
        if slot is None or participants < 1:
            return range(0)
        base = data_step * self.global_batch
        if self.policy == "constant":
            return offset(split(self.global_batch, participants, slot), base)
        return offset(split(self.global_batch, self.groups, group), base)

    def rank_share(self, share: range, rank: int) -> range:
        part = split(len(share), self.ranks, rank)
        return offset(part, share.start)

    def microbatch_count(self, participants: int) -> int:
        """How many forward/backward passes every rank of every group makes in a step: enough for
        the step's largest share. The same on each rank of a group (FSDP's collectives pair them)
        and in every group, healing ones included: how FSDP hands the gradients to the
        cross-group all-reduce depends on it (one pass or several: the output layer's and its
        norm's together or apart), and the all-reduces of all groups must pair too."""
        parts = participants if self.policy == "constant" else self.groups
        largest = math.ceil(math.ceil(self.global_batch / max(1, parts)) / self.ranks)
        return max(1, math.ceil(largest / self.local_batch))

    def microbatches(self, share: range, rank: int, participants: int) -> list[range]:
        """This rank's samples of the group's ``share``, as the step's microbatch count of
        near-equal pieces (some empty when the rank has fewer samples than pieces: a group with
        nothing to train still joins the collectives, with zero-weighted samples)."""
        mine = self.rank_share(share, rank)
        count = self.microbatch_count(participants)
        return [offset(split(len(mine), count, i), mine.start) for i in range(count)]

    def loss_divisor(self, participants: int, share: range) -> float:
        """What a rank divides its summed token losses by, in samples (× seq_len for tokens), so
        that after FSDP sums over the group's ranks and torchft averages over the ``participants``
        the gradient is the mean over every sample of the step: ``B / P`` in ``constant`` (the
        shares may differ by one sample); the group's share in ``shrink``, whose shares are equal
        (``B`` divides by N), so the average is over the samples the quorum trained."""
        if self.policy == "constant":
            return self.global_batch / max(1, participants)
        return max(1, len(share))

    def step_samples(self, participants: int) -> int:
        """The samples a step that applied its update trained over every group: the whole batch in
        ``constant`` (the participants split all of it), the ``participants``' equal shares in
        ``shrink``."""
        if self.policy == "constant":
            return self.global_batch
        return min(participants, self.groups) * (self.global_batch // self.groups)

    def window(self, sample: int) -> int:
        """The token-store window global sample ``sample`` reads."""
        epoch, position = divmod(sample, self.windows)
        return _epoch_order(self.seed, epoch, self.windows)[position]


@lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, windows: int) -> list[int]:
    import torch

    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(windows, generator=generator).tolist()


def next_data_step(data_step: int, applied: bool, verdict: str | None) -> int:
    """The data position after a committed step: the batch is consumed when the optimizer took
    it, or when the gradient check blamed the batch itself (``data``: retrying it would fail
    again). A step skipped for a hardware fault (``transient``, ``persistent``) trains the
    same batch again: no sample is lost to a bad chip."""
    return data_step + 1 if applied or verdict == "data" else data_step
