"""torchft wiring: the Manager, the fault-tolerant replicate dimension and its timing.

The pattern of torchtitan's ``experiments/torchft/manager.py``: FSDP2 reduce-scatters
gradients inside the group, then every FSDP module's all-reduce hook averages its gradient
shard across replica groups through ``ManagedProcessGroup(manager)``, whose membership is
whatever the current quorum says.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any, Callable
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
from torchft.checkpointing import CheckpointTransport, HTTPTransport
from torchft.manager import REPLICA_ID_KEY, WorldSizeMode
from torchft.process_group import ManagedProcessGroup

from protocol.replicas import replica_name
from trainer.config import TrainerConfig
from trainer.errors import ConfigError

LIGHTHOUSE_PROBE_TIMEOUT_S = 5.0
"""Before anything is built: a Lighthouse that does not accept a connection this fast is not there."""
TORCHFT_VERSION = "0.2.0"


class ManagerInternals:
    """What this trainer reads of a torchft Manager beyond its public API, in one place.

    Pinned to torchft 0.2.0 (``TORCHFT_VERSION``); tests/test_trainer_units.py builds a real
    Manager and fails when upstream renames or removes any of these.
    """

    def __init__(self, manager: Manager):
        self.manager = manager

    @property
    def healing(self) -> bool:
        """This step loaded state fetched from a peer. Settled once the step's all-reduce has
        waited for the async quorum; read it before ``should_commit``, which resets it."""
        return self.manager._healing

    @property
    def quorum_id(self) -> int:
        """The quorum the current step trains in (-1 before the first)."""
        return self.manager._quorum_id

    def replica_id(self) -> str:
        """``group{g}:{uuid}``, as rank 0's Manager registered it with the Lighthouse."""
        return self.manager._store.get(REPLICA_ID_KEY).decode()


def check_lighthouse_reachable(address: str, timeout_s: float = LIGHTHOUSE_PROBE_TIMEOUT_S) -> None:
    parts = urlsplit(address if "://" in address else f"http://{address}")
    if not parts.hostname or not parts.port:
        raise ConfigError(f"--lighthouse {address!r} is not host:port or http://host:port")
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=timeout_s).close()
    except OSError as err:
        raise ConfigError(
            f"cannot reach the torchft Lighthouse at {address} ({err.strerror or err}); start one "
            "(ftctl up, or torchft_lighthouse) or point --lighthouse / TORCHFT_LIGHTHOUSE at it"
        ) from None


class TimedTransport(CheckpointTransport[Any]):
    """HTTPTransport that records how long the last heal fetch took, and can advertise a host."""

    def __init__(self, inner: HTTPTransport, advertise_host: str | None):
        self.inner = inner
        self.advertise_host = advertise_host
        self.last_fetch_s = 0.0

    def metadata(self) -> str:
        url = self.inner.metadata()
        if self.advertise_host:
            parts = urlsplit(url)
            url = parts._replace(netloc=f"{self.advertise_host}:{parts.port}").geturl()
        return url

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
        self.inner.send_checkpoint(dst_ranks, step, state_dict, timeout)

    def disallow_checkpoint(self) -> None:
        self.inner.disallow_checkpoint()

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        start = time.perf_counter()
        try:
            return self.inner.recv_checkpoint(src_rank, metadata, step, timeout)
        finally:
            self.last_fetch_s = time.perf_counter() - start

    def shutdown(self, wait: bool = True) -> None:
        self.inner.shutdown(wait)


def build_manager(cfg: TrainerConfig, load_state_dict: Callable[[Any], None],
                  state_dict: Callable[[], Any]) -> tuple[Manager, TimedTransport]:
    timeout = timedelta(seconds=cfg.timeout_s)
    pg = ProcessGroupNCCL(timeout=timeout) if cfg.device == "cuda" else ProcessGroupGloo(timeout=timeout)
    transport = TimedTransport(HTTPTransport(timeout=timeout, num_chunks=0), cfg.advertise_host)
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=cfg.min_replicas,
        use_async_quorum=True,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
        connect_timeout=timedelta(seconds=cfg.connect_timeout_s),
        world_size_mode=WorldSizeMode.DYNAMIC if cfg.world_size_mode == "dynamic" else WorldSizeMode.FIXED_WITH_SPARES,
        lighthouse_addr=cfg.lighthouse,
        replica_id=replica_name(cfg.group),
        hostname=cfg.advertise_host or socket.gethostname(),
        heartbeat_interval=timedelta(milliseconds=cfg.heartbeat_interval_ms),
        checkpoint_transport=transport,
        init_sync=cfg.init_sync,
    )
    return manager, transport


class ReplicateAllReduce:
    """FSDP all-reduce hook over the fault-tolerant replicate group; times the waiting."""

    def __init__(self, manager: Manager):
        self.group = ManagedProcessGroup(manager)
        self.group.register("dp_replicate")
        self.seconds = 0.0

    def __call__(self, gradient: torch.Tensor) -> None:
        start = time.perf_counter()
        dist.all_reduce(gradient, group=self.group, op=dist.ReduceOp.AVG)
        self.seconds += time.perf_counter() - start

    def install(self, model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(self)
