"""``python -m trainer`` outside torchrun: check the settings, then become torchrun.

Checking here gives one clear error line for a bad flavor, batch, data path or Lighthouse
address instead of K ranks failing under torchrun.
"""

from __future__ import annotations

import os
import socket
import sys

from trainer.config import TrainerConfig
from trainer.errors import ConfigError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_argv(nproc: int, trainer_args: list[str], master_addr: str | None = None,
                  master_port: int = 0) -> list[str]:
    """The torchrun command that runs one group's ``nproc`` ranks with ``trainer_args``.

    The group's TCPStore (torchrun's master) is also where other groups' managers connect
    for the cross-group process group, so ``master_addr`` must be reachable from them.
    """
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        f"--master-addr={master_addr or '127.0.0.1'}",
        f"--master-port={master_port or free_port()}",
        "--max-restarts=0",
        "-m", "trainer", *trainer_args,
    ]


def torchrun_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", "1")  # K ranks share the machine's cores
    env.setdefault("RUST_LOG", "warn")  # torchft's Rust manager logs every quorum at INFO
    return env


def validate(cfg: TrainerConfig) -> None:
    from trainer.corpus import read_corpus
    from trainer.fault_tolerance import check_lighthouse_reachable
    from trainer.model import model_config

    cfg.per_rank_batch(cfg.nproc_per_node)
    read_corpus(cfg.data, min(cfg.data_max_bytes, 1 << 16))
    check_lighthouse_reachable(cfg.lighthouse)
    model_config(cfg.flavor)  # last: it imports torch and torchtitan
    if cfg.device == "cuda":
        import torch

        if torch.cuda.device_count() < cfg.nproc_per_node:
            raise ConfigError(f"--device cuda needs {cfg.nproc_per_node} GPUs, this machine has {torch.cuda.device_count()}")


def launch(cfg: TrainerConfig, trainer_args: list[str]) -> None:
    validate(cfg)
    argv = torchrun_argv(cfg.nproc_per_node, trainer_args, cfg.advertise_host, cfg.master_port)
    sys.stdout.flush()
    os.execve(argv[0], argv, torchrun_env())
