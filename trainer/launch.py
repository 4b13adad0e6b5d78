"""``python -m trainer`` outside torchrun: check the settings, then become torchrun.

Checking here gives one clear error line for a bad flavor, batch, data path or Lighthouse
address instead of K ranks failing under torchrun.
"""

from __future__ import annotations

import os
import sys

from protocol.torchrun import torchrun_argv, torchrun_env
from trainer.config import TrainerConfig
from trainer.errors import ConfigError

CORPUS_PROBE_BYTES = 1 << 16
"""Enough of the corpus to know it can be read and holds text; the ranks read it all."""


def validate(cfg: TrainerConfig) -> None:
    from trainer.advertise import use_advertised_interface
    from trainer.corpus import read_corpus
    from trainer.fault_tolerance import check_lighthouse_reachable
    from trainer.model import model_config

    cfg.per_rank_batch(cfg.ranks_per_group)
    read_corpus(cfg.data, min(cfg.data_max_bytes, CORPUS_PROBE_BYTES))
    use_advertised_interface(cfg)  # before the Lighthouse is dialled: a loopback advertisement is refused as it is
    check_lighthouse_reachable(cfg.lighthouse)
    model_config(cfg.flavor)  # last: it imports torch and torchtitan
    if cfg.device == "cuda":
        import torch

        if torch.cuda.device_count() < cfg.ranks_per_group:
            raise ConfigError(f"--device cuda needs {cfg.ranks_per_group} GPUs, "
                              f"this machine has {torch.cuda.device_count()}")


def launch(cfg: TrainerConfig, trainer_args: list[str]) -> None:
    validate(cfg)
    argv = torchrun_argv(cfg.ranks_per_group, trainer_args, cfg.advertise_host, cfg.master_port)
    sys.stdout.flush()
    os.execve(argv[0], argv, torchrun_env())
