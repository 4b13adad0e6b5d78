"""torchft wiring: the Manager, the fault-tolerant replicate dimension and its timing.

The pattern of torchtitan's ``experiments/torchft/manager.py``: FSDP2 reduce-scatters
gradients inside the group, then every FSDP module's all-reduce hook averages its gradient
shard across replica groups through ``ManagedProcessGroup(manager)``, whose membership is
whatever the current quorum says.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import time
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Callable

import psutil
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
from torchft.manager import REPLICA_ID_KEY, WorldSizeMode
from torchft.process_group import ManagedProcessGroup, ProcessGroup

from protocol.lighthouse import lighthouse_unreachable, status_url
from protocol.replicas import replica_name
from trainer.advertise import advertised_host
from trainer.collective_watch import CollectiveWatch
from trainer.config import TrainerConfig
from trainer.errors import ConfigError
from trainer.heal_peers import LighthousePeers
from trainer.heal_transport import StreamTransport
from trainer.state import local
from trainer.telemetry import ProgressBeacon

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
        """The Lighthouse's id of the quorum the current step trains in (-1 before the first)."""
        client = self.manager._client
        return client.lighthouse_quorum_id if isinstance(client, MembershipQuorumClient) else self.manager._quorum_id

    @property
    def quorum_members(self) -> list[str]:
        """The replica ids of the current quorum's members (empty before the first)."""
        client = self.manager._client
        return client.replica_ids if isinstance(client, MembershipQuorumClient) else []

    @property
    def quorum(self) -> Any | None:
        """The last quorum answer (torchft's ``Quorum``: ``replica_ids``, ``replica_rank``,
        ``replica_world_size``, ``max_step``, ``max_world_size``, …); None before the first."""
        client = self.manager._client
        return client.last if isinstance(client, MembershipQuorumClient) else None

    def quorum_answered_at(self) -> float:
        """Unix time the last quorum answered this rank's Manager."""
        client = self.manager._client
        return client.answered_at if isinstance(client, MembershipQuorumClient) else 0.0

    def replica_id(self) -> str:
        """``group{g}:{uuid}``, as rank 0's Manager registered it with the Lighthouse."""
        return self.manager._store.get(REPLICA_ID_KEY).decode()


def check_lighthouse_reachable(address: str, timeout_s: float = LIGHTHOUSE_PROBE_TIMEOUT_S) -> None:
    try:
        why = lighthouse_unreachable(address, timeout_s)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if why is not None:
        raise ConfigError(
            f"cannot reach the torchft Lighthouse at {address} ({why}); start one "
            "(ftctl up, or torchft_lighthouse) or point --lighthouse / TORCHFT_LIGHTHOUSE at it"
        )


def _connected_tcp_sockets() -> dict[int, int]:
    """This process's connected TCP sockets: file descriptor → inode."""
    found = {}
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.fd >= 0 and conn.raddr:
            try:
                found[conn.fd] = os.fstat(conn.fd).st_ino
            except OSError:
                pass
    return found


class AbortableProcessGroupGloo(ProcessGroupGloo):
    """torchft's ProcessGroupGloo that can really end its connections, and leaves no
    rendezvous keys behind.

    torch 2.13's gloo backend does not close its connections on abort or shutdown, only when
    the process group is destroyed, and an in-flight work keeps it alive: a peer blocked on a
    receive from us waits out the whole collective timeout. So the TCP connections gloo opens
    while the group is created are remembered (file descriptor and inode), and
    :meth:`end_connections` shuts them down: the peers' pending operations, and our own, fail at
    once with "connection closed". The group object stays (its operations keep failing) until
    the next quorum reconfigures it, as after any error.

    Each rank publishes its address under ``{quorum prefix}/0/{rank}`` in the quorum's store.
    A restarted Lighthouse counts quorum ids from 1 again, so a later group could read a key
    the old run left there and connect to a dead address; once every member has connected (a
    barrier), each rank deletes its own key.
    """

    def __init__(self, timeout: timedelta):
        super().__init__(timeout=timeout)
        self._connections: dict[int, int] = {}

    def _create_pg(self, store, rank: int, world_size: int):
        before = _connected_tcp_sockets()
        pg = super()._create_pg(store, rank, world_size)
        self._connections = {fd: inode for fd, inode in _connected_tcp_sockets().items() if before.get(fd) != inode}
        pg.barrier().wait()  # every member has read every address
        store.delete_key(f"0/{rank}")
        return pg

    def end_connections(self) -> None:
        connections, self._connections = self._connections, {}
        for fd, inode in connections.items():
            try:
                if os.fstat(fd).st_ino != inode:  # closed by gloo, the number since reused
                    continue
                with socket.socket(fileno=os.dup(fd)) as sock:  # the duplicate shares the connection
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def abort(self, errored: bool = True) -> None:
        self.end_connections()
        super().abort(errored)


def membership_quorum_id(lighthouse_quorum_id: int, replica_ids: list[str], formed_at_step: int) -> int:
    """A quorum id that changes whenever the membership does, the same in every member.

    torchft 0.2.0's Manager reconfigures its process group only when the quorum id changes,
    and a restarted Lighthouse counts its ids from 0 again: its quorum 2 of groups {0, 1} could
    meet a group still configured for the old Lighthouse's quorum 2 of {1}, which then keeps
    its dead process group while its peers configure a new one (measured: a commit lost and a
    10 s heal). The Lighthouse's id and the members' replica ids (new on every start) name one
    membership, but not one Lighthouse's life: the new Lighthouse's quorum 2 can have the very
    members of the old one's quorum 2 (measured, one restart in four). The step the quorum
    formed at (:class:`QuorumFormation`) tells the two apart."""
    text = f"{lighthouse_quorum_id}|{'|'.join(sorted(replica_ids))}|{formed_at_step}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 11  # JSON-exact: < 2^53


class QuorumFormation:
    """The step at which the current quorum formed, as every member of it computes it.

    A quorum forms in one round of the Lighthouse: every member receives it with the same
    ``max_step``, and then keeps it, step after step, while the membership stays. Within one
    Lighthouse's life a member is never behind inside a quorum it kept: a failed commit makes
    the Lighthouse count a new id. So a quorum that looks kept (the same Lighthouse id and
    members as the last one) while this member is behind was formed anew, by a restarted
    Lighthouse, in the round where its peers saw a new quorum: it formed at ``max_step`` too.
    """

    def __init__(self) -> None:
        self.key: tuple[int, tuple[str, ...]] | None = None
        self.step = -1

    def see(self, lighthouse_quorum_id: int, replica_ids: list[str], my_step: int, max_step: int) -> int:
        """This member's quorum answer; returns the step the quorum formed at."""
        key = (lighthouse_quorum_id, tuple(sorted(replica_ids)))
        if key != self.key or my_step < max_step:
            self.key, self.step = key, max_step
        return self.step


class MembershipQuorumClient:
    """torchft's ManagerClient, whose quorums carry :func:`membership_quorum_id` as their id (the
    Lighthouse's own stays readable as ``lighthouse_quorum_id``)."""

    def __init__(self, client: Any, on_answer: Callable[[Any, int], None]):
        self.client = client
        self.on_answer = on_answer
        self.lighthouse_quorum_id = -1
        self.replica_ids: list[str] = []
        self.last: Any | None = None
        self.answered_at = 0.0
        self.formation = QuorumFormation()

    def _quorum(self, **kwargs: Any) -> "_MembershipQuorum":
        quorum = self.client._quorum(**kwargs)
        self.answered_at = time.time()
        self.on_answer(quorum, kwargs["step"])
        self.lighthouse_quorum_id = quorum.quorum_id
        self.last = quorum
        ids = self.replica_ids = list(quorum.replica_ids)
        formed_at = self.formation.see(quorum.quorum_id, ids, kwargs["step"], quorum.max_step)
        return _MembershipQuorum(quorum, membership_quorum_id(quorum.quorum_id, ids, formed_at))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


class _MembershipQuorum:
    def __init__(self, quorum: Any, quorum_id: int):
        self._quorum = quorum
        self.quorum_id = quorum_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._quorum, name)


class FailFastManager(Manager):
    """torchft's Manager, whose first error of a step also aborts the cross-group process group.

    torchft 0.2.0 keeps the process group open after an error until the next quorum
    reconfigures it, and skips the step's remaining all-reduces. A peer that is still waiting to
    receive from this group (its neighbour in a ring all-reduce, when the dead group was ours)
    then sits out the whole collective timeout: with three groups, two kills in five left a
    survivor in its all-reduce for 10 s. Aborting closes this group's connections at once
    (``AbortableProcessGroupGloo``; NCCL's abort does it itself), so every peer's collective
    fails within milliseconds and the error goes round the ring: the survivors fail the step in
    flight together and meet at the next quorum.

    With a synchronous quorum (``--sync localsgd|diloco``, ``trainer/semi_sync.py``) two more
    things: a group healed at the quorum is not a participant of the step that healed it (torchft
    counts it, and averages its copy of the source's state in as its own contribution), and
    ``commit_veto`` may refuse a step's commit for a reason only the trainer knows.
    """

    def __init__(self, pg: ProcessGroup, **kwargs: Any):
        super().__init__(pg=pg, **kwargs)
        self.replicate_pg = pg
        self._client = MembershipQuorumClient(self._client, on_answer=self._serve_every_heal)
        self.commit_veto: Callable[[], Exception | None] = lambda: None

    def start_quorum(self, *args: Any, **kwargs: Any) -> None:
        super().start_quorum(*args, **kwargs)
        quorum = self._client.last
        if not self._use_async_quorum and quorum is not None and self.errored() is None:
            # as torchft's asynchronous quorum counts: the replicas at the quorum's step only
            self._participating_replica_rank = quorum.max_replica_rank
            self._participating_replica_world_size = quorum.max_world_size

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        if (veto := self.commit_veto()) is not None:
            self.report_error(veto)
        return super().should_commit(timeout)

    def _serve_every_heal(self, quorum: Any, my_step: int) -> None:
        """torchft has only the source it names serve a healing peer; every replica at the
        quorum's step holds the same state, so each serves it (until ``should_commit``
        withdraws it, as torchft's own source does) and a heal can stripe over them all
        (``trainer/heal_transport.py``)."""
        if my_step == quorum.max_step and quorum.replica_world_size > quorum.max_world_size \
                and not quorum.recover_dst_replica_ranks:
            self._checkpoint_transport.send_checkpoint([], quorum.max_step, self._manager_state_dict(), self._timeout)

    def report_error(self, e: Exception) -> None:
        """The step's first error is kept (torchft keeps the last): the cause, such as a lost
        peer, not the broken connections that follow it."""
        if self.errored() is not None:
            return
        super().report_error(e)
        if isinstance(self.replicate_pg, AbortableProcessGroupGloo):
            self.replicate_pg.end_connections()
        else:
            self.replicate_pg.abort()  # NCCL: abort ends the communicator (written, not run on a GPU)


def build_manager(cfg: TrainerConfig, group_rank: int, load_state_dict: Callable[[Any], None],
                  state_dict: Callable[[], Any], async_quorum: bool = True,
                  ) -> tuple[FailFastManager, StreamTransport, LighthousePeers]:
    """torchft's Manager for this rank. ``async_quorum``: each step's quorum overlaps its forward
    (``hsdp``); off for torchft's DiLoCo, which asks for a quorum at each sync and waits for it."""
    timeout = timedelta(seconds=cfg.timeout_s)
    pg = ProcessGroupNCCL(timeout=timeout) if cfg.across_groups == "nccl" else AbortableProcessGroupGloo(timeout=timeout)
    host = advertised_host(cfg)
    peers = LighthousePeers(cfg.lighthouse, group_rank)
    transport = StreamTransport(timeout, host, peers=peers)
    manager = FailFastManager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=cfg.min_replicas,
        use_async_quorum=async_quorum,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
        quorum_retries=max(0, round(cfg.quorum_timeout_s / cfg.quorum_retry_s) - 1),
        connect_timeout=timedelta(seconds=cfg.connect_timeout_s),
        world_size_mode=WorldSizeMode.DYNAMIC if cfg.world_size_mode == "dynamic" else WorldSizeMode.FIXED_WITH_SPARES,
        lighthouse_addr=cfg.lighthouse,
        replica_id=replica_name(cfg.group),
        hostname=host,
        heartbeat_interval=timedelta(milliseconds=cfg.heartbeat_interval_ms),
        checkpoint_transport=transport,
        init_sync=cfg.init_sync,
    )
    transport.destination = manager._manager_state_dict  # heals land in this rank's own tensors
    return manager, transport, peers


def watch_collectives(cfg: TrainerConfig, manager: FailFastManager) -> CollectiveWatch | None:
    """``--collective-watch``: the step's cross-group collectives end as soon as a peer of its
    quorum is shown lost (``trainer/collective_watch.py``), not after ``--timeout-s``."""
    if not cfg.collective_watch:
        return None
    internals = ManagerInternals(manager)
    return CollectiveWatch(status_url(cfg.lighthouse), members=lambda: internals.quorum_members,
                           self_id=functools.cache(internals.replica_id), abort=manager.report_error)


class ReplicateAllReduce:
    """FSDP all-reduce hook over the fault-tolerant replicate group; times the waiting, and
    tells the beacon the rank is waiting on other groups (which is never this group's hang).

    The hook starts each reduce-scattered gradient buffer's cross-group average without waiting
    for it, so the all-reduces of the last layers overlap the backward of the earlier ones, as
    FSDP's own HSDP all-reduce does; :meth:`finish`, after the backward, waits for them all. With
    ``defer`` (the gradient check on) the hook only keeps the buffers; :meth:`finish` averages
    them once the check passed. Either way FSDP's sharded gradients must be views of those
    buffers, so that averaging the buffers in place averages them: :meth:`finish` checks it (a
    torch that copies instead fails loudly, not silently unaveraged), and nothing else may
    touch a buffer after the hook: this builder leaves FSDP no post-divide (gloo reduces by SUM,
    ``trainer/builder.py``) and reduces in the parameters' dtype.

    ``tamper`` sees every buffer before it leaves the rank: where a drill's injected
    corruption lands, as a bad chip's would."""

    def __init__(self, manager: Manager, beacon: ProgressBeacon, defer: bool = False,
                 tamper: Callable[[torch.Tensor], object] = lambda gradient: None,
                 watch: CollectiveWatch | None = None):
        self.group = ManagedProcessGroup(manager)
        self.group.register("dp_replicate")
        self.beacon = beacon
        self.watch = watch
        self.defer = defer
        self.tamper = tamper
        self.model: nn.Module | None = None
        self.pending: list[torch.Tensor] = []
        self.works: list[Any] = []
        self.seconds = 0.0

    def __call__(self, gradient: torch.Tensor) -> None:
        self.tamper(gradient)
        self.pending.append(gradient)
        if not self.defer:
            self.works.append(self._start(gradient))

    def _start(self, gradient: torch.Tensor) -> Any:
        """The buffer's average across groups, started (the first waits for the step's quorum)."""
        self.beacon.enter("allreduce")
        work = dist.all_reduce(gradient, group=self.group, op=dist.ReduceOp.AVG, async_op=True)
        self.beacon.enter("compute")
        return work

    def begin(self) -> None:
        """Before a backward: forget the last one's buffers."""
        self.pending, self.works = [], []
        self.seconds = 0.0

    def finish(self) -> None:
        """After the backward (``defer``: once the check passed): every buffer averaged across
        groups, in place."""
        start = time.perf_counter()
        if self.model is not None:
            self.shard_gradients(self.model)
        works = self.works if not self.defer else [self._start(gradient) for gradient in self.pending]
        self.beacon.enter("allreduce")
        with self.watch.waiting() if self.watch else nullcontext():
            for work in works:
                work.wait()
        self.beacon.enter("compute")
        self.works = []
        self.seconds += time.perf_counter() - start

    def shard_gradients(self, model: nn.Module) -> list[torch.Tensor]:
        """This rank's gradient shards (``defer``: checked to be views of the kept buffers)."""
        grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
        buffers = {b.untyped_storage().data_ptr() for b in self.pending}
        if self.pending and any(g.untyped_storage().data_ptr() not in buffers for g in grads):
            raise RuntimeError("FSDP's sharded gradients are not views of the buffers its all-reduce hook "
                               "received: averaging the buffers across groups would not average the gradients "
                               "with this torch version")
        return grads

    def install(self, model: nn.Module) -> None:
        self.model = model
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(self)
