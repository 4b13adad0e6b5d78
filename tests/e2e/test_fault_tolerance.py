"""The trainer's torchft layer against the real thing: a Manager, a Lighthouse, gloo processes.

``ManagerInternals`` is the one place the trainer reads torchft's private attributes; this test
fails when a torchft upgrade renames or removes one of them, instead of every trainer failing
at its first step.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path

import torch.distributed as dist
from torchft import Manager, ProcessGroupGloo

from cluster import REPO
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


def gloo_members(world: int, mode: str) -> list[str]:
    """Run tests/gloo_member.py as ``world`` processes; every member's output."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).parents[1] / "gloo_member.py"), str(r), str(world),
                               str(port), mode], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for r in range(world)]
    try:
        return [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_group_that_leaves_a_collective_ends_it_for_every_peer_at_once():
    """Without ending its connections, gloo keeps them open while anything holds the group, and
    the peers waiting on it sit out the whole 10 s collective timeout."""
    out = gloo_members(3, "abandon")
    for rank in (0, 2):
        match = re.search(r"failed after ([\d.]+) s", out[rank])
        assert match, out[rank]
        assert float(match.group(1)) < 3.0, out[rank]  # 0.5 s until rank 1 leaves


def test_the_group_leaves_no_rendezvous_keys_a_restarted_lighthouse_could_trip_on():
    out = gloo_members(2, "keys")
    assert "keys left 0" in out[0], out


