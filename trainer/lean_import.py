"""Importing torchtitan's Llama 3 without paying for a compiler this trainer never runs.

``torchtitan.models.common.attention`` calls ``torch.compile`` while it is imported: on flex
attention (a class attribute) and on ``create_block_mask`` (a module global). Each call imports
inductor's ``compile_fx``, 0.6 s of every rank's start here, to prepare kernels for flex
attention, which this trainer replaces with plain SDPA (``trainer.cpu_compat``). While the model
code is imported, ``torch.compile`` returns :class:`CompileOnFirstCall` instead: the same
compilation, done when (if ever) the function is first called. Everything else torchtitan's
import pulls in (dynamo through ``torch.nn.attention.varlen``, pipelining through its model
spec) is torch's own or needed by FSDP2 and stays.

tests/test_cpu_compat.py fails once the import no longer compiles, and this can go.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from trainer.cpu_compat import install_triton_kernel_stub



class CompileOnFirstCall:
    """``torch.compile(fn, **options)``, compiled on the first call instead of now."""

    def __init__(self, compile: Callable[..., Callable], fn: Callable, options: dict[str, Any]):
        self._compile = compile
        self.fn = fn
        self.options = options
        self._compiled: Callable | None = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    self._compiled = self._compile(self.fn, **self.options)
        return self._compiled(*args, **kwargs)


@contextmanager
def compile_on_first_call() -> Iterator[None]:
    real = torch.compile

    def deferred(model: Callable | None = None, **options: Any) -> Any:
        if model is None:  # the decorator form: @torch.compile(...)
            return lambda fn: CompileOnFirstCall(real, fn, options)
        return CompileOnFirstCall(real, model, options)

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = real


def import_quietly(module: str) -> Any:
    """A module of torchtitan's model code (a config registry, a model), imported without
    triton and without compiling at import."""
    install_triton_kernel_stub()
    with compile_on_first_call():
        return importlib.import_module(module)
