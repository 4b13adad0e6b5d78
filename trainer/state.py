"""The training state a healing rank copies from its peer, and its fingerprint.

torchft's checkpoint transport hands rank r of a healing group the state of rank r of a
healthy group. Both ranks hold the same FSDP shard, so the state is made of LOCAL shards
(``DTensor.to_local()``) and is copied in place on load. The transport serves the live
tensors without copying; that is safe because torchft stops serving at ``should_commit``,
before ``optimizer.step()`` changes them.
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq")


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass
class TrainingPosition:
    """Where the job is besides the step count torchft keeps."""

    batches_skipped: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"batches_skipped": self.batches_skipped}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batches_skipped = int(state["batches_skipped"])


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state with a zero-gradient step at lr 0, so a heal can copy into it."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, saved):
        group["lr"] = lr
    for state in optimizer.state.values():
        state["step"].zero_()


class LiveState:
    """State-dict functions for torchft's Manager: model, optimizer, LR schedule, position."""

    def __init__(self, group: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, position: TrainingPosition):
        self.group = group
        self.named_params = list(model.named_parameters())
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.position = position
        self.last_load_bytes = 0
        self.last_source_group = -1
        self.last_load_s = 0.0

    def _tensors(self, shards: bool) -> dict[str, Any]:
        """Parameters and optimizer state by parameter name: local shards, or the DTensors."""
        view = local if shards else (lambda t: t)
        opt_state = self.optimizer.state
        return {
            "model": {name: view(p) for name, p in self.named_params},
            "optimizer": {
                name: {"step": opt_state[p]["step"], **{k: view(opt_state[p][k]) for k in OPTIMIZER_KEYS}}
                for name, p in self.named_params
            },
            "lr_scheduler": self.scheduler.state_dict(),
            "position": self.position.state_dict(),
        }

    def _restore_schedule(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["lr_scheduler"])
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
        self.position.load_state_dict(state["position"])

    def state_dict(self) -> dict[str, Any]:
        """What a healing peer fetches: local shards, served live."""
        return {"source_group": self.group, **self._tensors(shards=True)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        start = time.perf_counter()
        nbytes = 0
        for name, param in self.named_params:
            src = state["model"][name]
            local(param).copy_(src)
            nbytes += src.nbytes
            mine, theirs = self.optimizer.state[param], state["optimizer"][name]
            mine["step"].copy_(theirs["step"])
            for key in OPTIMIZER_KEYS:
                local(mine[key]).copy_(theirs[key])
                nbytes += theirs[key].nbytes
        self._restore_schedule(state)
        self.last_source_group = int(state["source_group"])
        self.last_load_bytes = nbytes
        self.last_load_s = time.perf_counter() - start

    def checkpoint_state(self) -> dict[str, Any]:
        """What torch.distributed.checkpoint saves: the sharded DTensors themselves.

        Parameters are keyed by ``named_parameters()`` names rather than ``state_dict()``
        keys: torchtitan's fused QKV layer rewrites its state-dict keys (``wqkv`` into
        ``wq``/``wk``/``wv``), which ``get_model_state_dict`` cannot map back.
        """
        return self._tensors(shards=False)

    def restore_checkpoint(self, state: dict[str, Any]) -> None:
        """After ``dcp.load`` filled the tensors of :meth:`checkpoint_state` in place."""
        self._restore_schedule(state)

    def fingerprint(self) -> str:
        """SHA-256 (first 16 hex digits) over this rank's parameter and optimizer shards."""
        digest = hashlib.sha256()
        for _, param in self.named_params:
            state = self.optimizer.state[param]
            for tensor in (local(param), state["step"], *(local(state[k]) for k in OPTIMIZER_KEYS)):
                t = tensor.detach().to("cpu").contiguous()
                digest.update(ctypes.string_at(t.data_ptr(), t.nbytes))
        return digest.hexdigest()[:16]
