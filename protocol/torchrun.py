"""How one replica group is started: the torchrun command line and environment of its ranks.

Both ``python -m trainer`` (which execs it) and the agent (which supervises it) build the
command here, so a group started by hand and one started by an agent are the same processes.
"""

from __future__ import annotations

import os
import socket
import sys

from protocol.tokens import without_tokens
from protocol.defaults import LOOPBACK


def free_port(host: str = LOOPBACK) -> int:
    """A port free right now on ``host`` (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_argv(ranks_per_group: int, trainer_args: list[str], master_addr: str | None = None,
                  master_port: int = 0) -> list[str]:
    """The torchrun command that runs one group's ranks with ``trainer_args``.

    The group's TCPStore (torchrun's master) is also where other groups' managers connect
    for the cross-group process group, so ``master_addr`` must be reachable from them.
    """
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={ranks_per_group}",
        f"--master-addr={master_addr or LOOPBACK}",
        f"--master-port={master_port or free_port()}",
        "--max-restarts=0",
        "-m", "trainer", *trainer_args,
    ]


def rank_env(base: dict[str, str], rank: int, ranks: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The environment torchrun (``--nnodes=1 --nproc-per-node=ranks --max-restarts=0``) gives a
    rank, for a launcher that forks the ranks itself (the agent's zygote). Rank 0 hosts the group's
    store (torchrun's agent hosts it instead and says so in TORCHELASTIC_USE_AGENT_STORE)."""
    return {
        **base,
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": "default",
        "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "ROLE_WORLD_SIZE": str(ranks), "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


def torchrun_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a group's torchrun and ranks: no token reaches them."""
    env = without_tokens(dict(os.environ if base is None else base))
    env.setdefault("OMP_NUM_THREADS", "1")  # the group's ranks share the machine's cores
    env.setdefault("RUST_LOG", "warn")  # torchft's Rust manager logs every quorum at INFO
    # pyarrow (torchtitan's config registries import it through Hugging Face datasets) starts a
    # jemalloc background thread at import, and a zygote with a second thread must not fork
    env.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")
    return env
