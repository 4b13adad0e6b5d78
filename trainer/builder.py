"""What a rank builds before its loop, from torchtitan's own components.

The job's torchtitan config (:mod:`trainer.job`) gives the model spec, loss, optimizer and
schedule containers, activation checkpointing, compile and mixed precision; torchtitan's
``parallelize_fn`` applies them and FSDP2 over the group's ranks. What this module adds is what
a torchtitan ``Trainer.__init__`` cannot give a fault-tolerant job: the data as an index
(:mod:`trainer.dataset`, :mod:`trainer.data`) instead of a stream, and optimizer state that
exists before the first step (a heal copies into it).

torchtitan's ``Trainer.__init__`` is not reused: it builds its own process groups, data loader
(a stream), checkpointer and metrics, and torchtitan's ``FaultTolerantTrainer`` copies all 300
of its lines to change a few. Composing the components lets this builder build the same model
while a warm spare waits outside the quorum, and the classic baseline
(``bench/classic_trainer.py``) build it too, on a 2-D mesh.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.fsdp import FSDPModule

from trainer.config import TrainerConfig
from trainer.cpu_compat import use_device_type
from trainer.data import DataPlan
from trainer.dataset import DataSource, TokenStore, open_tokens
from trainer.errors import ConfigError
from trainer.job import SyncSettings, describe, job_config, model_limits, sync_settings
from trainer.state import LiveState, TrainingPosition, materialize_optimizer_state
from trainer.tokenizer import build_tokenizer, tokenizer_identity

IGNORE_INDEX = -100
"""torchtitan's cross-entropy ignores these labels: a zero-weighted sample."""
ZERO_WEIGHT_TOKENS = 8
"""The length of a zero-weighted sample: a multiple of the chunks torchtitan's chunked loss cuts
a sequence into (8 at most in its configs)."""


def init_device(cfg: TrainerConfig) -> tuple[torch.device, str]:
    """The rank's device and its intra-group backend."""
    if cfg.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def parallel_dims(device: torch.device, replicate: int, shard: int) -> Any:
    """torchtitan's ``ParallelDims`` for FSDP over ``shard`` ranks (and, for the classic
    baseline, HSDP over ``replicate`` groups of them), its meshes built on ``device``."""
    from torchtitan.distributed import ParallelDims

    dims = ParallelDims(dp_replicate=replicate, dp_shard=shard, cp=1, tp=1, pp=1, ep=1,
                        world_size=replicate * shard, spmd_backend="partial_dtensor")
    use_device_type(device.type)
    dims.build_mesh()
    return dims


@dataclass(frozen=True)
class Dataset:
    """The job's tokenizer and tokenized data, and what a check reports of them."""

    tokenizer: Any
    store: TokenStore
    seq_len: int

    @property
    def samples(self) -> int:
        return self.store.windows(self.seq_len)


def open_dataset(cfg: TrainerConfig, job: Any, progress=None) -> Dataset:
    """The tokenizer and the tokenized dataset, checked against the model: one ConfigError line
    for a vocabulary the model cannot hold, a sequence longer than it allows, or too little text."""
    vocab, longest = model_limits(job)
    seq_len = job.training.seq_len
    if seq_len > longest:
        raise ConfigError(f"--seq-len {seq_len} is longer than {cfg.config} allows ({longest} tokens)")
    named = "--tokenizer" if cfg.tokenizer is not None else f"{cfg.config}'s tokenizer folder"
    tokenizer = build_tokenizer(job.tokenizer, job.hf_assets_path, named)
    if tokenizer.get_vocab_size() > vocab:
        raise ConfigError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens but {cfg.config}'s embedding holds "
                          f"{vocab}; give a tokenizer of at most {vocab} tokens or a config with a larger vocabulary")
    source = DataSource(cfg.dataset, cfg.text_field, cfg.data_max_bytes)
    store = open_tokens(source, tokenizer, tokenizer_identity(tokenizer), cfg.token_cache, progress)
    dataset = Dataset(tokenizer, store, seq_len)
    if dataset.samples < 1:
        raise ConfigError(f"--dataset {source.name} holds {len(store.tokens)} tokens, fewer than one sample of "
                          f"--seq-len {seq_len}")
    return dataset


def data_plan(cfg: TrainerConfig, job: Any, dataset: Dataset, ranks: int) -> DataPlan:
    local = job.training.local_batch_size
    return DataPlan(windows=dataset.samples, global_batch=cfg.global_batch(local), local_batch=local, ranks=ranks,
                    groups=cfg.groups, policy=cfg.batch_policy, seed=cfg.seed)


def build_model(job: Any, dims: Any, device: torch.device, seed: int) -> torch.nn.Module:
    """torchtitan's model of the job, built on the meta device, parallelised by the model's own
    ``parallelize_fn`` (activation checkpointing, compile, FSDP2 with mixed precision), then
    initialised. Every rank of every group seeds alike, so all groups start from the same weights."""
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools import utils

    spec = job.model_spec
    dist_utils.set_spmd_backend(job.parallelism.spmd_backend)
    spec.model.update_from_config(config=job)
    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[job.training.dtype]):
        model = spec.model.build()
    model = spec.parallelize_fn(model, parallel_dims=dims, training=job.training, parallelism=job.parallelism,
                                compile_config=job.compile, ac_config=job.activation_checkpoint,
                                dump_folder=job.dump_folder)
    if device.type == "cpu":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # torchtitan divides the loss itself (FSDP's division off), so FSDP reduces with
                # PREMUL_SUM, which gloo lacks; a plain SUM is the same with a factor of 1
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


@contextmanager
def gradient_sync(model: torch.nn.Module, on: bool) -> Iterator[None]:
    """FSDP reduces gradients in this microbatch (``on``) or only accumulates them. torchtitan's
    ``ChunkedLossWrapper`` turns its output layer's sync on for its last chunk whatever the
    microbatch; in one that is not the group's last, the modules' own switch is held off meanwhile."""
    model.set_requires_gradient_sync(on)
    held = [] if on else [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in held:
        module.set_requires_gradient_sync = _kept_off  # an instance attribute shadows the method
    try:
        yield
    finally:
        for module in held:
            del module.set_requires_gradient_sync


def _kept_off(*args: Any, **kwargs: Any) -> None:
    pass


@dataclass
class Training:
    """One rank's model, optimizer, schedule, loss and data, and how long building them took."""

    device: torch.device
    group: int
    rank: int
    job: Any
    model: torch.nn.Module
    optimizers: Any
    schedulers: Any
    loss_fn: Any
    dataset: Dataset
    plan: DataPlan
    position: TrainingPosition
    live: LiveState
    sync: SyncSettings
    data_s: float = 0.0
    model_s: float = 0.0
    parameters: int = 0

    @property
    def seq_len(self) -> int:
        return self.dataset.seq_len

    def start_fields(self, cfg: TrainerConfig) -> dict[str, Any]:
        """What a start event says of the job and of building it (``protocol.events.StartEvent``)."""
        return dict(config=cfg.config, model=describe(self.job), dtype=cfg.precision,
                    tokenizer=self.job.hf_assets_path or "bytes", dataset=str(cfg.dataset or "stdlib"),
                    dataset_samples=self.dataset.samples, seq_len=self.seq_len, local_batch_size=self.plan.local_batch,
                    global_batch_size=self.plan.global_batch, batch_policy=self.plan.policy, steps=cfg.steps,
                    parameters=self.parameters, data_s=self.data_s, model_s=self.model_s)

    def _batch(self, samples: range) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of global samples ``samples``. An empty range is one short sample every
        label of which is ignored: it joins FSDP's collectives, costs next to no compute and adds
        nothing to any gradient."""
        if not samples:
            inputs = torch.zeros((1, ZERO_WEIGHT_TOKENS), dtype=torch.long, device=self.device)
            return inputs, torch.full_like(inputs, IGNORE_INDEX)
        rows = [self.dataset.store.window(self.plan.window(n), self.seq_len) for n in samples]
        block = torch.from_numpy(np.stack(rows)).to(self.device)
        return block[:, :-1], block[:, 1:]

    def forward_backward(self, share: range, participants: int, divisor: float) -> float | None:
        """Gradients of this rank's part of the group's ``share``, accumulated over microbatches
        (as many as the step's ``participants`` make every group take), each summed token loss
        divided by ``divisor`` samples' tokens (see ``DataPlan.loss_divisor``). FSDP reduces
        only after the last microbatch, so the cross-group all-reduce hook runs once per FSDP
        module and step, alike in every group. Returns this rank's mean token loss, None when it
        trained no sample."""
        pieces = self.plan.microbatches(share, self.rank, participants)
        scale = torch.tensor(divisor * self.seq_len, dtype=torch.float32, device=self.device)
        total, tokens = 0.0, 0
        for i, samples in enumerate(pieces):
            inputs, labels = self._batch(samples)
            with gradient_sync(self.model, on=i == len(pieces) - 1):
                loss, _ = self.loss_fn(self.model(inputs), labels, scale)
                loss.backward()
            if samples:
                total += loss.item() * scale.item()
                tokens += labels.numel()
        return total / tokens if tokens else None


def build_training(cfg: TrainerConfig, dims: Any, device: torch.device, group: int, rank: int, ranks: int,
                   job: Any | None = None) -> Training:
    from torchtitan.components.loss import ChunkedLossWrapper

    start = time.time()
    job = job or job_config(cfg)
    sync = sync_settings(cfg, job)
    dataset = open_dataset(cfg, job)
    plan = data_plan(cfg, job, dataset, ranks)
    data_done = time.time()
    model = build_model(job, dims, device, cfg.seed)
    loss_fn = job.loss.build(compile_config=job.compile)
    if isinstance(loss_fn, ChunkedLossWrapper):  # the loss applies the output layer chunk by chunk
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    optimizers = job.optimizer.build(model_parts=[model])
    if job.model_spec.post_optimizer_build_fn is not None:
        job.model_spec.post_optimizer_build_fn(optimizers, [model], dims)
    materialize_optimizer_state(optimizers)
    schedulers = job.lr_scheduler.build(optimizers=optimizers, training_steps=cfg.steps)
    position = TrainingPosition()
    live = LiveState(group, model, optimizers, schedulers, position)
    return Training(device, group, rank, job, model, optimizers, schedulers, loss_fn, dataset, plan, position, live, sync,
                    data_s=data_done - start, model_s=time.time() - data_done,
                    parameters=sum(p.numel() for p in model.parameters()))

