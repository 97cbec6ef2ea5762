"""Call plans and the caches keyed on shapes (``parallel_lora.functional.Plan``, ``kernels.dispatch``,
``kernels.launcher``): a signature is checked and settled once, and every cache stays within its bound.

Reference: ``lora_linear`` on the torch backend with a fresh plan per call (the eager oracle), the same tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import triton

import parallel_lora.functional as functional
import parallel_lora.layers as layers
from parallel_lora import ColumnParallelLoRALinear, LoRAConfig, LoRALinear, RowParallelLoRALinear, lora_linear
from parallel_lora.kernels import dispatch, launcher
from parallel_lora.kernels.spec import KernelSpec
from tests import _dist

F32 = torch.float32


def _layer(backend: str, dropout: float = 0.0) -> LoRALinear:
    torch.manual_seed(0)
    layer = LoRALinear(16, 24, LoRAConfig(r=4, alpha=8, dropout=dropout, backend=backend)).train()
    nn.init.normal_(layer.lora_B.weight)
    return layer


def _counting(monkeypatch, module, name: str) -> list:
    calls, real = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_second_call_of_a_signature_builds_and_checks_nothing(backend, monkeypatch):
    layer = _layer(backend, dropout=0.1)
    x = torch.randn(2, 5, 16, requires_grad=True)
    built = _counting(monkeypatch, layers, "make_plan")
    checked = _counting(monkeypatch, functional, "check_inputs")
    entries = [_counting(monkeypatch, dispatch, name) for name in ("forward_entry", "backward_entry")]

    def counts() -> tuple[int, ...]:
        return len(built), len(checked), *map(len, entries)

    layer(x).sum().backward()
    first = counts()
    assert first == (1, 1, *((1, 1) if backend == "triton" else (0, 0))), first
    for _ in range(3):
        layer(x).sum().backward()
    assert counts() == first, "a repeated signature built or checked again"
    layer(torch.randn(3, 5, 16)).sum().backward()  # another token count: a new plan, checked
    assert (len(built), len(checked)) == (2, 2)


def test_a_plan_follows_the_parameters_mode_and_autocast():
    layer = _layer("torch")
    x = torch.randn(6, 16)
    layer(x)
    layer.eval()
    layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
    layer.to(torch.float64)
    assert layer(x.double()).dtype == torch.float64
    assert len(layer._plans) == 4
    with pytest.raises(ValueError, match="lora_A must be"):
        layer.lora_A.weight = nn.Parameter(torch.zeros(4, 8, dtype=torch.float64))
        layer(x.double())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_parameter_view_of_the_same_storage_gets_its_own_plan(backend):
    # Another view of a parameter's storage, at the same address: transposed strides, then another shape. A plan
    # kept for the first view would read the second with the first's strides, or skip the check that refuses it.
    layer = LoRALinear(16, 16, LoRAConfig(r=4, alpha=8, backend=backend))
    nn.init.normal_(layer.lora_B.weight)
    storage, x = torch.randn(16 * 16), torch.randn(6, 16)
    layer.weight = nn.Parameter(storage.view(16, 16), requires_grad=False)
    layer(x)
    layer.weight = nn.Parameter(storage.view(16, 16).t(), requires_grad=False)
    oracle = lora_linear(x, layer.weight, None, layer.lora_A.weight, layer.lora_B.weight, 2.0, backend="torch")
    torch.testing.assert_close(layer(x), oracle)
    layer.weight = nn.Parameter(storage[: 8 * 16].view(8, 16), requires_grad=False)
    with pytest.raises(ValueError, match="lora_B must be"):
        layer(x)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_parameters_allocated_anew_keep_their_plan(backend, monkeypatch):
    # FSDP2 allocates its unsharded parameters anew at every step: the same layout at another address keeps the
    # plan, nothing is built again, and each call reads the new storage. Another 16-byte alignment is a new plan.
    layer = _layer(backend)
    x = torch.randn(6, 16)
    built = _counting(monkeypatch, layers, "make_plan")
    for step in range(4):
        for module, name in ((layer, "weight"), (layer.lora_A, "weight"), (layer.lora_B, "weight")):
            old = getattr(module, name)
            fresh = nn.Parameter(old.detach() + 0.5 * step, requires_grad=old.requires_grad)
            setattr(module, name, fresh)
        oracle = lora_linear(x, layer.weight, None, layer.lora_A.weight, layer.lora_B.weight, 2.0, backend="torch")
        torch.testing.assert_close(layer(x), oracle)
    assert len(built) == 1 and len(layer._plans) == 1
    storage = torch.randn(24 * 16 + 1)
    layer.weight = nn.Parameter(storage[1:].view(24, 16), requires_grad=False)  # 4 bytes past its storage's start
    oracle = lora_linear(x, layer.weight, None, layer.lora_A.weight, layer.lora_B.weight, 2.0, backend="torch")
    torch.testing.assert_close(layer(x), oracle)
    assert len(built) == 2


class _Doubled(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


@pytest.mark.parametrize("owner", ["layer", "lora_A", "lora_B"])
def test_a_parametrized_weight_is_read_through_its_parametrization(owner):
    # The layer reads plain parameters from the module dicts; a parametrization takes them out of there.
    layer, x = _layer("triton"), torch.randn(6, 16)
    layer(x)
    nn.utils.parametrize.register_parametrization(getattr(layer, owner) if owner != "layer" else layer, "weight",
                                                  _Doubled())  # fmt: skip
    A, B = layer.lora_A.weight, layer.lora_B.weight
    oracle = lora_linear(x, layer.weight, None, A, B, 2.0, backend="torch")
    torch.testing.assert_close(layer(x), oracle)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_replaced_config_gets_its_own_plan(backend):
    # A freed config's id is soon another config's: a plan keyed on the id alone would keep the old scale.
    layer, x = _layer(backend), torch.randn(6, 16)
    for alpha in (8, 16, 32, 64, 128, 256):
        layer.config = LoRAConfig(r=4, alpha=alpha, backend=backend)
        A, B = layer.lora_A.weight, layer.lora_B.weight
        oracle = lora_linear(x, layer.weight, None, A, B, alpha / 4, backend="torch")
        torch.testing.assert_close(layer(x), oracle, atol=1e-4, rtol=1e-4)


def test_a_call_of_matching_dtypes_casts_nothing(monkeypatch):
    """A plan settles whether its calls cast: where every operand is already in its compute dtype, none is cast."""
    layer = _layer("triton")
    x = torch.randn(2, 5, 16, requires_grad=True)
    layer(x).sum().backward()
    casts = _counting(monkeypatch, functional, "cast_to")
    layer(x).sum().backward()
    assert casts == []
    with torch.autocast("cpu", dtype=torch.bfloat16):  # x and W cast to bf16 on the way in, grads cast back
        layer(x).sum().backward()
    assert casts and x.grad.dtype == F32


def test_an_eager_call_skips_the_python_half_of_function_apply(monkeypatch):
    """Eager calls enter the autograd Function through its C half; a torch.func transform gets a clear refusal."""
    layer = _layer("triton")
    x = torch.randn(2, 5, 16, requires_grad=True)
    applied = _counting(monkeypatch, functional.LoRAFunction, "apply")
    layer(x).sum().backward()
    assert applied == [] and x.grad is not None and layer.lora_B.weight.grad is not None
    with pytest.raises(RuntimeError, match="no torch.func rule.*outside the transform"):
        torch.func.vmap(layer)(torch.randn(3, 2, 16))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_many_token_counts_keep_the_plans_bounded_and_right(backend, monkeypatch):
    # A run with unpacked data sees a new token count at almost every step: plans and kernel sites stay bounded.
    monkeypatch.setattr(functional.Plans, "KEPT", 8)
    layer = _layer(backend)
    counts = range(1, 2001) if backend == "torch" else range(1, 41)  # the interpreter runs each kernel
    A, B = layer.lora_A.weight, layer.lora_B.weight
    for m in counts:
        x = torch.randn(m, 16, requires_grad=True)
        y = layer(x)
        dx, dA, dB = torch.autograd.grad(y, (x, A, B), torch.ones_like(y))
        assert len(layer._plans) <= 8
        if m % 13 == 1:
            xr = x.detach().requires_grad_(True)
            yr = lora_linear(xr, layer.weight, None, A, B, layer.scale, backend="torch")
            want = (yr, *torch.autograd.grad(yr, (xr, A, B), torch.ones_like(yr)))
            for got, ref in zip((y, dx, dA, dB), want, strict=True):
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_dispatch_layout_caches_are_bounded(monkeypatch):
    monkeypatch.setattr(dispatch, "SITES_KEPT", 4)
    monkeypatch.setattr(dispatch, "_FORWARD_SITES", {})
    monkeypatch.setattr(dispatch, "_BACKWARD_SITES", {})
    torch.manual_seed(0)
    w, a, b = torch.randn(24, 16), torch.randn(4, 16), torch.randn(24, 4)
    for m in range(1, 11):
        x = torch.randn(m, 16)
        y, s = dispatch.forward(x, w, None, a, b, 0.5, None)
        dispatch.backward(torch.ones_like(y), x, w, a, b, s, 0.5, None)
        assert len(dispatch._FORWARD_SITES) <= 4 and len(dispatch._BACKWARD_SITES) <= 4
    torch.testing.assert_close(y, x @ w.t() + 0.5 * (x @ a.t()) @ b.t())


def test_bound_signatures_are_capped(monkeypatch):
    # The compiled-kernel path of ``launcher.bind``, with Triton's compile and launch stubbed (no GPU here).
    class Compiled:
        def __getitem__(self, grid):
            return lambda *args: None

    spec = KernelSpec("stub", list, ("M",), lambda *a: 0, lambda *a: True, lambda n: 0, "x_ptr")
    kernel = type("Kernel", (), {"__name__": "stub_kernel", "arg_names": ["x_ptr"]})()
    monkeypatch.setattr(launcher, "interpreting", lambda: False)
    monkeypatch.setattr(launcher, "BOUND_KEPT", 4)
    monkeypatch.setattr(launcher, "_BOUND", {})
    monkeypatch.setattr(launcher.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launcher.triton.compiler, "CompiledKernel", Compiled)
    monkeypatch.setattr(launcher, "launch_tuned", lambda *args: (Compiled(), triton.Config({})))
    x, runtime = torch.zeros(4), (1.0, 0.0, torch.zeros(1, dtype=torch.int64), 0)
    for m in range(10):
        launcher.bind(spec, kernel, ("signature", m), (x,), runtime, lambda: ((), (1,), {}))
    assert len(launcher._BOUND) == 4
    assert [key[3] for key in launcher._BOUND] == [("signature", m) for m in range(6, 10)], "the oldest go first"


def _tp_plans_are_built_once() -> None:
    torch.manual_seed(0)
    mesh = _dist.mesh()
    config = LoRAConfig(r=4, alpha=8, dropout=0.1)
    col = ColumnParallelLoRALinear(16, 24, config, mesh).train()
    row = RowParallelLoRALinear(24, 16, config, mesh).train()
    checks = []
    for layer in (col, row):
        real = layer._check_call
        layer._check_call = lambda x, _real=real: checks.append(1) or _real(x)
    x = torch.randn(2, 6, 16)
    for _ in range(3):
        row(col(x)).sum().backward()
    assert len(checks) == 2 and len(col._plans) == len(row._plans) == 1, (checks, col._plans, row._plans)


def test_tp_layers_check_a_signature_once():
    _dist.run_ranks(2, _tp_plans_are_built_once)
