"""What the ``lora_linear`` tests share (tests/test_functional*.py): the dtype-matrix ``Case``, inputs at O(1)
scale, the op run under a case's autocast, and the fixture that puts ``backend="triton"`` tests on their device.

Both backends run everywhere: "torch" (eager) and "triton" (the Triton CPU interpreter when there is no
GPU; ``conftest`` sets ``TRITON_INTERPRET=1``). Interpreter sizes are kept small (M, K, N <= 48).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

from parallel_lora import lora_linear
from tests._reference import assert_close

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
BACKENDS = ("torch", "triton")
# M is distinct from r, K and N so a saved [M, r] or [M, K] tensor is identified by its shape alone.
M, K, N, R = 24, 40, 48, 8
SCALE = 2.0  # alpha / r = 16 / 8: the LoRA term is as large as the base term, so dropping it is visible


def _name(dtype: torch.dtype) -> str:
    return {F32: "fp32", F16: "fp16", BF16: "bf16"}[dtype]


@dataclass(frozen=True)
class Case:
    """One cell of the dtype matrix."""

    w: torch.dtype  # base weight (and bias) dtype
    a: torch.dtype  # adapter storage dtype
    x: torch.dtype  # activation dtype as the caller holds it
    autocast: bool  # x = torch.square(fp32 leaf) under torch.autocast("cpu"/"cuda", dtype=bf16)

    @property
    def compute(self) -> torch.dtype:
        """The base output dtype: the autocast dtype under autocast, else the weight's dtype."""
        return BF16 if self.autocast else self.w

    @property
    def id(self) -> str:
        if self.autocast:
            inp = "autocast-fp32-x"
        else:
            inp = "plain-x" if self.x == self.w else f"{_name(self.x)}-x"
        return f"{_name(self.w)}-base/{_name(self.a)}-adapters/{inp}"


@dataclass
class Inputs:
    x_leaf: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    lora_A: torch.Tensor
    lora_B: torch.Tensor


def make_inputs(case: Case, *, m=M, k=K, n=N, r=R, bias=True, shape=None) -> Inputs:
    """O(1) activations, ``W ~ 1/sqrt(K)`` and non-zero ``B`` so base and LoRA terms are both O(1)."""
    x = torch.randn(*(shape or (m, k))).to(case.x).requires_grad_(True)
    w = (torch.randn(n, k) / math.sqrt(k)).to(case.w)
    b = (0.1 * torch.randn(n)).to(case.w) if bias else None
    a = (torch.randn(r, k) / math.sqrt(k)).to(case.a).requires_grad_(True)
    bb = (torch.randn(n, r) / math.sqrt(r)).to(case.a).requires_grad_(True)
    return Inputs(x, w, b, a, bb)


def run_op(case: Case, inp: Inputs, backend: str, **kwargs):
    """Forward under the case's autocast (if any) on x's device; returns ``(x as the op saw it, y)``."""
    with torch.autocast(inp.x_leaf.device.type, dtype=BF16, enabled=case.autocast):
        # Under autocast, square leaves an fp32 x in fp32 (CPU) or promotes it to fp32 (CUDA): either way the
        # op receives an fp32 activation inside a bf16 autocast region.
        x = torch.square(inp.x_leaf) if case.autocast else inp.x_leaf
        y = lora_linear(x, inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE, backend=backend, **kwargs)
    return x, y


def grads_of(y, x, inp: Inputs, dy):
    return torch.autograd.grad(y, (x, inp.lora_A, inp.lora_B), dy)


def assert_all_close(got: tuple, ref, tol) -> None:
    """``(y, dx, dA, dB)`` against the reference's, each under ``tol``."""
    want = (ref.y, ref.dx, ref.dA, ref.dB)
    for name, g, w in zip(("y", "dx", "dA", "dB"), got, want, strict=True):
        assert_close(g, w, tol, name)


def triton_device() -> str:
    """Where the Triton backend's tests run: the CPU interpreter when it is on, else the GPU."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("backend='triton' needs a CUDA GPU or TRITON_INTERPRET=1 (conftest sets it without a GPU)")


@pytest.fixture(autouse=True)
def _backend_device(request):
    """Tests parametrized with ``backend="triton"`` build their tensors on ``triton_device()``."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("backend") != "triton":
        yield
        return
    with torch.device(triton_device()):
        yield


FP32 = Case(F32, F32, F32, False)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
