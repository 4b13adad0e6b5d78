"""Each CPU workaround in trainer/cpu_compat.py is still needed; this fails when upstream fixes one."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from trainer.cpu_compat import triton_available


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(triton_available(), reason="triton installed: the kernel stub is not used")
def test_llama3_import_still_needs_the_triton_kernel_stub():
    result = _python("import torchtitan.models.llama3")
    assert result.returncode != 0 and "No module named 'triton'" in result.stderr, (
        "torchtitan.models.llama3 now imports without triton: remove install_triton_kernel_stub"
    )
    fixed = _python("from trainer.cpu_compat import install_triton_kernel_stub as s; s(); "
                    "import torchtitan.models.llama3")
    assert fixed.returncode == 0, fixed.stderr


def test_sdpa_backend_is_still_rejected_and_our_config_trains_on_cpu():
    from trainer.cpu_compat import install_triton_kernel_stub

    install_triton_kernel_stub()
    from torchtitan.models.common.config_utils import get_attention_config

    with pytest.raises(ValueError, match="sdpa"):
        get_attention_config("sdpa")  # if this passes, use attn_backend="sdpa" instead of use_sdpa_attention

    from trainer.configs import llama3_debugmodel_bytes
    from trainer.cpu_compat import use_sdpa_attention

    torch.manual_seed(0)
    model = use_sdpa_attention(llama3_debugmodel_bytes().model_spec.model).build()
    model.init_weights()
    tokens = torch.randint(0, 256, (2, 32))
    loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())



def test_the_model_code_still_compiles_while_it_is_imported_and_we_defer_it():
    stub = "from trainer.cpu_compat import install_triton_kernel_stub as s; s(); "
    plain = _python(stub + "import sys, torchtitan.models.llama3; print('torch._inductor.compile_fx' in sys.modules)")
    assert plain.stdout.split() == ["True"], (
        plain.stderr or "torchtitan's import no longer compiles anything: remove trainer.lean_import.compile_on_first_call")
    lean = _python("import sys; from trainer.lean_import import import_quietly; import_quietly('torchtitan.models.llama3'); "
                   "from torchtitan.models.common.attention import FlexAttention; "
                   "print('torch._inductor.compile_fx' in sys.modules, type(FlexAttention._compiled_flex_attn).__name__)")
    assert lean.stdout.split() == ["False", "CompileOnFirstCall"], lean.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="an accelerator is there: torchtitan picks it")
def test_torchtitan_still_builds_its_meshes_for_cuda_on_a_machine_without_one():
    result = _python("from trainer.cpu_compat import install_triton_kernel_stub as s; s(); "
                     "import torchtitan.distributed.parallel_dims as p; print(p.device_type)")
    assert result.stdout.split() == ["cuda"], (
        result.stderr or "torchtitan now picks the CPU by itself: remove trainer.cpu_compat.use_device_type")


def test_a_deferred_compile_compiles_on_its_first_call_and_computes_the_same():
    from trainer.lean_import import CompileOnFirstCall

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 2 + 1

    deferred = CompileOnFirstCall(torch.compile, f, {"backend": "eager"})
    assert deferred._compiled is None
    x = torch.linspace(0, 1, 17)
    assert torch.equal(deferred(x), f(x))
    assert deferred._compiled is not None
