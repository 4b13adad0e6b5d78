"""The heal transport between two real servers on loopback: every dtype and shape arrives
bitwise, a byte flipped in flight fails the heal naming the tensor, nothing but tensors and JSON
values travels, and it serves on its own address alone."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from trainer.heal_transport import HealError, StreamTransport

TIMEOUT = timedelta(seconds=10)


@pytest.fixture
def pair():
    serving, fetching = StreamTransport(TIMEOUT, "127.0.0.1"), StreamTransport(TIMEOUT, "127.0.0.1")
    yield serving, fetching
    serving.shutdown()
    fetching.shutdown()


def state() -> dict:
    torch.manual_seed(0)
    return {"user": {"model": {"w": torch.randn(64, 33), "b": torch.randn(7).to(torch.bfloat16),
                               "empty": torch.empty(0, 4), "t": torch.arange(24.0).reshape(4, 6).t()},
                     "optimizer": {"w": {"step": torch.tensor(9, dtype=torch.int64), "mask": torch.rand(5) > 0.5}},
                     "lr_scheduler": {"base_lrs": [0.1], "last_epoch": 3, "lr_lambdas": [None], "name": "warmup",
                                      "best": float("inf")}},
            "torchft": {"step": 3, "batches_committed": 6}}


def test_every_dtype_and_shape_arrives_bitwise_with_the_values_around_it(pair):
    serving, fetching = pair
    sent = state()
    serving.send_checkpoint([1], 3, sent, TIMEOUT)
    healed = fetching.recv_checkpoint(0, serving.metadata(), 3, TIMEOUT)
    for part in ("model", "optimizer"):
        flat_sent = torch.utils._pytree.tree_leaves(sent["user"][part])
        flat_healed = torch.utils._pytree.tree_leaves(healed["user"][part])
        assert all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                   for a, b in zip(flat_sent, flat_healed, strict=True))
    assert healed["user"]["lr_scheduler"] == sent["user"]["lr_scheduler"] and healed["torchft"] == sent["torchft"]
    assert fetching.last_fetch_bytes == sum(t.nbytes for t in torch.utils._pytree.tree_leaves(sent)
                                            if isinstance(t, torch.Tensor))
    assert serving.metadata().startswith("http://127.0.0.1:")


def test_only_the_step_being_served_is_served_and_only_until_it_is_withdrawn(pair):
    serving, fetching = pair
    serving.send_checkpoint([1], 3, state(), TIMEOUT)
    with pytest.raises(HealError, match="refused step 4: 409 .*serving step 3"):
        fetching.recv_checkpoint(0, serving.metadata(), 4, TIMEOUT)
    serving.disallow_checkpoint()
    with pytest.raises((HealError, TimeoutError, OSError)):
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


def _flipping_relay(target: str, flip_from_end: int) -> tuple[str, threading.Thread]:
    """A proxy that forwards one heal and flips one byte ``flip_from_end`` bytes before its end."""
    host, port = target.split("//")[1].split("/")[0].split(":")
    listener = socket.create_server(("127.0.0.1", 0))

    def relay() -> None:
        client, _ = listener.accept()
        with client, socket.create_connection((host, int(port))) as upstream:
            upstream.sendall(client.recv(65536))
            answer = bytearray()
            while chunk := upstream.recv(1 << 20):
                answer += chunk
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
