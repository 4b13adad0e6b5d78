"""The heal transport: a live peer's state streamed as raw tensor bytes, each tensor checked.

torchft's ``HTTPTransport`` pickles the whole state with ``torch.save`` on the way out and
``torch.load`` on the way in: one stream at a fraction of what the link carries, a pickle the
receiver must trust, and nothing that tells a byte flipped in flight. This transport (a torchft
``CheckpointTransport``) sends what ``protocol/heal.py`` describes: a JSON header (the tree, the
non-tensor values, each tensor's dtype and shape), then every tensor's bytes straight from its
storage, a chunk at a time, each followed by its CRC-32; the receiver reads them straight into
the tensors it allocates, computes the CRC as they arrive, and fails the heal, naming the
tensor, on a mismatch. No pickle, no code of the peer's; a leaf that is neither a tensor nor a
JSON value is refused by the source.

The server listens on the address ``host`` resolves to (the name other groups reach this
group by), never on every interface. It serves a step only between ``send_checkpoint`` and
``disallow_checkpoint``: torchft calls the latter before the optimizer changes the tensors, and
it waits for every send in flight (a reader-writer lock), so a peer never reads a tensor while
it changes.
"""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time
import zlib
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten, treespec_dumps, treespec_loads
from torchft.checkpointing._rwlock import RWLock
from torchft.checkpointing.transport import CheckpointTransport

from protocol.heal import CHUNK_BYTES, CRC_BYTES, HEADER_LENGTH_BYTES, HealHeader, Leaf, TensorLeaf

JSON_VALUES = (int, float, str, bool, type(None))


class HealError(RuntimeError):
    """The heal failed: the state was not applied, the group stays out of the quorum."""


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's storage as bytes, on the CPU and in C order (a copy only when it is not)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def describe(step: int, state: Any) -> tuple[HealHeader, list[torch.Tensor]]:
    """The header of ``state`` and its tensors in the order their bytes are sent. A leaf that is
    neither a tensor nor a JSON value raises :class:`TypeError` (the state would need a pickle)."""
    leaves, spec = tree_flatten_with_path(state)
    described, tensors = [], []
    for path, value in leaves:
        where = keystr(path)
        if isinstance(value, torch.Tensor):
            described.append(Leaf(path=where, tensor=TensorLeaf(dtype=str(value.dtype).removeprefix("torch."),
                                                                shape=list(value.shape), nbytes=value.nbytes)))
            tensors.append(value)
        elif isinstance(value, JSON_VALUES):
            described.append(Leaf(path=where, value=value))
        else:
            raise TypeError(f"the state holds a {type(value).__name__} at {where}: only tensors and JSON values heal")
    return HealHeader(step=step, spec=treespec_dumps(spec), leaves=described), tensors


class StreamTransport(CheckpointTransport[Any]):
    """Serves this rank's state to healing peers and fetches a peer's; ``last_fetch_s`` and
    ``last_fetch_bytes`` describe the last fetch."""

    def __init__(self, timeout: timedelta, host: str):
        self.host = host
        self.timeout = timeout
        self.last_fetch_s = 0.0
        self.last_fetch_bytes = 0
        self._lock = RWLock(timeout=timeout.total_seconds())
        self._lock.w_acquire()  # nothing is served before the first send_checkpoint
        self._disallowed = True
        self._step = -1
        self._state: Any = None
        family, _, _, _, (address, *_) = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        server_type = type("HealServer", (ThreadingHTTPServer,), {"address_family": family, "daemon_threads": True,
                                                                  "request_queue_size": 1024})
        self._server = server_type((address, 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name="heal-server", daemon=True)
        self._thread.start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        transport = self

        class Handler(BaseHTTPRequestHandler):
            timeout = transport.timeout.total_seconds()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
                pass

            def refuse(self, status: int, why: str) -> None:
                body = why.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                parts = self.path.strip("/").split("/")
                if len(parts) != 2 or parts[0] != "checkpoint" or not parts[1].isdigit():
                    self.refuse(404, "GET /checkpoint/{step}")
                    return
                with transport._lock.r_lock():
                    if int(parts[1]) != transport._step:
                        self.refuse(409, f"serving step {transport._step}, not {parts[1]}")
                        return
                    try:
                        header, tensors = describe(transport._step, transport._state)
                    except TypeError as err:
                        self.refuse(422, str(err))
                        return
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.end_headers()
                    transport._send(self.wfile, header, tensors)

        return Handler

    @staticmethod
    def _send(out, header: HealHeader, tensors: list[torch.Tensor]) -> None:
        encoded = header.model_dump_json().encode()
        out.write(len(encoded).to_bytes(HEADER_LENGTH_BYTES, "big") + encoded)
        for tensor in tensors:
            data, crc = _bytes_of(tensor), 0
            for at in range(0, len(data), CHUNK_BYTES):
                chunk = data[at:at + CHUNK_BYTES]
                crc = zlib.crc32(chunk, crc)
                out.write(chunk)
            out.write(struct.pack(">I", crc))

    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/checkpoint/"

    def metadata(self) -> str:
        return self.address()

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Serve ``state_dict`` (its live tensors, not a copy) as step ``step`` until
        :meth:`disallow_checkpoint`."""
        self._state, self._step = state_dict, step
        if self._disallowed:
            self._disallowed = False
            self._lock.w_release()

    def disallow_checkpoint(self) -> None:
        """Stop serving; returns once every send in flight is done."""
        if not self._disallowed:
            self._disallowed = True
            self._lock.w_acquire()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        start = time.perf_counter()
        url = urlsplit(metadata)
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout.total_seconds())
        try:
            connection.request("GET", f"{url.path.rstrip('/')}/{step}")
            response = connection.getresponse()
            if response.status != 200:
                raise HealError(f"the peer at {url.netloc} refused step {step}: {response.status} "
                                f"{response.read(500).decode(errors='replace')}")
            state, received = _receive(response)
        finally:
            connection.close()
        self.last_fetch_s, self.last_fetch_bytes = time.perf_counter() - start, received
        return state

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()


def _read_exactly(response: http.client.HTTPResponse, into: memoryview) -> None:
    got = 0
    while got < len(into):
        n = response.readinto(into[got:])
        if not n:
            raise HealError(f"the peer's stream ended {len(into) - got} bytes early")
        got += n


def _receive(response: http.client.HTTPResponse) -> tuple[Any, int]:
    """The state the stream holds, every tensor checked; and the tensor bytes received."""
    length = bytearray(HEADER_LENGTH_BYTES)
    _read_exactly(response, memoryview(length))
    raw = bytearray(int.from_bytes(length, "big"))
    _read_exactly(response, memoryview(raw))
    header = HealHeader.model_validate(json.loads(raw))
    values = []
    crc_bytes = bytearray(CRC_BYTES)
    for leaf in header.leaves:
        if leaf.tensor is None:
            values.append(leaf.value)
            continue
        spec = leaf.tensor
        dtype = getattr(torch, spec.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise HealError(f"tensor {leaf.path}: unknown dtype {spec.dtype!r}")
        tensor = torch.empty(spec.shape, dtype=dtype)
        if tensor.nbytes != spec.nbytes:
            raise HealError(f"tensor {leaf.path}: {spec.nbytes} bytes do not make a {spec.dtype} {spec.shape}")
        data, crc = _bytes_of(tensor), 0
        for at in range(0, len(data), CHUNK_BYTES):
            chunk = data[at:at + CHUNK_BYTES]
            _read_exactly(response, chunk)
            crc = zlib.crc32(chunk, crc)
        _read_exactly(response, memoryview(crc_bytes))
        if struct.unpack(">I", crc_bytes)[0] != crc:
            raise HealError(f"tensor {leaf.path} arrived corrupted (CRC-32 mismatch): the heal is not applied")
        values.append(tensor)
    return tree_unflatten(values, treespec_loads(header.spec)), header.tensor_bytes
