"""The training state a healing rank copies from its peer, and its fingerprint.

torchft's checkpoint transport hands rank r of a healing group the state of rank r of a
healthy group. Both ranks hold the same FSDP shard, so the state is made of LOCAL shards
(``DTensor.to_local()``) and is copied in place on load. The transport serves the live
tensors without copying; that is safe because torchft stops serving at ``should_commit``,
before ``optimizer.step()`` changes them.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

def _take(mine: torch.Tensor, healed: torch.Tensor) -> None:
    """Copy a healed tensor in, unless the heal was received straight into it (the heal
    transport's ``destination``)."""
    if healed.data_ptr() != mine.data_ptr() or healed.shape != mine.shape:
        mine.copy_(healed)


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass
class TrainingPosition:
    """Where the job is besides the step count torchft keeps: ``data_step``, the steps whose global
    batch was consumed (``trainer/data.py``). It travels with the state a heal copies and a
    checkpoint saves, so nobody has to copy a data loader's state."""

    data_step: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"data_step": self.data_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.data_step = int(state["data_step"])


def materialize_optimizer_state(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Create every optimizer's state, so a heal or a checkpoint load can copy into it:
    torchtitan's ``init_optim_state`` (a zero-gradient step at lr 0), then each step count back
    to 0, so the first real step is the optimizer's first."""
    from torchtitan.components.optimizer.utils import init_optim_state

    for optimizer in optimizers:
        init_optim_state(optimizer)
        for state in optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"].zero_()


class LiveState:
    """State-dict functions for torchft's Manager: model, optimizer state (every tensor each
    optimizer keeps per parameter: AdamW's step, exp_avg, exp_avg_sq), LR schedule, position."""

    def __init__(self, group: int, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer],
                 schedulers: Any, position: TrainingPosition):
        """``optimizers`` and ``schedulers``: torchtitan's containers (``OptimizersContainer``,
        ``LRSchedulersContainer``), or anything iterable like them."""
        self.group = group
        self.named_params = list(model.named_parameters())
        self.optimizers = list(optimizers)
        self.schedulers = schedulers
        self.position = position
        self.last_source_group = -1
        self.last_load_s = 0.0
        self.last_applied_at = 0.0

    def _param_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        for optimizer in self.optimizers:
            if param in optimizer.state:
                state = optimizer.state[param]
                return {k: state[k] for k in sorted(state) if torch.is_tensor(state[k])}
        return {}

    def _tensors(self, shards: bool) -> dict[str, Any]:
        """Parameters and optimizer state by parameter name: local shards, or the DTensors."""
        view = local if shards else (lambda t: t)
        return {
            "model": {name: view(p) for name, p in self.named_params},
            "optimizer": {name: {k: view(t) for k, t in self._param_state(p).items()} for name, p in self.named_params},
            "lr_scheduler": self.schedulers.state_dict(),
            "position": self.position.state_dict(),
        }

    def lr(self) -> float:
        """The learning rate the next step uses (the first parameter group's)."""
        return next(iter(self.schedulers)).get_last_lr()[0]

    def restore_schedule(self, state: dict[str, Any]) -> None:
        """torchtitan's schedules are functions of the step: restore it, and every parameter
        group's rate with it (the container restores the schedulers' own only)."""
        self.schedulers.load_state_dict(state["lr_scheduler"])
        for scheduler in self.schedulers:
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr
        self.position.load_state_dict(state["position"])

    def state_dict(self) -> dict[str, Any]:
        """What a healing peer fetches: local shards, served live."""
        return {"source_group": self.group, **self._tensors(shards=True)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        start = time.perf_counter()
        for name, param in self.named_params:
            _take(local(param), state["model"][name])
            theirs = state["optimizer"][name]
            for key, mine in self._param_state(param).items():
                _take(local(mine), theirs[key])
        self.restore_schedule(state)
        self.last_source_group = int(state["source_group"])
        self.last_load_s = time.perf_counter() - start
        self.last_applied_at = time.time()

    def checkpoint_state(self) -> dict[str, Any]:
        """What torch.distributed.checkpoint saves: the sharded DTensors themselves.

        Parameters are keyed by ``named_parameters()`` names rather than ``state_dict()``
        keys: torchtitan's fused QKV layer rewrites its state-dict keys (``wqkv`` into
        ``wq``/``wk``/``wv``), which ``get_model_state_dict`` cannot map back.
        """
        return self._tensors(shards=False)

    def restore_checkpoint(self, state: dict[str, Any]) -> None:
        """After ``dcp.load`` filled the tensors of :meth:`checkpoint_state` in place."""
        self.restore_schedule(state)

    def fingerprint(self) -> str:
        """A digest of this rank's parameter and optimizer shards."""
        return digest(t for _, param in self.named_params
                      for t in (local(param), *map(local, self._param_state(param).values())))


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 (first 16 hex digits) over the tensors' bytes, in order."""
    found = hashlib.sha256()
    for tensor in tensors:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel():  # hashed from its storage: no copy of the bytes first
            found.update(memoryview(flat.view(torch.uint8).numpy()))
    return found.hexdigest()[:16]
