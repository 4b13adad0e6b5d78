"""This project's own torchtitan config-registry entries: jobs that need nothing downloaded.

Each function returns a torchtitan ``Trainer.Config``, as the functions of torchtitan's
``models/*/config_registry.py`` do, and ``--config NAME`` finds them the same way
(:mod:`trainer.job`). They are built from torchtitan's own model registry, loss, optimizer and
schedule; only the vocabulary is resized to fit a tokenizer that needs no files.
"""

from __future__ import annotations

import dataclasses

from trainer.lean_import import import_quietly
from trainer.tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer

LLAMA3 = "torchtitan.models.llama3"


def _vocab(model, size: int):
    """A decoder config with a vocabulary of ``size`` tokens (embedding and output resized)."""
    return dataclasses.replace(
        model, vocab_size=size,
        tok_embeddings=dataclasses.replace(model.tok_embeddings, num_embeddings=size),
        lm_head=dataclasses.replace(model.lm_head, out_features=size))


def _llama3(flavor: str, vocab: int, layers: int | None = None, *, lr: float, warmup_steps: int,
            local_batch_size: int, seq_len: int, loss_chunks: int | None):
    llama3 = import_quietly(LLAMA3)
    titan = import_quietly("torchtitan.trainer")
    loss = import_quietly("torchtitan.components.loss")
    optimizer = import_quietly("torchtitan.components.optimizer")
    configs = import_quietly("torchtitan.config")
    spec = llama3.model_registry(flavor, attn_backend="flex")
    model = _vocab(spec.model, vocab)
    if layers is not None:
        model = dataclasses.replace(model, layers=model.layers[:layers])
    spec = dataclasses.replace(spec, model=model)
    cross_entropy = loss.CrossEntropyLoss.Config(global_vocab_size=vocab)
    return titan.Trainer.Config(
        model_spec=spec,
        tokenizer=ByteTokenizer.Config() if vocab == BYTE_VOCAB_SIZE else titan.Trainer.Config().tokenizer,
        hf_assets_path="",
        loss=cross_entropy if loss_chunks is None else loss.ChunkedLossWrapper.Config(
            num_chunks=loss_chunks, loss_fn=cross_entropy),
        optimizer=optimizer.default_adamw(lr=lr, weight_decay=0.0),
        lr_scheduler=optimizer.LRSchedulersContainer.Config(warmup_steps=warmup_steps, decay_type="cosine",
                                                            min_lr_factor=0.1),
        training=configs.TrainingConfig(local_batch_size=local_batch_size, seq_len=seq_len, steps=200,
                                        max_norm=0.0, mixed_precision_param="float32"),
        activation_checkpoint=None,
    )


def llama3_debugmodel_bytes():
    """torchtitan's Llama 3 debug model (6 layers, dim 256) over UTF-8 bytes: a vocabulary of 256,
    no tokenizer file, the Python standard library's sources as data. ``make up``'s default."""
    return _llama3("debugmodel", BYTE_VOCAB_SIZE, lr=3e-3, warmup_steps=10, local_batch_size=2, seq_len=128,
                   loss_chunks=None)


def llama3_1b_2layers():
    """Two of Llama 3 1B's layers (dim 2048, 32 heads, 8 KV heads, FFN 8192, tied embedding) with an
    8,192-token vocabulary: a model of real layer width, 138M parameters, for a tokenizer trained on
    local text. What ``bench.workloads`` measures beside the byte default."""
    return _llama3("1B", 8192, layers=2, lr=3e-4, warmup_steps=10, local_batch_size=1, seq_len=128,
                   loss_chunks=4)


def llama3_1b():
    """torchtitan's Llama 3 1B flavor (16 layers, dim 2048, tied embedding; 1.24B parameters with its
    128,256-token vocabulary), for a tokenizer of up to that many tokens. What ``bench/gpu_check.sh``
    trains on one GPU: torchtitan's registry has no 1B config, only the flavor."""
    return _llama3("1B", 128256, lr=3e-4, warmup_steps=10, local_batch_size=4, seq_len=1024, loss_chunks=8)
