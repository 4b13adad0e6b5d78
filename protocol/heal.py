"""How a healing rank copies a live peer's state: a JSON header, then raw tensor bytes, in pieces.

The tensors of a state, in the header's order, make one run of bytes (each tensor's bytes in C
order, the dtype's native byte order). ``GET /checkpoint/{step}?start=S&end=E`` on a peer's
heal server (``trainer/heal_transport.py``) answers, with a ``Content-Length`` (connections are
kept open between pieces): 8 bytes (big-endian) giving the header's length, the
:class:`HealHeader` as JSON, then every :func:`segments` of bytes ``[S, E)``, each followed by 4
bytes (big-endian): the CRC-32C of that segment, computed by the source as it sent it.
``start=0&end=0`` is the header alone. Everything that is not a tensor travels in the header as
JSON, so a heal carries no pickle and runs no code of the peer's.

A healing rank fetches disjoint pieces (:func:`pieces`) from every live peer at the step at once,
and the pieces a peer that fails still owes from another; it checks every segment's CRC before
the state is handed on, and a mismatch fails the heal naming the tensor.
"""

from __future__ import annotations

from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict, Field

HEADER_LENGTH_BYTES = 8
CRC_BYTES = 4
CHUNK_BYTES = 4 * 2**20
"""Bytes are sent and checked this many at a time: the only copy in flight."""
PIECE_BYTES = 64 * 2**20
"""The most a healing rank asks one source for at a time: a failed source's debt stays small."""
MIN_PIECE_BYTES = 2**20
"""The least: a request costs a round trip, which a MiB hides even on loopback."""
PIECES_PER_SOURCE = 4
"""A smaller state is cut finer, so that every source gets a few pieces and the fast ones more."""
PATH = "/checkpoint/"


class TensorLeaf(BaseModel):
    dtype: str = Field(description="the torch dtype's name, as in torch.float32 → 'float32'")
    shape: list[int]
    nbytes: int = Field(ge=0)


class Leaf(BaseModel):
    """A leaf of the state's tree: a tensor (its bytes follow the header) or a JSON value."""

    path: str = Field(description="where it sits in the state, for error messages")
    tensor: TensorLeaf | None = None
    value: Any = None


class HealHeader(BaseModel):
    """Non-finite floats (an LR scheduler's ``inf``) travel as JSON's NaN/Infinity constants."""

    model_config = ConfigDict(ser_json_inf_nan="constants")

    step: int
    spec: str = Field(description="the state's tree structure (torch.utils._pytree.treespec_dumps)")
    leaves: list[Leaf]

    @property
    def tensors(self) -> list[Leaf]:
        return [leaf for leaf in self.leaves if leaf.tensor is not None]

    @property
    def tensor_bytes(self) -> int:
        return sum(leaf.tensor.nbytes for leaf in self.tensors)


def segments(sizes: list[int], start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """``(tensor index, first byte, byte after the last)`` for each tensor's share of bytes
    ``[start, end)`` of the run of tensors of these sizes, in order; empty tensors have none."""
    at = 0
    for index, size in enumerate(sizes):
        lo, hi = max(start, at), min(end, at + size)
        if lo < hi:
            yield index, lo - at, hi - at
        at += size
        if at >= end:
            return


def pieces(total: int, sources: int, largest: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """Bytes ``[0, total)`` as the ``[start, end)`` pieces a healing rank asks ``sources``
    sources for: at least :data:`PIECES_PER_SOURCE` each where that leaves a piece of
    :data:`MIN_PIECE_BYTES`, and none over ``largest``."""
    size = max(MIN_PIECE_BYTES, min(largest, -(-total // (PIECES_PER_SOURCE * max(1, sources)))))
    return [(at, min(at + size, total)) for at in range(0, total, size)]


def piece_path(step: int, start: int, end: int) -> str:
    return f"{PATH}{step}?start={start}&end={end}"
