"""The trainer's reads of torchft internals, against a real Manager and a real Lighthouse.

``ManagerInternals`` is the one place the trainer reads torchft's private attributes; this test
fails when a torchft upgrade renames or removes one of them, instead of every trainer failing
at its first step.
"""

from __future__ import annotations

from datetime import timedelta
from importlib.metadata import version

import torch.distributed as dist
from torchft import Manager, ProcessGroupGloo

from protocol.replicas import group_of, replica_name
from protocol.torchrun import free_port
from trainer.fault_tolerance import TORCHFT_VERSION, ManagerInternals


def test_the_manager_internals_the_trainer_reads_exist_in_the_pinned_torchft(lighthouse):
    assert version("torchft") == TORCHFT_VERSION, "torchft changed: check ManagerInternals against its Manager"
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=10)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                      min_replica_size=1, rank=0, world_size=1, store_addr="127.0.0.1", store_port=port,
                      lighthouse_addr=lighthouse, replica_id=replica_name(3), hostname="127.0.0.1",
                      timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)
    try:
        internals = ManagerInternals(manager)
        assert internals.quorum_id == -1 and internals.healing is False
        replica_id = internals.replica_id()
        assert replica_id.startswith("group3:") and group_of(replica_id) == 3
        manager.start_quorum()
        assert manager.num_participants() == 1  # waits for the quorum
        assert internals.quorum_id == 1 and internals.healing is False
    finally:
        manager.shutdown(wait=False)
        del store
