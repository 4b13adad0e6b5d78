"""``python -m trainer`` outside torchrun: check the whole job, then become torchrun.

The check builds everything a rank would except the process groups and the model's weights:
the torchtitan config with its overrides, the tokenizer (its vocabulary against the model's),
the dataset (tokenized into its cache now, with progress, so no rank waits for it), the batch
plan, the device. A bad value is one clear line and exit code 2 before any rank starts.
``python -m trainer --check …`` stops there (``ftctl up`` runs it before it starts anything).
"""

from __future__ import annotations

import os
import sys
import time

from protocol.torchrun import torchrun_argv, torchrun_env
from trainer.config import TrainerConfig
from trainer.errors import ConfigError


class TokenizingProgress:
    """A line about every second while a dataset is tokenized."""

    def __init__(self, name: str):
        self.name = name
        self.start = time.monotonic()

    def __call__(self, fraction: float, documents: int, tokens: int) -> None:
        rate = tokens / max(1e-9, time.monotonic() - self.start)
        print(f"tokenizing {self.name}: {100 * fraction:3.0f}%  {documents:,} documents  {tokens:,} tokens  "
              f"({rate / 1e6:.2f}M tokens/s)", flush=True)


def count_parameters(job) -> int:
    import torch

    with torch.device("meta"):
        model = job.model_spec.model.build()
    return sum(p.numel() for p in model.parameters())


def validate(cfg: TrainerConfig, dial_lighthouse: bool = True) -> str:
    """Check the job (ConfigError, one line, when something is wrong); returns a one-line summary."""
    from trainer.advertise import use_advertised_interface
    from trainer.builder import data_plan, open_dataset
    from trainer.fault_tolerance import check_lighthouse_reachable
    from trainer.job import describe, job_config, sync_settings

    use_advertised_interface(cfg)  # before the Lighthouse is dialled: a loopback advertisement is refused as it is
    job = job_config(cfg)
    sync = sync_settings(cfg, job)
    dataset = open_dataset(cfg, job, TokenizingProgress(str(cfg.dataset or "the standard library's sources")))
    plan = data_plan(cfg, job, dataset, cfg.ranks_per_group)
    if cfg.device == "cuda":
        import torch

        if torch.cuda.device_count() < cfg.ranks_per_group:
            raise ConfigError(f"--device cuda needs {cfg.ranks_per_group} GPUs per group, "
                              f"this machine has {torch.cuda.device_count()}")
    resumed = resume_step(cfg, sync.mode)
    if dial_lighthouse:
        check_lighthouse_reachable(cfg.lighthouse)
    return (f"{cfg.config}: {describe(job)}, {count_parameters(job) / 1e6:.1f}M parameters, {cfg.precision}; "
            f"{dataset.samples:,} samples of {dataset.seq_len} tokens per epoch "
            f"({len(dataset.store.tokens):,} tokens, {dataset.store.documents:,} documents); "
            f"global batch {plan.global_batch} ({plan.policy}), {plan.local_batch} per rank at once"
            + (f"; {sync.mode} across groups, a sync every {sync.sync_every} steps"
               + (f" in {sync.fragments} fragments" if sync.fragments > 1 else "") if sync.semi_sync else "")
            + (f"; resuming the job in {cfg.checkpoint_dir} from its checkpoint at step {resumed:,} "
               f"to step {cfg.steps:,}" if resumed is not None else ""))


def resume_step(cfg: TrainerConfig, mode: str) -> int | None:
    """The step of the newest checkpoint an earlier job left in ``--checkpoint-dir`` (None: none),
    which this job resumes from. A job's check (``--check``, before ``ftctl up`` starts anything)
    refuses one at or past ``--steps``: there would be nothing to train; a group's own start
    (a restart near the end) goes on and finishes at once. Either refuses one written in the other
    kind of ``--sync`` (``mode``): ``hsdp`` keeps no synced point and outer optimizer, and counts
    steps where the others count syncs."""
    from trainer.checkpoint import published, step_of, written_semi_sync

    saved = published(cfg.checkpoint_dir) if cfg.checkpoint_dir else []
    if not saved:
        return None
    step = step_of(saved[-1])
    written_semi = written_semi_sync(saved[-1])
    if written_semi is not None and written_semi != (mode != "hsdp"):
        written = "--sync localsgd or diloco" if mode == "hsdp" else "--sync hsdp"
        raise ConfigError(f"the checkpoint in {cfg.checkpoint_dir} (step {step:,}) was written by a {written} job and "
                          f"this one runs --sync {mode}: resume it in its own mode, or start this job with another "
                          "--checkpoint-dir")
    if step >= cfg.steps and cfg.check:
        raise ConfigError(f"the checkpoint in {cfg.checkpoint_dir} is at step {step:,}, past --steps {cfg.steps:,}: "
                          "nothing is left to train; raise --steps, or start a new job in a fresh --state-dir")
    return step


def launch(cfg: TrainerConfig, trainer_args: list[str]) -> None:
    summary = validate(cfg, dial_lighthouse=not cfg.check)
    print(f"{'ok' if cfg.check else 'job'}: {summary}", flush=True)
    if cfg.check:
        return
    argv = torchrun_argv(cfg.ranks_per_group, trainer_args, cfg.advertise_host, cfg.master_port)
    sys.stdout.flush()
    os.execve(argv[0], argv, torchrun_env())
