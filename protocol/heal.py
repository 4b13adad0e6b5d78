"""How a healing rank copies a live peer's state: a JSON header, then raw tensor bytes.

``GET /checkpoint/{step}`` on the peer's heal server (``trainer/heal_transport.py``) answers, in
one stream: 8 bytes (big-endian) giving the header's length, the :class:`HealHeader` as JSON,
then for each tensor leaf, in order, its ``nbytes`` raw bytes (C order, the dtype's native byte
order) followed by 4 bytes (big-endian): the CRC-32 of those bytes, computed by the source as it
sent them. Everything that is not a tensor travels in the header as JSON, so a heal carries no
pickle and runs no code of the peer's; the receiver checks every tensor's CRC before the state
is handed on, and a mismatch fails the heal naming the tensor.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

HEADER_LENGTH_BYTES = 8
CRC_BYTES = 4
CHUNK_BYTES = 4 * 2**20
"""Tensors are sent and received this many bytes at a time: the only copy in flight."""


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
    def tensor_bytes(self) -> int:
        return sum(leaf.tensor.nbytes for leaf in self.leaves if leaf.tensor is not None)
