"""Every workaround torchtitan 0.3.0 needs to train Llama 3 on a machine without a GPU.

Three, each tested in tests/test_cpu_compat.py, which fails once upstream no longer needs it:

1. ``torchtitan.models.llama3`` imports ``torchtitan.distributed.minimal_async_ep.kernels``
   (MoE expert-parallel Triton kernels) unconditionally, and that module imports triton.
   Stubbing ``triton`` itself breaks ``torch._dynamo``, so only that kernels module is
   replaced, by one whose kernels raise when called. Llama 3 is dense and never calls them.
2. torchtitan's config helper rejects the "sdpa" attention backend for language models, and
   "flex" has no CPU backward, "varlen" no CPU kernel. ``ScaledDotProductAttention`` is plain
   causal SDPA: it is put into every config that has an ``inner_attention`` field, and the
   model is called without attention masks.
3. ``torchtitan.tools.utils.device_type`` is "cuda" on a machine without an accelerator, and
   ``ParallelDims.build_mesh`` builds its meshes for it; :func:`use_device_type` points it at
   the device the rank runs on.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types
from typing import Any

KERNELS_MODULE = "torchtitan.distributed.minimal_async_ep.kernels"


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _kernel_stub(name: str):
    if name.startswith("_"):  # __file__, __path__, ...: absent, as on any plain module
        raise AttributeError(name)

    def kernel(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{KERNELS_MODULE}.{name} needs triton, which is not installed")

    return kernel


def install_triton_kernel_stub() -> None:
    """Replace the Triton-only MoE kernels module when triton is missing (idempotent)."""
    if triton_available() or KERNELS_MODULE in sys.modules:
        return
    stub = types.ModuleType(KERNELS_MODULE)
    stub.__getattr__ = _kernel_stub  # type: ignore[attr-defined]  # PEP 562
    sys.modules[KERNELS_MODULE] = stub


def use_sdpa_attention(config: Any) -> Any:
    """Walk a torchtitan model config and set plain SDPA wherever attention is configured."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    def visit(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for field in dataclasses.fields(node):
                value = getattr(node, field.name)
                if field.name == "inner_attention":
                    setattr(node, field.name, ScaledDotProductAttention.Config())
                else:
                    visit(value)

    visit(config)
    return config


def use_device_type(device_type: str) -> None:
    """Make torchtitan's ``ParallelDims`` build its meshes on ``device_type`` (see 3. above)."""
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = device_type
