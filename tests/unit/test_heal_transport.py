"""The heal transport between real servers on loopback: every dtype and shape arrives bitwise,
striped over every live peer; a source killed mid-heal leaves its pieces to the others; a byte
flipped in flight fails the heal naming the tensor; nothing but tensors and JSON values travels,
and it serves on its own address alone."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from heal_source import state as source_state
from processes import Owner
from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

from protocol.heal import pieces, segments
from trainer.heal_peers import LighthousePeers
from trainer.heal_transport import HealError, StreamTransport

TIMEOUT = timedelta(seconds=10)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def pair():
    serving, fetching = StreamTransport(TIMEOUT, "127.0.0.1"), StreamTransport(TIMEOUT, "127.0.0.1")
    yield serving, fetching
    serving.shutdown()
    fetching.shutdown()


@pytest.fixture
def one_rank_mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DeviceMesh("cpu", [0])
    dist.destroy_process_group()


def state() -> dict:
    torch.manual_seed(0)
    return {"user": {"model": {"w": torch.randn(64, 33), "b": torch.randn(7).to(torch.bfloat16),
                               "empty": torch.empty(0, 4), "t": torch.arange(24.0).reshape(4, 6).t()},
                     "optimizer": {"w": {"step": torch.tensor(9, dtype=torch.int64), "mask": torch.rand(5) > 0.5}},
                     "lr_scheduler": {"base_lrs": [0.1], "last_epoch": 3, "lr_lambdas": [None], "name": "warmup",
                                      "best": float("inf")}},
            "torchft": {"step": 3, "batches_committed": 6}}


def tensors_equal(sent, healed) -> bool:
    a, b = torch.utils._pytree.tree_leaves(sent), torch.utils._pytree.tree_leaves(healed)
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
               for x, y in zip(a, b, strict=True) if isinstance(x, torch.Tensor))


def test_segments_cut_the_run_of_tensors_at_their_borders_and_skip_empty_ones():
    assert list(segments([4, 0, 6, 2], 0, 12)) == [(0, 0, 4), (2, 0, 6), (3, 0, 2)]
    assert list(segments([4, 0, 6, 2], 3, 9)) == [(0, 3, 4), (2, 0, 5)]
    assert list(segments([4, 6], 0, 0)) == []
    mib = 2**20
    assert pieces(12 * mib, 1) == [(0, 3 * mib), (3 * mib, 6 * mib), (6 * mib, 9 * mib), (9 * mib, 12 * mib)]
    assert len(pieces(12 * mib, 1, largest=2 * mib)) == 6
    assert len(pieces(60 * mib, 2)) == 8 and len(pieces(4 * 2**30, 2)) == 64 and pieces(0, 3) == []
    assert pieces(3 * mib // 2, 3) == [(0, mib), (mib, 3 * mib // 2)], "no piece under a MiB"


def test_every_dtype_and_shape_arrives_bitwise_with_the_values_around_it(pair, one_rank_mesh):
    serving, fetching = pair
    sent = state()
    sent["user"]["model"]["sharded"] = distribute_tensor(torch.randn(8, 3), one_rank_mesh, [Shard(0)]).to_local()
    serving.send_checkpoint([1], 3, sent, TIMEOUT)
    healed = fetching.recv_checkpoint(0, serving.metadata(), 3, TIMEOUT)
    assert tensors_equal(sent["user"], healed["user"])
    assert healed["user"]["lr_scheduler"] == sent["user"]["lr_scheduler"] and healed["torchft"] == sent["torchft"]
    report = fetching.last_fetch
    assert report.bytes == sum(t.nbytes for t in torch.utils._pytree.tree_leaves(sent) if isinstance(t, torch.Tensor))
    assert report.sources == [serving.metadata()] and report.checksum_s < report.transfer_s
    assert serving.metadata().startswith("http://127.0.0.1:")


def test_a_heal_lands_in_the_healing_ranks_own_tensors_when_they_match(pair):
    """No second copy of the state: the healing rank's own (stale) tensors receive the bytes;
    a state of another shape is received into new tensors instead."""
    serving, fetching = pair
    sent = state()
    own = state()
    for tensor in torch.utils._pytree.tree_leaves(own["user"]["model"]):
        tensor.zero_()
    serving.send_checkpoint([1], 3, sent, TIMEOUT)
    fetching.destination = lambda: own
    healed = fetching.recv_checkpoint(0, serving.metadata(), 3, TIMEOUT)
    transposed = own["user"]["model"]["t"]  # not in C order: received apart, copied in when applied
    assert tensors_equal(sent["user"], healed["user"])
    assert torch.equal(own["user"]["model"]["w"], sent["user"]["model"]["w"])
    assert healed["user"]["model"]["w"].data_ptr() == own["user"]["model"]["w"].data_ptr()
    assert healed["user"]["model"]["t"].data_ptr() != transposed.data_ptr()
    assert fetching.last_fetch.in_place_bytes == fetching.last_fetch.bytes - transposed.nbytes
    fetching.destination = lambda: {"user": {"model": {"w": torch.zeros(3)}}}
    other = fetching.recv_checkpoint(0, serving.metadata(), 3, TIMEOUT)
    assert tensors_equal(sent["user"], other["user"]) and fetching.last_fetch.in_place_bytes == 0


def test_every_live_peer_sends_a_share_of_the_pieces():
    sent = {"user": {"model": {f"w{i}": torch.randn(2**18) for i in range(32)}}, "torchft": {"step": 2}}
    sources = [StreamTransport(TIMEOUT, "127.0.0.1") for _ in range(3)]
    urls = [s.metadata() for s in sources]
    fetching = StreamTransport(TIMEOUT, "127.0.0.1", peers=lambda step: urls[1:] if step == 2 else [],
                               piece_bytes=2**20)
    try:
        for source in sources:
            source.send_checkpoint([1], 2, sent, TIMEOUT)
        healed = fetching.recv_checkpoint(0, urls[0], 2, TIMEOUT)
        assert tensors_equal(sent, healed)
        report = fetching.last_fetch
        assert sorted(report.sources) == sorted(urls) and sum(report.by_source.values()) == report.bytes == 32 * 2**20
        assert not report.failed
    finally:
        for transport in (*sources, fetching):
            transport.shutdown()


def test_without_other_peers_a_heal_uses_torchfts_source_alone(pair, lighthouse):
    """An empty quorum names no peers; a Lighthouse that cannot be read costs the extra sources,
    never the heal, and the report says why."""
    serving, fetching = pair
    assert LighthousePeers(lighthouse, group_rank=0)(3) == []
    gone = socket.create_server(("127.0.0.1", 0))
    port = gone.getsockname()[1]
    gone.close()
    fetching.peers = LighthousePeers(f"http://127.0.0.1:{port}", group_rank=0)
    serving.send_checkpoint([1], 3, state(), TIMEOUT)
    healed = fetching.recv_checkpoint(0, serving.metadata(), 3, TIMEOUT)
    assert tensors_equal(state()["user"], healed["user"]) and fetching.last_fetch.sources == [serving.metadata()]
    assert "Connection refused" in fetching.last_fetch.peers_error


def test_a_source_killed_mid_heal_leaves_its_pieces_to_the_other():
    """Two real processes serve the same state; the second is SIGKILLed once it has sent a
    piece and a half: the heal completes, bitwise, from the first."""
    mib = 48
    with Owner() as owner:
        procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "heal_source.py"), "7", str(mib)],
                                  stdout=subprocess.PIPE, text=True, env=owner.env(OMP_NUM_THREADS="1",
                                                                                   PYTHONPATH=str(ROOT)))
                 for _ in range(2)]
        first, second = (p.stdout.readline().strip() for p in procs)
        piece = 2**20
        fetching = StreamTransport(TIMEOUT, "127.0.0.1", peers=lambda step: [second], piece_bytes=piece)
        got = {first: 0, second: 0}

        def kill_the_second_mid_piece(url: str, n: int) -> None:
            got[url] += n
            if url == second and got[url] >= 1.5 * piece and procs[1].poll() is None:
                os.kill(procs[1].pid, signal.SIGKILL)
                procs[1].wait()

        fetching.on_bytes = kill_the_second_mid_piece
        try:
            healed = fetching.recv_checkpoint(0, first, 7, TIMEOUT)
        finally:
            fetching.shutdown()
        report = fetching.last_fetch
        assert procs[1].returncode == -signal.SIGKILL
        assert tensors_equal(source_state(mib), healed)
        assert second in report.failed and 0 < report.by_source[second] < report.bytes
        assert report.by_source[first] + report.by_source[second] == report.bytes == mib * 2**20


def test_only_the_step_being_served_is_served_and_only_until_it_is_withdrawn(pair):
    serving, fetching = pair
    serving.send_checkpoint([1], 3, state(), TIMEOUT)
    with pytest.raises(HealError, match="refused step 4: 409 .*serving step 3"):
        fetching.recv_checkpoint(0, serving.metadata(), 4, TIMEOUT)
    serving.disallow_checkpoint()
    with pytest.raises(HealError, match="no peer served step 3"):
        fetching.recv_checkpoint(0, serving.metadata(), 3, timedelta(seconds=1))


class _RunsCode:
    """What a pickle would run: never sent, since nothing is pickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_a_state_holding_anything_but_tensors_and_json_values_is_refused(pair, tmp_path):
    serving, fetching = pair
    marker = tmp_path / "ran"
    serving.send_checkpoint([1], 4, {"user": {"weights": torch.ones(2), "hook": _RunsCode(marker)}}, TIMEOUT)
    with pytest.raises(HealError, match=r"422 .*_RunsCode at \['user'\]\['hook'\]: only tensors and JSON values heal"):
        fetching.recv_checkpoint(0, serving.metadata(), 4, TIMEOUT)
    assert not marker.exists()


def _read_http_message(sock: socket.socket, pending: bytearray) -> bytes | None:
    """One HTTP message (head, and a body of Content-Length bytes) off ``sock``."""
    while b"\r\n\r\n" not in pending:
        chunk = sock.recv(1 << 20)
        if not chunk:
            return None
        pending += chunk
    head_end = pending.index(b"\r\n\r\n") + 4
    length = next((int(line.split(b":")[1]) for line in pending[:head_end].split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(pending) < head_end + length:
        pending += sock.recv(1 << 20)
    message = bytes(pending[:head_end + length])
    del pending[:head_end + length]
    return message


def _flipping_relay(target: str, flip_from_end: int) -> tuple[str, threading.Thread]:
    """A proxy between a healing rank and its source that flips one byte ``flip_from_end``
    bytes before the end of every answer carrying tensor bytes (larger than ``flip_from_end``
    past its header)."""
    host, port = target.split("//")[1].split("/")[0].split(":")
    listener = socket.create_server(("127.0.0.1", 0))

    def relay() -> None:
        client, _ = listener.accept()
        with client, socket.create_connection((host, int(port))) as upstream:
            from_client, from_upstream = bytearray(), bytearray()
            while (request := _read_http_message(client, from_client)) is not None:
                upstream.sendall(request)
                answer = bytearray(_read_http_message(upstream, from_upstream))
                if b"end=0 " not in request.split(b"\r\n")[0]:
                    answer[-flip_from_end] ^= 0x01
                client.sendall(answer)
        listener.close()

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}/checkpoint/", thread


def test_a_byte_flipped_in_flight_fails_the_heal_naming_the_tensor(pair):
    serving, fetching = pair
    sent = {"user": {"model": {"a": torch.randn(100), "z": torch.randn(50)}}}
    serving.send_checkpoint([1], 5, sent, TIMEOUT)
    address, relay = _flipping_relay(serving.metadata(), flip_from_end=4 + 10)  # inside the last tensor's bytes
    with pytest.raises(HealError, match=r"tensor \['user'\]\['model'\]\['z'\] arrived corrupted"):
        fetching.recv_checkpoint(0, address, 5, TIMEOUT)
    relay.join(timeout=10)


def test_it_serves_on_the_address_it_is_given_alone():
    serving = StreamTransport(TIMEOUT, "127.0.0.1")
    try:
        assert serving._server.server_address[0] == "127.0.0.1"
    finally:
        serving.shutdown()
