"""``lora_linear``: values, gradients, dtypes, saved tensors, dropout, shapes and input checks, per backend.

Reference: ``tests/_reference.lora_reference``, the fp64 dense ``y = x W^T + b + s (drop(x) A^T) B^T`` from
the same tensors the op receives, each rounded to the dtype of the defined compute (``x``/``W``/``b`` to the
compute dtype, i.e. bf16 for an autocast-promoted fp32 ``x``; adapters at their own precision), with its
fp64 autograd gradients; tolerances from ``tests/_reference.TOLERANCES`` (keyed on the compute dtype).
The dtype rule under test is docs/design.md section 2 / ``docs/dtype_policy.md``.

Both backends run everywhere: "torch" (eager) and "triton" (the Triton CPU interpreter when there is no
GPU; ``conftest`` sets ``TRITON_INTERPRET=1``). Interpreter sizes are kept small (M, K, N <= 48).
CPU autocast is exercised with bf16 only (the dtype CPU autocast is meant for); fp16 is covered outside
autocast, as a base weight dtype and as fp16 adapters.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from _reference import GPU_BF16, assert_close, lora_reference

import parallel_lora.eager as eager
from parallel_lora import lora_linear
from parallel_lora.dropout import Dropout, keep_mask, seed_tensor
from parallel_lora.functional import resolve_backend

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
def test_fused_kernel_sees_one_operand_dtype(case, backend, monkeypatch):
    """(b) Every tensor handed to the Triton forward/backward is in the compute dtype: an autocast-promoted
    fp32 x and fp32 adapters over a bf16 base reach the kernels as bf16 (no fp32 tiles, no mixed dots)."""
    import parallel_lora.kernels as kernels

    seen = record_calls(monkeypatch, kernels)
    inp = make_inputs(case)
    x, y = run_op(case, inp, backend)
    y.backward(torch.randn_like(y))
    assert set(seen) == {"forward", "backward"}
    for phase, dtypes in seen.items():
        assert dtypes == {case.compute}, f"{phase} received {dtypes}, expected only {case.compute}"


def test_autocast_promoted_input_reaches_eager_backend_as_bf16(monkeypatch):
    """(b), torch backend: x and W arrive in bf16; the x saved for backward is bf16, not the fp32 input."""
    case = Case(BF16, F32, F32, True)
    received = {}

    def spy(x, weight, bias, lora_A, lora_B, scale, dropout):
        received.update(x=x.dtype, weight=weight.dtype, lora_A=lora_A.dtype)
        return real(x, weight, bias, lora_A, lora_B, scale, dropout)

    real = eager.forward
    monkeypatch.setattr(eager, "forward", spy)
    inp = make_inputs(case)
    _, y, saved = op_saved(case, inp, "torch")
    # The eager path runs the rank-r math in the adapter dtype by design; x and W are the compute dtype.
    assert received == {"x": BF16, "weight": BF16, "lora_A": F32}
    saved_x = [t for t in saved if tuple(t.shape) == (M, K)]
    assert [t.dtype for t in saved_x] == [BF16]
    assert y.dtype == BF16


def record_calls(monkeypatch, module) -> dict[str, set[torch.dtype]]:
    """Wrap the forward and backward the autograd Function calls in ``module``; record the dtypes of every
    tensor argument."""
    seen: dict[str, set[torch.dtype]] = {}
    for phase in ("forward", "backward"):
        real = getattr(module, phase)

        def wrapper(*args, _real=real, _phase=phase, **kw):
            seen.setdefault(_phase, set()).update(a.dtype for a in args if isinstance(a, torch.Tensor))
            return _real(*args, **kw)

        monkeypatch.setattr(module, phase, wrapper)
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
    # Besides x and parameter-shaped tensors (the fused path's casts of fp32 adapters), exactly one [M, r].
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
# Dropout (on the LoRA branch only; the mask is a function of (seed, row, column)).
# ---------------------------------------------------------------------------------------------------------

FP32 = Case(F32, F32, F32, False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_eval_mode_ignores_dropout(backend):
    inp = make_inputs(FP32)
    _, y_eval = run_op(FP32, inp, backend, dropout_p=0.5, training=False, dropout_seed=3)
    _, y_none = run_op(FP32, inp, backend)
    assert torch.equal(y_eval, y_none)


@pytest.mark.parametrize("position", ["pre", "post"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_with_zero_B_leaves_the_base_output_unchanged(backend, position):
    inp = make_inputs(FP32)
    with torch.no_grad():
        inp.lora_B.zero_()
    _, y_train = run_op(FP32, inp, backend, dropout_p=0.5, training=True, dropout_position=position)
    _, y_eval = run_op(FP32, inp, backend)
    assert torch.equal(y_train, y_eval)
    if backend == "torch":
        assert torch.equal(y_train, F.linear(inp.x_leaf, inp.weight, inp.bias))


@pytest.mark.parametrize("position", ["pre", "post"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_with_zero_base_is_the_dropped_lora_branch(backend, position):
    inp = make_inputs(FP32, bias=False)
    inp.weight.zero_()
    p, seed = 0.3, 1234
    kwargs = {"dropout_p": p, "training": True, "dropout_position": position, "dropout_seed": seed}
    _, y = run_op(FP32, inp, backend, **kwargs)
    x, a, b = (t.detach().double() for t in (inp.x_leaf, inp.lora_A, inp.lora_B))
    cols = K if position == "pre" else R
    keep = keep_mask(Dropout(p, seed, position), M, cols, x.device).double() / (1 - p)
    if position == "pre":
        manual = SCALE * ((x * keep) @ a.t()) @ b.t()
    else:
        manual = SCALE * ((x @ a.t()) * keep) @ b.t()
    assert_close(y, manual, F32, "dropped LoRA branch")
    assert not torch.allclose(y.double(), SCALE * (x @ a.t()) @ b.t(), rtol=0.01), "no element was dropped"


@pytest.mark.parametrize("position", ["pre", "post"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_backward_use_the_same_mask(backend, position):
    inp = make_inputs(FP32)
    drop = Dropout(p=0.25, seed=2**40 + 17, position=position)  # a seed above 2**32 exercises both key words
    x, y = run_op(FP32, inp, backend, dropout_p=drop.p, training=True, dropout_position=position,
                  dropout_seed=drop.seed)  # fmt: skip
    dy = torch.randn_like(y)
    grads = grads_of(y, x, inp, dy)
    ref = lora_reference(x, inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE, dy, dropout=drop)
    assert_all_close((y, *grads), ref, F32)
    # Not vacuous: another seed's mask is outside the tolerance.
    other = lora_reference(x, inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE, dy,
                           dropout=Dropout(drop.p, drop.seed + 1, position))  # fmt: skip
    with pytest.raises(AssertionError):
        assert_close(grads[1], other.dA, F32, "dA with another seed")


@pytest.mark.parametrize("position", ["pre", "post"])
def test_triton_drops_the_same_elements_as_torch(position):
    """With ``W = 0`` and ``A = B = I`` the output is ``s * drop(x) / (1-p)`` and the input gradient is
    ``s * drop(dy) / (1-p)`` (either position): their zeros are exactly the dropped elements."""
    size, p, seed = 16, 0.5, 99
    case = Case(F32, F32, F32, False)
    keep = keep_mask(Dropout(p, seed, position), M, size, "cpu")
    zeros = {}
    for backend, device in (("torch", "cpu"), ("triton", triton_device())):
        with torch.device(device):
            inp = make_inputs(case, k=size, n=size, r=size, bias=False)
            with torch.no_grad():
                inp.weight.zero_()
                inp.lora_A.copy_(torch.eye(size))
                inp.lora_B.copy_(torch.eye(size))
            x, y = run_op(case, inp, backend, dropout_p=p, training=True, dropout_position=position,
                          dropout_seed=seed)  # fmt: skip
            (dx,) = torch.autograd.grad(y, x, torch.randn_like(y))
        zeros[backend] = ((y == 0).cpu(), (dx == 0).cpu())
        y_zero, dx_zero = zeros[backend]
        assert torch.equal(y_zero, ~keep) and torch.equal(dx_zero, ~keep), f"{backend} dropped other elements"
    for torch_zero, triton_zero in zip(zeros["torch"], zeros["triton"], strict=True):
        assert torch.equal(torch_zero, triton_zero)
    assert 0.3 < keep.float().mean().item() < 0.7  # the mask is not all-keep or all-drop


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tensor_seed_draws_the_mask_of_its_int(backend):
    # The kernels read the seed in device memory; an int is copied there, mod 2**64 (two's complement in int64).
    inp = make_inputs(FP32)
    seed, kwargs = 2**63 + 5, {"dropout_p": 0.3, "training": True}
    _, y_int = run_op(FP32, inp, backend, dropout_seed=seed, **kwargs)
    seed_t = seed_tensor(seed, inp.x_leaf.device)
    assert seed_t.tolist() == [seed - 2**64]
    _, y_tensor = run_op(FP32, inp, backend, dropout_seed=seed_t, **kwargs)
    assert torch.equal(y_int, y_tensor)
    _, y_other = run_op(FP32, inp, backend, dropout_seed=seed + 1, **kwargs)
    assert not torch.equal(y_int, y_other)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_seed_draws_one_on_the_device_per_call_reproducibly(backend):
    inp = make_inputs(FP32)
    kwargs = {"dropout_p": 0.3, "training": True}
    torch.manual_seed(1)
    first, second = (run_op(FP32, inp, backend, **kwargs)[1] for _ in range(2))
    torch.manual_seed(1)
    assert torch.equal(run_op(FP32, inp, backend, **kwargs)[1], first)
    assert not torch.equal(first, second)


@pytest.mark.parametrize(
    "seed", [torch.tensor([1, 2]), torch.tensor([1.0]), torch.tensor([1], device="meta")], ids=["two", "float", "meta"]
)
def test_a_bad_seed_tensor_raises_value_error(seed):
    inp = _good()
    with pytest.raises(ValueError, match="1-element int64 tensor on x's device"):
        lora_linear(inp.x_leaf, inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE, dropout_p=0.1, training=True,
                    dropout_seed=seed)  # fmt: skip


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
# Bad input: clear errors before any compute.
# ---------------------------------------------------------------------------------------------------------


def _good():
    return make_inputs(FP32)


def test_wrong_input_width_names_the_expected_width():
    inp = _good()
    with pytest.raises(ValueError, match=f"in_features={K}"):
        lora_linear(torch.randn(M, K + 1), inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE)


def test_integer_input_raises_type_error():
    inp = _good()
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        lora_linear(torch.ones(M, K, dtype=torch.int64), inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE)


@pytest.mark.parametrize(
    ("which", "shape", "message"),
    [
        ("lora_A", (R, K + 1), f"lora_A must be \\[r, in_features={K}\\]"),
        ("lora_A", (K,), f"lora_A must be \\[r, in_features={K}\\]"),
        ("lora_B", (N, R + 1), f"lora_B must be \\[out_features={N}, r={R}\\]"),
        ("lora_B", (R, N), f"lora_B must be \\[out_features={N}, r={R}\\]"),
        ("bias", (N + 1,), f"bias must be \\[out_features={N}\\]"),
        ("weight", (N, K, 1), "weight must be 2-D"),
    ],
)
def test_wrong_parameter_shape_raises_value_error(which, shape, message):
    args = vars(_good())
    args[which] = torch.randn(*shape)
    with pytest.raises(ValueError, match=message):
        lora_linear(args["x_leaf"], args["weight"], args["bias"], args["lora_A"], args["lora_B"], SCALE)


def test_triton_on_cpu_without_the_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    inp = _good()
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        lora_linear(inp.x_leaf, inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE, backend="triton")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "bogus"}, "backend must be one of"),
        ({"dropout_p": 1.0, "training": True}, "dropout_p must be in"),
        ({"dropout_p": 1 - 2**-16, "training": True}, r"1 - 2\*\*-16\)"),
        ({"dropout_position": "mid"}, "dropout_position must be"),
    ],
)
def test_bad_option_raises_value_error(kwargs, message):
    inp = _good()
    with pytest.raises(ValueError, match=message):
        lora_linear(inp.x_leaf, inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE, **kwargs)


def test_auto_backend_is_torch_on_cpu():
    assert resolve_backend("auto", torch.device("cpu")) == "torch"


# ---------------------------------------------------------------------------------------------------------
# GPU: the bf16 matrix on CUDA through backend="auto" (the fused Triton path) at the design's shapes.
# ---------------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
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
    import parallel_lora.kernels as kernels

    seen = record_calls(monkeypatch, kernels)
    case = Case(BF16, F32, F32, True)
    with torch.device("cuda"):
        inp = make_inputs(case, m=256, k=512, n=384, r=16)
    x, y = run_op(case, inp, "auto")
    assert x.dtype == F32 and y.dtype == BF16
    y.backward(torch.randn_like(y))
    assert seen == {"forward": {BF16}, "backward": {BF16}}
    assert inp.x_leaf.grad.dtype == F32 and inp.lora_A.grad.dtype == F32


def test_a_host_side_seed_refuses_cuda_graph_capture(monkeypatch):
    # An int seed is copied to the device at each call: a captured step would replay one mask forever. A seed
    # tensor drawn on the device replays fresh (tests/test_compile.py).
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        seed_tensor(3, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [2048, 8192])
def test_gpu_forward_backward_replays_from_a_cuda_graph_bit_for_bit(tokens):
    # Short sequences are host-bound; a user captures the step in a CUDA graph. The fused kernels (bound
    # launches, per-stream workspaces, in-kernel counters left at zero) must replay to the eager results. From
    # 8192 tokens the backward takes dB's partials from G's launch (kernels/shrink_db.py): more workspaces.
    from parallel_lora import LoRAConfig, LoRALinear

    torch.manual_seed(0)
    cfg = LoRAConfig(r=16, alpha=32, lora_dtype=F32)
    layer = LoRALinear(1024, 768, cfg, dtype=BF16, device="cuda")
    torch.nn.init.normal_(layer.lora_B.weight, std=0.02)
    params = [layer.lora_A.weight, layer.lora_B.weight]
    x = torch.randn(tokens, 1024, device="cuda", dtype=BF16, requires_grad=True)
    dy = torch.randn(tokens, 768, device="cuda", dtype=BF16)

    def step():
        y = layer(x)
        return (y.detach(), *torch.autograd.grad(y, [x, *params], dy))

    # Warm-up and capture on one stream, so the graph uses that stream's workspaces as they were.
    capture_stream = torch.cuda.Stream()
    capture_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture_stream):
        for _ in range(2):
            step()  # tune, compile and bind before capture
    torch.cuda.current_stream().wait_stream(capture_stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream):
        captured = step()
    for scale in (1.0, -0.5):
        with torch.no_grad():
            x.mul_(scale)
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for name, a, b in zip(("y", "dx", "dA", "dB"), captured, eager, strict=True):
            assert torch.equal(a, b), name
    # A larger layer called eagerly on the capture's own stream grows that stream's workspaces (the adapter
    # gradients' arrival counters and partial sums, dB's partials); the graph keeps the ones it captured, which
    # must stay allocated: small tensors allocated next would otherwise take their memory and be overwritten by
    # replays.
    wide = LoRALinear(4096, 4096, cfg, dtype=BF16, device="cuda")
    longer = torch.randn(8192, 4096, device="cuda", dtype=BF16, requires_grad=True)
    with torch.cuda.stream(capture_stream):
        y_long = wide(longer)
        torch.autograd.grad(y_long, [longer, wide.lora_A.weight, wide.lora_B.weight], torch.randn_like(y_long))
        filler = [torch.full((n,), 7, device="cuda", dtype=torch.int32) for n in (1 << 10, 1 << 12, 1 << 14) * 16]
    torch.cuda.current_stream().wait_stream(capture_stream)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for name, a, b in zip(("y", "dx", "dA", "dB"), captured, eager, strict=True):
        assert torch.equal(a, b), f"{name} after the workspaces grew"
    assert all(bool((f == 7).all()) for f in filler), "a replay wrote into memory the workspaces had freed"
