"""The job a user brings, as every process that passes it on knows it (no torch).

``ftctl up`` takes these settings and hands them to every group's trainer as its flags
(:meth:`JobSettings.trainer_args`); the trainer (``trainer/config.py``) takes the same fields
and resolves them against the torchtitan config (``trainer/job.py``). A field left unset means
"what the config says", decided by the trainer alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

DEFAULT_CONFIG = "llama3_debugmodel_bytes"
BatchPolicy = Literal["constant", "shrink"]
Precision = Literal["bf16", "fp32"]
SyncMode = Literal["hsdp", "localsgd", "diloco"]


class JobSettings(BaseModel):
    """A torchtitan config-registry entry and the overrides a user changes per run."""

    config: str = Field(DEFAULT_CONFIG, description="torchtitan config-registry function: llama3_debugmodel, "
                        "qwen3_debugmodel, llama3_8b, … (torchtitan's), llama3_debugmodel_bytes (ours: a byte "
                        "vocabulary, nothing to download), or MODULE:FUNCTION for your own")
    tokenizer: Path | None = Field(None, description="Hugging Face tokenizer folder (tokenizer.json, "
                                   "tokenizer_config.json); default: the config's")
    dataset: Path | None = Field(None, description="JSONL, text or Parquet file, a folder saved by Hugging Face "
                                 "datasets, or a folder of such files; default: the Python standard library's sources")
    text_field: str = Field("text", min_length=1, description="the JSONL field / column holding each document's text")
    data_max_bytes: int | None = Field(None, ge=1024, description="read at most this many bytes of --dataset "
                                       "(default: all of it; 8 MiB of the standard library without --dataset)")
    token_cache: Path | None = Field(None, description="where the tokenized dataset is kept (default: beside it, "
                                     "DATASET.tokens/; the standard library's in ~/.cache/ftservice/tokens)")
    seq_len: int | None = Field(None, ge=8, description="tokens per sample (default: the config's)")
    local_batch_size: int | None = Field(None, ge=1, description="samples one rank computes at once, a microbatch "
                                         "(default: the config's)")
    global_batch_size: int | None = Field(None, ge=1, description="samples one committed step trains over every "
                                          "group (default: groups × ranks per group × local batch size)")
    batch_policy: BatchPolicy = Field("constant", description="constant: the groups in the step's quorum split the "
                                      "global batch (accumulating gradients when fewer), every sample is trained "
                                      "once; shrink: each group trains its own share and a missing group's share "
                                      "is skipped (and counted)")
    lr: float | None = Field(None, gt=0, description="peak learning rate (default: the config's)")
    warmup_steps: int | None = Field(None, ge=0, description="learning-rate warm-up steps (default: the config's)")
    decay_type: Literal["linear", "sqrt", "cosine"] | None = Field(None, description="learning-rate decay after the "
                                                                   "warm-up (default: the config's)")
    min_lr_factor: float | None = Field(None, ge=0, le=1, description="the learning rate decays to this share of "
                                        "the peak (default: the config's)")
    dtype: Precision | None = Field(None, description="compute precision: FSDP2 mixed precision with bf16 parameters "
                                    "in forward and backward, fp32 reductions and optimizer (default: bf16 on cuda, "
                                    "fp32 on cpu, whose bf16 matrix products are 8-50× slower without AVX512-BF16 "
                                    "or AMX)")
    activation_checkpoint: Literal["none", "selective", "full"] | None = Field(
        None, description="torchtitan's activation checkpointing (default: the config's)")
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="cpu: gloo inside and across groups. cuda: NCCL inside each group (a GPU per rank), "
        "across groups --replicate-backend (written, not yet run on a GPU: bench/gpu_check.sh checks it)")
    replicate_backend: Literal["gloo", "nccl"] | None = Field(
        None, description="the process group across groups: gloo (the default on cpu, and torchtitan's torchft "
        "default; the only choice for groups that share one GPU) or nccl (the default on cuda)")
    compile: bool = Field(False, description="torch.compile each transformer block and the loss (the first step "
                          "compiles: 30 s for the debug model on a 2-core CPU)")
    max_norm: float | None = Field(None, ge=0, description="clip gradients to this global norm (over every group, "
                                   "after averaging; 0: no clipping; default: the config's)")

    sync: SyncMode | None = Field(None, description="how groups train together: hsdp averages every step's "
                                  "gradients across groups; localsgd and diloco train --sync-every steps inside "
                                  "each group, then average across groups once (torchft's DiLoCo: localsgd takes "
                                  "the average, diloco an outer Nesterov step on it); for slow links between groups "
                                  "(default: the config's fault_tolerance.semi_sync_method, else hsdp)")
    sync_every: int | None = Field(None, ge=1, description="localsgd/diloco: inner steps between two syncs, H "
                                   "(default: the config's fault_tolerance.sync_steps, else 20)")
    fragments: int | None = Field(None, ge=1, description="diloco/localsgd: sync the model in this many fragments, "
                                  "one every H/F steps (streaming DiLoCo; default: the config's "
                                  "fault_tolerance.num_fragments, else 1)")
    outer_lr: float | None = Field(None, gt=0, description="diloco: the outer optimizer's learning rate (Nesterov "
                                   "SGD on the averaged pseudo-gradient; default 0.7, torchtitan's)")
    outer_momentum: float | None = Field(None, ge=0, lt=1, description="diloco: the outer optimizer's momentum "
                                         "(default 0.9, torchtitan's)")

    def trainer_args(self) -> list[str]:
        """These settings as the trainer's flags: each one set (paths made absolute, for the ranks
        run elsewhere than the command that took them)."""
        args: list[str] = []
        for name in JobSettings.model_fields:
            value = getattr(self, name)
            if name in self.model_fields_set and value is not None:
                flag = "--" + name.replace("_", "-")
                if isinstance(value, bool):
                    args.append(flag if value else f"--no-{name.replace('_', '-')}")
                else:
                    args += [flag, str(value.absolute() if isinstance(value, Path) else value)]
        return args
