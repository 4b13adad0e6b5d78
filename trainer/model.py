"""Build torchtitan's Llama 3 for byte-level tokens and shard it with FSDP2 inside a group."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from trainer.cpu_compat import use_sdpa_attention
from trainer.errors import ConfigError
from trainer.lean_import import import_llama3

VOCAB_SIZE = 256  # byte-level tokens: no tokenizer to download


def model_config(flavor: str):
    """The flavor's config with a 256-token vocabulary and plain SDPA attention."""
    llama3_configs = import_llama3().llama3_configs
    if flavor not in llama3_configs:
        raise ConfigError(f"unknown --flavor {flavor!r}; choose one of {', '.join(llama3_configs)}")
    config = llama3_configs[flavor](attn_backend="flex")
    config = dataclasses.replace(
        config,
        vocab_size=VOCAB_SIZE,
        tok_embeddings=dataclasses.replace(config.tok_embeddings, num_embeddings=VOCAB_SIZE),
        lm_head=dataclasses.replace(config.lm_head, out_features=VOCAB_SIZE),
    )
    return use_sdpa_attention(config)


def build_sharded_model(flavor: str, mesh: DeviceMesh, device: torch.device, seed: int) -> nn.Module:
    """Build on the meta device, shard every transformer block and the root, then initialise.

    Every rank of every group seeds identically, so all groups start from the same weights.
    """
    config = model_config(flavor)
    with torch.device("meta"):
        model = config.build()
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_states(buffer_device=device)
    model.train()
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
