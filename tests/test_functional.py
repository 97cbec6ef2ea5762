"""``lora_linear``: values, gradients, dtypes, saved tensors and shapes, per backend.

Reference: ``tests/_reference.lora_reference``, the fp64 dense ``y = x W^T + b + s (drop(x) A^T) B^T`` from
the same tensors the op receives, each rounded to the dtype of the defined compute (``x``/``W``/``b`` to the
compute dtype, i.e. bf16 for an autocast-promoted fp32 ``x``; adapters at their own precision), with its
fp64 autograd gradients; tolerances from ``tests/_reference.TOLERANCES`` (keyed on the compute dtype).
The dtype rule under test is docs/design.md section 2.

Both backends run everywhere: "torch" (eager) and "triton" (the Triton CPU interpreter when there is no
GPU; ``conftest`` sets ``TRITON_INTERPRET=1``). Interpreter sizes are kept small (M, K, N <= 48).
CPU autocast is exercised with bf16 only (the dtype CPU autocast is meant for); fp16 is covered outside
autocast, as a base weight dtype and as fp16 adapters.

Dropout is in tests/test_functional_dropout.py, bad input in tests/test_functional_errors.py; the shared
cases, inputs and fixture in tests/_functional.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import parallel_lora._eager as eager
from parallel_lora import lora_linear
from parallel_lora.functional import resolve_backend
from tests._functional import (  # noqa: F401  (_backend_device: an autouse fixture, used by being imported)
    BACKENDS,
    BF16,
    F16,
    F32,
    FP32,
    SCALE,
    Case,
    Inputs,
    K,
    M,
    N,
    R,
    _backend_device,
    _name,
    assert_all_close,
    grads_of,
    make_inputs,
    needs_cuda,
    run_op,
)
from tests._reference import GPU_BF16, TOLERANCES, assert_close, lora_reference

CASES = [
    # plain: x already in the base dtype
    Case(F32, F32, F32, False),
    Case(F16, F16, F16, False),
    Case(F16, F32, F16, False),
    Case(BF16, BF16, BF16, False),
    Case(BF16, F32, BF16, False),
    # an fp32 activation handed to a 16-bit base: cast to the base dtype, its grad comes back fp32
    Case(F16, F16, F32, False),
    Case(F16, F32, F32, False),
    Case(BF16, BF16, F32, False),
    Case(BF16, F32, F32, False),
    # autocast(bf16)-promoted fp32 activation: computes in bf16 whatever the weight dtype
    Case(F32, F32, F32, True),
    Case(BF16, BF16, F32, True),
    Case(BF16, F32, F32, True),
]
CASE_IDS = [c.id for c in CASES]


# ---------------------------------------------------------------------------------------------------------
# The dtype matrix.
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_dtype_matrix_matches_fp64_reference(case, backend):
    inp = make_inputs(case)
    x, y = run_op(case, inp, backend)
    dy = torch.randn_like(y)
    dx, dA, dB = grads_of(y, x, inp, dy)
    ref = lora_reference(
        x, inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE, dy, compute_dtype=case.compute
    )
    assert_all_close((y, dx, dA, dB), ref, case.compute)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_output_is_base_dtype_and_each_grad_is_its_tensors_dtype(case, backend):
    inp = make_inputs(case)
    x, y = run_op(case, inp, backend)
    assert y.dtype == case.compute
    if not case.autocast:
        assert y.dtype == F.linear(x.to(case.w), inp.weight).dtype  # what the base layer alone returns
    dx, dA, dB = grads_of(y, x, inp, torch.ones_like(y))
    assert (dx.dtype, dA.dtype, dB.dtype) == (x.dtype, inp.lora_A.dtype, inp.lora_B.dtype)


def test_tolerance_check_fails_when_the_lora_term_is_dropped():
    """Not vacuous: for every compute dtype the reference without the LoRA term (or with the wrong scale)
    is outside the tolerance of what the op returns."""
    for dtype in (F32, F16, BF16):
        case = Case(dtype, dtype, dtype, False)
        inp = make_inputs(case)
        x, y = run_op(case, inp, "torch")
        dy = torch.randn_like(y)
        _, dA, _ = grads_of(y, x, inp, dy)
        no_lora = lora_reference(x, inp.weight, inp.bias, inp.lora_A, inp.lora_B, 0.0)
        with pytest.raises(AssertionError):
            assert_close(y, no_lora.y, dtype, "y without the LoRA term")
        wrong_scale = lora_reference(x, inp.weight, inp.bias, inp.lora_A, inp.lora_B, 1.1 * SCALE, dy)
        with pytest.raises(AssertionError):
            assert_close(dA, wrong_scale.dA, dtype, "dA with a 10% wrong scale")


# ---------------------------------------------------------------------------------------------------------
# The three failure modes the dtype rule prevents.
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("base", [BF16, F16], ids=_name)
def test_fp32_adapters_get_fp32_grads(base, backend):
    """(a) fp32 master adapters over a 16-bit base: no dtype error, fp32 adapter grads, 16-bit dx."""
    case = Case(base, F32, base, False)
    inp = make_inputs(case)
    x, y = run_op(case, inp, backend)
    y.backward(torch.randn_like(y))
    assert inp.lora_A.grad.dtype == F32 and inp.lora_B.grad.dtype == F32
    assert inp.x_leaf.grad.dtype == base


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("base", [BF16, F16], ids=_name)
def test_fp32_adapters_do_not_promote_the_output(base, backend):
    """(c) The LoRA addend never promotes the output: a 16-bit base returns 16-bit with fp32 adapters."""
    case = Case(base, F32, base, False)
    _, y = run_op(case, make_inputs(case), backend)
    assert y.dtype == base


@pytest.mark.parametrize("backend", ["triton"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_fused_kernel_sees_the_compute_dtype_and_the_adapters_as_they_are(case, backend, monkeypatch):
    """(b) The Triton forward/backward get x, W, b, dy and S in the compute dtype (an autocast-promoted fp32 x
    reaches them as bf16) and the adapters in their own dtype: the kernels round adapter tiles in registers."""
    seen = record_calls(monkeypatch)
    inp = make_inputs(case)
    x, y = run_op(case, inp, backend)
    y.backward(torch.randn_like(y))
    want = {"operands": {case.compute}, "adapters": {case.a}}
    assert seen == {"forward": want, "backward": want}


def test_fused_path_casts_no_fp32_adapter(monkeypatch):
    """fp32 adapters over a bf16 base on the Triton path: no copy of A or B in forward or backward (no cast op)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    case = Case(BF16, F32, BF16, False)
    inp = make_inputs(case)
    shapes = {tuple(inp.lora_A.shape), tuple(inp.lora_B.shape)}
    casts = []

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) in shapes:
                casts.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    with Casts():
        x, y = run_op(case, inp, "triton")
        y.backward(torch.randn_like(y))
    assert casts == [] and inp.lora_A.grad.dtype == F32


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_eager_backend_sees_one_operand_dtype(case, monkeypatch):
    """(b), torch backend: the oracle computes in the kernels' operand dtypes, so it is their reference up to the
    order of rounding."""
    seen: dict[str, set[torch.dtype]] = {}
    for phase in ("forward", "backward"):
        real = getattr(eager, phase)

        def spy(*args, _real=real, _phase=phase, **kw):
            seen.setdefault(_phase, set()).update(a.dtype for a in args if isinstance(a, torch.Tensor))
            return _real(*args, **kw)

        monkeypatch.setattr(eager, phase, spy)
    inp = make_inputs(case)
    _, y = run_op(case, inp, "torch")
    y.backward(torch.randn_like(y))
    assert seen == {"forward": {case.compute}, "backward": {case.compute}}, seen


def test_fused_kernels_write_fp32_adapter_grads_in_fp32(monkeypatch):
    """fp32 master adapters over a bf16 base: the kernels store dA, dB from their fp32 accumulators in fp32 (no bf16
    rounding, no cast node)."""
    from parallel_lora.kernels import dispatch

    made, real = [], dispatch.run_backward
    monkeypatch.setattr(dispatch, "run_backward", lambda *a: made.append(real(*a)) or made[-1])
    case = Case(BF16, F32, BF16, False)
    inp = make_inputs(case)
    x, y = run_op(case, inp, "triton")
    dy = torch.randn_like(y)
    dx, dA, dB = grads_of(y, x, inp, dy)
    assert [t.dtype for t in made[0]] == [BF16, F32, F32]
    ref = lora_reference(x, inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE, dy, compute_dtype=BF16)
    assert_all_close((y, dx, dA, dB), ref, TOLERANCES[BF16])


def test_autocast_promoted_input_and_fp32_adapters_reach_eager_backend_as_bf16(monkeypatch):
    """(b), torch backend: x, W and the adapters arrive in bf16; the x saved for backward is bf16, not the fp32
    input."""
    case = Case(BF16, F32, F32, True)
    received = {}

    def spy(x, weight, bias, lora_A, lora_B, scale, dropout):
        received.update(x=x.dtype, weight=weight.dtype, lora_A=lora_A.dtype)
        return real(x, weight, bias, lora_A, lora_B, scale, dropout)

    real = eager.forward
    monkeypatch.setattr(eager, "forward", spy)
    inp = make_inputs(case)
    _, y, saved = op_saved(case, inp, "torch")
    assert received == {"x": BF16, "weight": BF16, "lora_A": BF16}
    saved_x = [t for t in saved if tuple(t.shape) == (M, K)]
    assert [t.dtype for t in saved_x] == [BF16]
    assert y.dtype == BF16


def record_calls(monkeypatch) -> dict[str, dict[str, set[torch.dtype]]]:
    """Wrap the kernels' forward and backward launches; record the dtypes of the adapters (arguments 4 and 5 of
    both) and of every other tensor argument."""
    from parallel_lora.kernels import dispatch

    seen: dict[str, dict[str, set[torch.dtype]]] = {}
    for phase in ("forward", "backward"):
        real = getattr(dispatch, f"run_{phase}")

        def wrapper(*args, _real=real, _phase=phase, **kw):
            got = seen.setdefault(_phase, {"operands": set(), "adapters": set()})
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    got["adapters" if i in (4, 5) else "operands"].add(a.dtype)
            return _real(*args, **kw)

        monkeypatch.setattr(dispatch, f"run_{phase}", wrapper)
    return seen


# ---------------------------------------------------------------------------------------------------------
# Saved tensors: x (the caller's, in the compute dtype) + parameters + one [M, r] tensor; dropout adds none.
# ---------------------------------------------------------------------------------------------------------


def saved_during(fn):
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def op_saved(case: Case, inp: Inputs, backend: str, **kwargs):
    """``run_op`` under the hooks, minus what ``torch.square`` saved (its input: a leaf the op never sees)."""
    (x, y), saved = saved_during(lambda: run_op(case, inp, backend, **kwargs))
    return x, y, [t for t in saved if not (case.autocast and _storage(t) == _storage(inp.x_leaf))]


# One per input kind, plus fp32 adapters (whose casts the fused path saves). Not an fp32 W under autocast:
# that W is cast to bf16 (as F.linear under autocast would), a parameter copy, not an activation.
SAVED_CASES = [
    Case(F32, F32, F32, False),
    Case(BF16, BF16, BF16, False),
    Case(F16, F32, F16, False),
    Case(BF16, F32, BF16, False),
    Case(BF16, F32, F32, False),
    Case(BF16, F32, F32, True),
]


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [None, "pre", "post"], ids=lambda d: f"dropout-{d}")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SAVED_CASES, ids=[c.id for c in SAVED_CASES])
def test_saved_tensors_are_x_params_and_one_m_by_r_tensor(case, backend, dropout):
    inp = make_inputs(case)
    params = [p for p in (inp.weight, inp.bias, inp.lora_A, inp.lora_B) if p is not None]
    kwargs = {} if dropout is None else {"dropout_p": 0.25, "training": True, "dropout_position": dropout}
    x, y, saved = op_saved(case, inp, backend, dropout_seed=7, **kwargs)
    x_bytes = x.numel() * x.element_size()
    param_storages = {_storage(p) for p in params}
    param_shapes = {tuple(p.shape) for p in params}
    activations = [t for t in saved if _storage(t) not in param_storages]
    for t in activations:
        assert t.numel() * t.element_size() <= x_bytes, f"saved {tuple(t.shape)} {t.dtype} is larger than x"
    if backend == "triton":  # the kernels read the adapters themselves: no copy is saved
        assert _storage(inp.lora_A) in map(_storage, saved) and _storage(inp.lora_B) in map(_storage, saved)
    # Besides x and parameter-shaped tensors (the torch backend's casts of fp32 adapters), exactly one [M, r].
    others = [t for t in activations if tuple(t.shape) != (M, K) and tuple(t.shape) not in param_shapes]
    assert [tuple(t.shape) for t in others] == [(M, R)]
    saved_x = [t for t in saved if tuple(t.shape) == (M, K)]
    assert len(saved_x) == 1 and saved_x[0].dtype == case.compute  # no fp32 copy of a bf16 x
    if x.dtype == case.compute:
        assert _storage(saved_x[0]) == _storage(x), "x was copied instead of saved"
    assert not any(t.dtype in (torch.bool, torch.uint8) for t in saved), "a dropout mask was saved"
    if dropout is not None:  # regenerated from the seed: the same tensors as without dropout
        _, _, saved_plain = op_saved(case, inp, backend)
        assert [(t.shape, t.dtype) for t in saved] == [(t.shape, t.dtype) for t in saved_plain]
    y.sum().backward()  # the saved tensors suffice


# ---------------------------------------------------------------------------------------------------------
# Shapes, strides and bias.
# ---------------------------------------------------------------------------------------------------------


def _x_3d():
    return torch.randn(2, 12, K, dtype=BF16)


def _x_transposed():
    return torch.randn(K, M, dtype=BF16).t()  # strides (1, M)


def _x_strided():
    return torch.randn(M, 2 * K, dtype=BF16)[:, ::2]  # strides (2K, 2)


SHAPES = {
    "3d": dict(x=_x_3d),
    "m1": dict(m=1),
    "odd-k7-n13-r3": dict(m=5, k=7, n=13, r=3),
    "transposed-x": dict(x=_x_transposed),
    "strided-x": dict(x=_x_strided),
}


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_shapes_and_strides_match_reference(shape, backend, bias):
    spec = dict(SHAPES[shape])
    make_x = spec.pop("x", None)
    case = Case(BF16, F32, BF16, False)
    inp = make_inputs(case, bias=bias, **spec)
    x = inp.x_leaf
    if make_x is not None:
        x = make_x().requires_grad_(True)
        assert shape == "3d" or not x.is_contiguous()
    y = lora_linear(x, inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE, backend=backend)
    assert y.shape == (*x.shape[:-1], inp.weight.shape[0])
    dy = torch.randn_like(y)
    dx, dA, dB = torch.autograd.grad(y, (x, inp.lora_A, inp.lora_B), dy)
    ref = lora_reference(x, inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE, dy)
    assert_all_close((y, dx, dA, dB), ref, BF16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_gives_empty_output_and_zero_adapter_grads(backend):
    case = Case(BF16, F32, BF16, False)
    inp = make_inputs(case, m=0)
    x, y = run_op(case, inp, backend)
    assert y.shape == (0, N) and y.dtype == BF16
    y.sum().backward()
    assert inp.x_leaf.grad.shape == (0, K)
    assert torch.equal(inp.lora_A.grad, torch.zeros(R, K)) and torch.equal(inp.lora_B.grad, torch.zeros(N, R))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [FP32, Case(BF16, F32, BF16, False)], ids=lambda c: c.id)
def test_trainable_base_weight_gets_its_gradient(case, backend):
    """``dW``/``db`` are not silently dropped when the base is trainable."""
    inp = make_inputs(case)
    inp.weight.requires_grad_(True)
    inp.bias.requires_grad_(True)
    x, y = run_op(case, inp, backend)
    dy = torch.randn_like(y)
    dW, db = torch.autograd.grad(y, (inp.weight, inp.bias), dy)
    ref = lora_reference(x, inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE, dy)
    assert dW.dtype == case.w and db.dtype == case.w
    assert_close(dW, ref.dW, case.compute, "dW")
    assert_close(db, ref.db, case.compute, "db")


# ---------------------------------------------------------------------------------------------------------
# GPU: the bf16 matrix on CUDA through backend="auto" (the fused Triton path) at the design's shapes.
# ---------------------------------------------------------------------------------------------------------

GPU_SHAPES = {"8192x4096x4096-r16": (8192, 4096, 4096, 16), "odd-1021x1000x1531-r13": (1021, 1000, 1531, 13)}
GPU_CASES = [Case(BF16, BF16, BF16, False), Case(BF16, F32, BF16, False), Case(BF16, F32, F32, False),
             Case(BF16, F32, F32, True)]  # fmt: skip


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.id for c in GPU_CASES])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_bf16_matches_fp64_reference(shape, case):
    m, k, n, r = GPU_SHAPES[shape]
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    with torch.device("cuda"):
        inp = make_inputs(case, m=m, k=k, n=n, r=r)
    x, y = run_op(case, inp, "auto")
    assert y.dtype == BF16
    dy = torch.randn_like(y)
    dx, dA, dB = grads_of(y, x, inp, dy)
    assert (dx.dtype, dA.dtype, dB.dtype) == (x.dtype, case.a, case.a)
    ref = lora_reference(x, inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE, dy, compute_dtype=BF16)
    assert_all_close((y, dx, dA, dB), ref, GPU_BF16)


@pytest.mark.gpu
@needs_cuda
def test_gpu_autocast_promoted_input_reaches_the_kernel_as_bf16(monkeypatch):
    seen = record_calls(monkeypatch)
    case = Case(BF16, F32, F32, True)
    with torch.device("cuda"):
        inp = make_inputs(case, m=256, k=512, n=384, r=16)
    x, y = run_op(case, inp, "auto")
    assert x.dtype == F32 and y.dtype == BF16
    y.backward(torch.randn_like(y))
    want = {"operands": {BF16}, "adapters": {F32}}
    assert seen == {"forward": want, "backward": want}
    assert inp.x_leaf.grad.dtype == F32 and inp.lora_A.grad.dtype == F32
