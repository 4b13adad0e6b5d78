"""The heal transport: a live peer's state streamed as raw tensor bytes, striped over every live
peer, each segment checked.

torchft's ``HTTPTransport`` pickles the whole state with ``torch.save`` on the way out and
``torch.load`` on the way in, from the one peer torchft names: a fraction of what the link
carries, a pickle the receiver must trust, nothing that tells a byte flipped in flight, and a
heal that takes as long with ten live peers as with one. This transport (a torchft
``CheckpointTransport``) speaks ``protocol/heal.py``: a JSON header (the tree, the non-tensor
values, each tensor's dtype and shape), then tensor bytes straight from their storage (an
accelerator's through one pinned chunk), each segment followed by its CRC-32C. The healing rank
reads them straight into the tensors it allocates, checks each CRC as the bytes arrive (in
hardware, ~12 GiB/s a core), and fails the heal, naming the tensor, on a mismatch. No pickle,
no code of the peer's; a leaf that is neither a tensor nor a JSON value is refused by the source.

**Striping.** torchft names one source per rank; every peer at the quorum's step holds the same
state. Given ``peers`` (a function of the step that names the other live peers' heal addresses:
``trainer/heal_peers.py`` asks the Lighthouse), the healing rank fetches disjoint pieces from
all of them at once, one connection each; a source that fails mid-heal is dropped and the pieces
it still owed go to the others, without starting over. Only when every source failed does the
heal fail. The non-tensor values come from torchft's own source.

The server listens on the address ``host`` resolves to (the name other groups reach this
group by), never on every interface. It serves a step only between ``send_checkpoint`` and
``disallow_checkpoint``: torchft calls the latter before the optimizer changes the tensors, and
it waits for every send in flight (a reader-writer lock), so a peer never reads a tensor while
it changes.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator
from urllib.parse import parse_qs, urlsplit

import crc32c
import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten, treespec_dumps, treespec_loads
from torchft.checkpointing._rwlock import RWLock
from torchft.checkpointing.transport import CheckpointTransport

from protocol.heal import (
    CHUNK_BYTES,
    CRC_BYTES,
    HEADER_LENGTH_BYTES,
    PATH,
    PIECE_BYTES,
    HealHeader,
    Leaf,
    TensorLeaf,
    piece_path,
    pieces,
    segments,
)

logger = logging.getLogger(__name__)
JSON_VALUES = (int, float, str, bool, type(None))
PeerFinder = Callable[[int], list[str]]
"""The heal addresses of the other live peers serving a step (may raise: the heal then uses
torchft's source alone)."""


class HealError(RuntimeError):
    """The heal failed: the state was not applied, the group stays out of the quorum."""


class SourceFailed(Exception):
    """One source cannot serve (gone, refused, a different state): its pieces go to another."""


def describe(step: int, state: Any) -> tuple[HealHeader, list[torch.Tensor]]:
    """The header of ``state`` and its tensors in the order their bytes are sent. A leaf that is
    neither a tensor nor a JSON value raises :class:`TypeError` (the state would need a pickle)."""
    leaves, spec = tree_flatten_with_path(state)
    described, tensors = [], []
    for path, value in leaves:
        where = keystr(path)
        if isinstance(value, DTensor):
            value = value.to_local()  # rank r of every group holds the same shard: it heals as one
        if isinstance(value, torch.Tensor):
            described.append(Leaf(path=where, tensor=TensorLeaf(dtype=str(value.dtype).removeprefix("torch."),
                                                                shape=list(value.shape), nbytes=value.nbytes)))
            tensors.append(value)
        elif isinstance(value, JSON_VALUES):
            described.append(Leaf(path=where, value=value))
        else:
            raise TypeError(f"the state holds a {type(value).__name__} at {where}: only tensors and JSON values heal")
    return HealHeader(step=step, spec=treespec_dumps(spec), leaves=described), tensors


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """A host tensor's storage as bytes, in C order (a copy only when it is not contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _chunks(tensor: torch.Tensor, lo: int, hi: int, staging: Callable[[], torch.Tensor]) -> Iterator[memoryview]:
    """Bytes ``[lo, hi)`` of ``tensor``, :data:`CHUNK_BYTES` at a time: a host tensor's from its
    storage, an accelerator's copied through the pinned buffer ``staging()`` returns."""
    if tensor.device.type == "cpu":
        data = _host_bytes(tensor)
        for at in range(lo, hi, CHUNK_BYTES):
            yield data[at:min(at + CHUNK_BYTES, hi)]
        return
    flat, buffer = tensor.detach().contiguous().reshape(-1).view(torch.uint8), staging()
    view = memoryview(buffer.numpy())
    for at in range(lo, hi, CHUNK_BYTES):
        n = min(CHUNK_BYTES, hi - at)
        buffer[:n].copy_(flat[at:at + n])  # synchronous: the chunk is on the host when it is sent
        yield view[:n]


def _layout(header: HealHeader) -> tuple:
    """What every source at a step must agree on: the tree and its tensors (their non-tensor
    values, like the group a state came from, may differ)."""
    return header.step, header.spec, [(leaf.path, leaf.tensor) for leaf in header.tensors]


@dataclass
class _Served:
    """The step being served, described once for every request."""

    head: bytes
    tensors: list[torch.Tensor]
    sizes: list[int]


@dataclass
class FetchReport:
    """What one fetch did. ``header_s``: finding the sources and reading the header;
    ``transfer_s``: the tensor bytes, checked as they arrived (``checksum_s`` is the CPU time
    the checks took, on all connections together); ``failed``: the sources dropped, and why;
    ``peers_error``: why no other peers were found (the heal used torchft's source alone);
    ``in_place_bytes``: received straight into this rank's own tensors."""

    started_at: float = 0.0
    header_s: float = 0.0
    transfer_s: float = 0.0
    checksum_s: float = 0.0
    bytes: int = 0
    by_source: dict[str, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    peers_error: str | None = None
    in_place_bytes: int = 0

    @property
    def seconds(self) -> float:
        return self.header_s + self.transfer_s

    @property
    def sources(self) -> list[str]:
        """The sources that sent a piece."""
        return [url for url, sent in self.by_source.items() if sent]


class StreamTransport(CheckpointTransport[Any]):
    """Serves this rank's state to healing peers and fetches a peer's (striped over ``peers``);
    ``last_fetch`` describes the last fetch, ``on_bytes(source, n)`` hears every chunk received.

    ``destination``, when set, returns this rank's own state (torchft's Manager state dict): a
    heal whose tree and tensors match it is received straight into its host tensors, so the
    healing rank holds no second copy of the state (and faults in no fresh memory). Those
    tensors are stale anyway: torchft discards the healing step's gradients, and a heal that
    fails (a CRC mismatch, every source gone) leaves the group uncommitted, to heal again at
    the next quorum, never training on what it received."""

    def __init__(self, timeout: timedelta, host: str, peers: PeerFinder | None = None,
                 piece_bytes: int = PIECE_BYTES):
        self.host = host
        self.timeout = timeout
        self.peers = peers
        self.piece_bytes = piece_bytes  # the largest piece (protocol.heal.pieces)
        self.last_fetch = FetchReport()
        self.on_bytes: Callable[[str, int], None] | None = None
        self.destination: Callable[[], Any] | None = None
        self._lock = RWLock(timeout=timeout.total_seconds())
        self._lock.w_acquire()  # nothing is served before the first send_checkpoint
        self._disallowed = True
        self._step = -1
        self._state: Any = None
        self._served: _Served | None = None
        self._describing = threading.Lock()
        self._staging = threading.local()
        family, _, _, _, (address, *_) = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        server_type = type("HealServer", (ThreadingHTTPServer,), {"address_family": family, "daemon_threads": True,
                                                                  "request_queue_size": 1024})
        self._server = server_type((address, 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name="heal-server", daemon=True)
        self._thread.start()

    # --- serving
    def _served_step(self) -> _Served:
        """The served state, described on the first request for its step (raises TypeError)."""
        with self._describing:
            if self._served is None:
                header, tensors = describe(self._step, self._state)
                encoded = header.model_dump_json().encode()
                self._served = _Served(len(encoded).to_bytes(HEADER_LENGTH_BYTES, "big") + encoded, tensors,
                                       [t.nbytes for t in tensors])
            return self._served

    def _pinned_chunk(self) -> torch.Tensor:
        """This server thread's pinned staging buffer, for an accelerator's tensors."""
        if getattr(self._staging, "buffer", None) is None:
            self._staging.buffer = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
        return self._staging.buffer

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        transport = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # a healing rank's pieces share one connection
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
                url = urlsplit(self.path)
                step = url.path.removeprefix(PATH)
                if not url.path.startswith(PATH) or not step.isdigit():
                    self.refuse(404, f"GET {PATH}{{step}}?start=&end=")
                    return
                with transport._lock.r_lock():
                    if int(step) != transport._step:
                        self.refuse(409, f"serving step {transport._step}, not {step}")
                        return
                    try:
                        served = transport._served_step()
                    except TypeError as err:
                        self.refuse(422, str(err))
                        return
                    total = sum(served.sizes)
                    query = parse_qs(url.query)
                    try:
                        start, end = int(query.get("start", ["0"])[0]), int(query.get("end", [str(total)])[0])
                    except ValueError:
                        start, end = -1, -1
                    if not 0 <= start <= end <= total:
                        self.refuse(416, f"start and end must satisfy 0 <= start <= end <= {total}")
                        return
                    spans = list(segments(served.sizes, start, end))
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Content-Length", str(len(served.head) + end - start + CRC_BYTES * len(spans)))
                    self.end_headers()
                    self.wfile.write(served.head)
                    for index, lo, hi in spans:
                        crc = 0
                        for chunk in _chunks(served.tensors[index], lo, hi, transport._pinned_chunk):
                            crc = crc32c.crc32c(chunk, crc)
                            self.wfile.write(chunk)
                        self.wfile.write(struct.pack(">I", crc))

        return Handler

    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}{PATH}"

    def metadata(self) -> str:
        return self.address()

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Serve ``state_dict`` (its live tensors, not a copy) as step ``step`` until
        :meth:`disallow_checkpoint`."""
        self._state, self._step, self._served = state_dict, step, None
        if self._disallowed:
            self._disallowed = False
            self._lock.w_release()

    def disallow_checkpoint(self) -> None:
        """Stop serving; returns once every send in flight is done."""
        if not self._disallowed:
            self._disallowed = True
            self._lock.w_acquire()

    # --- fetching
    def _sources(self, primary: str, step: int, report: FetchReport) -> list[str]:
        """torchft's source first, then every other live peer serving ``step``."""
        found: list[str] = []
        if self.peers is not None:
            try:
                found = self.peers(step)
            except Exception as err:  # a heal never fails for want of extra sources
                report.peers_error = f"{type(err).__name__}: {err}"
                logger.warning("heal of step %d from %s alone: finding other peers failed: %s", step, primary, err)
        mine = self.metadata()
        return list(dict.fromkeys(url for url in [primary, *found] if url != mine))

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        report = FetchReport(started_at=time.time())
        self.last_fetch = report
        start = time.perf_counter()
        sources, header = [], None
        for url in self._sources(metadata, step, report):
            source = _Source(url, timeout)
            try:
                parsed = source.header(step)
            except SourceFailed as err:
                report.failed[url] = str(err)
                source.close()
                continue
            if header is None:
                header = parsed
            elif _layout(parsed) != _layout(header):
                report.failed[url] = "serves a different state at this step"
                source.close()
                continue
            sources.append(source)
        if header is None:
            raise HealError(f"no peer served step {step}: " + "; ".join(f"{u}: {why}" for u, why in report.failed.items()))
        own = self.destination() if self.destination is not None else None  # built once: it may copy
        tensors = self._receivers(header, report, own)
        report.header_s = time.perf_counter() - start
        work = _Work(pieces(header.tensor_bytes, len(sources), self.piece_bytes), [s.url for s in sources], report)
        receiving = _Receiving(step, header.tensors, [_host_bytes(t) for t in tensors], work, self.on_bytes)
        threads = [threading.Thread(target=receiving.run, args=(source,), name=f"heal-from-{source.url}", daemon=True)
                   for source in sources]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            for source in sources:
                source.close()
        report.transfer_s = time.perf_counter() - start - report.header_s
        if work.error is not None:
            raise work.error
        report.bytes = header.tensor_bytes
        values, received = [], iter(tensors)
        for leaf in header.leaves:
            values.append(next(received) if leaf.tensor is not None else leaf.value)
        return _placed(tree_unflatten(values, treespec_loads(header.spec)), own)

    def _receivers(self, header: HealHeader, report: FetchReport, state: Any) -> list[torch.Tensor]:
        """The tensors a heal lands in: this rank's own (``state``, from :attr:`destination`)
        where they match the header (host tensors in C order; any other is allocated), else new ones."""
        own: list[torch.Tensor] = []
        if state is not None:
            try:
                mine, own = describe(header.step, state)
            except TypeError:
                mine = None
            if mine is None or _layout(mine)[1:] != _layout(header)[1:]:
                own = []
        if not own:
            return [_allocate(leaf) for leaf in header.tensors]
        received = []
        for tensor, leaf in zip(own, header.tensors, strict=True):
            in_place = tensor.device.type == "cpu" and tensor.is_contiguous()
            received.append(tensor.detach() if in_place else _allocate(leaf))
            report.in_place_bytes += tensor.nbytes if in_place else 0
        return received

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()


def _placed(state: Any, own_state: Any) -> Any:
    """The received state, each shard whose own counterpart is a DTensor (an optimizer's state
    that ``load_state_dict`` keeps as given) wrapped as one, placed alike."""
    if own_state is None:
        return state
    leaves, spec = tree_flatten_with_path(state)
    own = dict(tree_flatten_with_path(own_state)[0])
    return tree_unflatten([_like(value, own.get(path)) for path, value in leaves], spec)


def _like(received: Any, own: Any) -> Any:
    if not isinstance(own, DTensor) or not isinstance(received, torch.Tensor) or isinstance(received, DTensor):
        return received
    return DTensor.from_local(received, own.device_mesh, own.placements, shape=own.shape, stride=own.stride())


def _allocate(leaf: Leaf) -> torch.Tensor:
    spec = leaf.tensor
    dtype = getattr(torch, spec.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise HealError(f"tensor {leaf.path}: unknown dtype {spec.dtype!r}")
    tensor = torch.empty(spec.shape, dtype=dtype)
    if tensor.nbytes != spec.nbytes:
        raise HealError(f"tensor {leaf.path}: {spec.nbytes} bytes do not make a {spec.dtype} {spec.shape}")
    return tensor


class _Source:
    """One peer's heal server, over one kept-open connection."""

    def __init__(self, url: str, timeout: timedelta):
        parts = urlsplit(url)
        self.url = url
        self.connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout.total_seconds())
        self.head = b""

    def get(self, step: int, start: int, end: int) -> http.client.HTTPResponse:
        try:
            self.connection.request("GET", piece_path(step, start, end))
            response = self.connection.getresponse()
        except (OSError, http.client.HTTPException) as err:
            raise SourceFailed(f"{type(err).__name__}: {err}") from err
        if response.status != 200:
            raise SourceFailed(f"refused step {step}: {response.status} {response.read(500).decode(errors='replace')}")
        return response

    def header(self, step: int) -> HealHeader:
        """The header alone, read and kept (:attr:`head`) to hold every piece's against."""
        raw = _read_head(self.get(step, 0, 0))
        try:
            header = HealHeader.model_validate(json.loads(raw))
        except ValueError as err:
            raise SourceFailed(f"an unreadable header: {err}") from err
        if header.step != step:
            raise SourceFailed(f"sent step {header.step} for step {step}")
        self.head = raw
        return header

    def piece(self, step: int, start: int, end: int) -> http.client.HTTPResponse:
        """The answer for bytes ``[start, end)``, past its header: the same header, byte for
        byte, as :meth:`header` read (the source still serves the state it described)."""
        response = self.get(step, start, end)
        if _read_head(response) != self.head:
            raise SourceFailed("serves a different state at this step")
        return response

    def close(self) -> None:
        self.connection.close()


def _read_head(response: http.client.HTTPResponse) -> bytes:
    """The header's JSON at the start of an answer."""
    length = bytearray(HEADER_LENGTH_BYTES)
    _read_exactly(response, memoryview(length))
    raw = bytearray(int.from_bytes(length, "big"))
    _read_exactly(response, memoryview(raw))
    return bytes(raw)


def _read_exactly(response: http.client.HTTPResponse, into: memoryview) -> None:
    got = 0
    try:
        while got < len(into):
            n = response.readinto(into[got:])
            if not n:
                raise SourceFailed(f"the stream ended {len(into) - got} bytes early")
            got += n
    except (OSError, http.client.HTTPException) as err:
        raise SourceFailed(f"{type(err).__name__}: {err}") from err


class _Work:
    """The pieces still to fetch, shared by one thread per source. A source that fails gives its
    piece back and stops; the heal fails when every source has, or at the first corruption."""

    def __init__(self, todo: list[tuple[int, int]], sources: list[str], report: FetchReport):
        self.todo, self.left, self.working = deque(todo), len(todo), len(sources)
        self.report = report
        self.error: HealError | None = None
        self.cond = threading.Condition()
        for url in sources:
            report.by_source[url] = 0

    def take(self) -> tuple[int, int] | None:
        """The next piece; None once everything is fetched or the heal failed."""
        with self.cond:
            while not self.todo and self.left and self.error is None:
                self.cond.wait()
            return self.todo.popleft() if self.todo and self.error is None else None

    def done(self, url: str, piece: tuple[int, int], checksum_s: float) -> None:
        with self.cond:
            self.left -= 1
            self.report.by_source[url] += piece[1] - piece[0]
            self.report.checksum_s += checksum_s
            self.cond.notify_all()

    def give_back(self, url: str, piece: tuple[int, int], why: str) -> None:
        with self.cond:
            self.todo.appendleft(piece)
            self.working -= 1
            self.report.failed[url] = why
            if not self.working and self.error is None:
                self.error = HealError("every source failed mid-heal: " + "; ".join(
                    f"{u}: {w}" for u, w in self.report.failed.items()))
            self.cond.notify_all()

    def fail(self, error: HealError) -> None:
        with self.cond:
            self.error = self.error or error
            self.cond.notify_all()


@dataclass
class _Receiving:
    """One heal's destination: each source's thread runs :meth:`run`."""

    step: int
    leaves: list[Leaf]
    views: list[memoryview]
    work: _Work
    on_bytes: Callable[[str, int], None] | None

    def __post_init__(self) -> None:
        self.sizes = [leaf.tensor.nbytes for leaf in self.leaves]

    def run(self, source: _Source) -> None:
        while (piece := self.work.take()) is not None:
            try:
                checksum_s = self._fetch(source, piece)
            except SourceFailed as err:
                self.work.give_back(source.url, piece, str(err))
                return
            except HealError as err:
                self.work.fail(err)
                return
            except BaseException as err:  # noqa: BLE001 (a thread's error must reach the heal)
                self.work.fail(HealError(f"receiving from {source.url}: {type(err).__name__}: {err}"))
                return
            self.work.done(source.url, piece, checksum_s)

    def _fetch(self, source: _Source, piece: tuple[int, int]) -> float:
        """Receive ``piece`` from ``source`` into the destination; the seconds its CRCs took."""
        response = source.piece(self.step, *piece)
        checksum_s, trailer = 0.0, bytearray(CRC_BYTES)
        for index, lo, hi in segments(self.sizes, *piece):
            view, crc = self.views[index][lo:hi], 0
            for at in range(0, len(view), CHUNK_BYTES):
                chunk = view[at:at + CHUNK_BYTES]
                _read_exactly(response, chunk)
                t = time.perf_counter()
                crc = crc32c.crc32c(chunk, crc)
                checksum_s += time.perf_counter() - t
                if self.on_bytes is not None:
                    self.on_bytes(source.url, len(chunk))
            _read_exactly(response, memoryview(trailer))
            if struct.unpack(">I", trailer)[0] != crc:
                raise HealError(f"tensor {self.leaves[index].path} arrived corrupted from {source.url} "
                                "(CRC-32C mismatch): the heal is not applied")
        return checksum_s
