"""The fused op (``parallel_lora.kernels.forward`` / ``backward``) against the eager oracle, and its input checks.

Reference: ``parallel_lora._eager`` in fp64 on the same inputs (``tests/_kernels.py`` states the error measure).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from parallel_lora import kernels
from parallel_lora._dropout import Dropout, seed_tensor
from parallel_lora.kernels import dispatch, workspace
from parallel_lora.kernels.adapter_grads import split_rows
from parallel_lora.kernels.shrink import k_splits
from tests._kernels import (
    DEVICE,
    DROPOUTS,
    DTYPES,
    INTERPRETING,
    LAUNCH_NAMES,
    SCALE,
    TOL,
    assert_matches,
    check_against_eager,
    count_launches,
    make_inputs,
    patch_bind,
    reference,
    rel_err,
    skip_without_tma,
)

SHAPES = {
    "multi_tile": (64, 96, 80, 16),  # several tiles along every dim in the interpreter (blocks of 32)
    "m1_odd": (1, 17, 33, 5),
    "tiny_kn_r1": (37, 3, 1, 1),
    "odd_r33": (33, 65, 17, 33),  # r pads to 64: two rank chunks are not needed, but a masked tail is
}


@pytest.mark.slow
@pytest.mark.parametrize("drop", list(DROPOUTS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_op_matches_eager(dtype, shape, drop):
    M, K, N, r = SHAPES[shape]
    inputs = make_inputs(M, K, N, r, dtype, bias=(shape != "tiny_kn_r1"))
    check_against_eager(*inputs, SCALE, DROPOUTS[drop])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_op_rank_256_matches_eager(dtype):
    # r = 256 is the largest rank: four BLOCK_R = 64 chunks in the GEMM, a 256-wide rank tile elsewhere.
    inputs = make_inputs(5, 40, 24, 256, dtype)
    drop = Dropout(p=0.2, seed=seed_tensor(2**40 + 3, DEVICE), position="pre", k_offset=7)
    check_against_eager(*inputs, SCALE, drop)


@pytest.mark.parametrize("shape", ["multi_tile", "odd_r33"])
@pytest.mark.parametrize("drop", [None, "pre", "post"])
def test_op_reads_fp32_adapters_as_their_16bit_cast(shape, drop):
    # fp32 master adapters over bf16 activations: the kernels round each adapter tile in registers, so y, S and dx
    # equal the op's on adapters cast beforehand, and dA, dB come back in fp32, within a bf16 rounding of its.
    M, K, N, r = SHAPES[shape]
    x, weight, b, lora_A, lora_B, dy = make_inputs(M, K, N, r, torch.bfloat16)
    A32, B32 = lora_A.float() + 1e-3 * torch.randn_like(lora_A.float()), lora_B.float()
    dropout = None if drop is None else Dropout(p=0.25, seed=seed_tensor(11, DEVICE), position=drop, k_offset=3)
    cast = (A32.bfloat16(), B32.bfloat16())
    y, s_lora = kernels.forward(x, weight, b, A32, B32, SCALE, dropout)
    y_ref, s_ref = kernels.forward(x, weight, b, *cast, SCALE, dropout)
    assert torch.equal(y, y_ref) and torch.equal(s_lora, s_ref) and s_lora.dtype == torch.bfloat16
    dx, dA, dB = kernels.backward(dy, x, weight, A32, B32, s_lora, SCALE, dropout)
    dx_ref, dA_ref, dB_ref = kernels.backward(dy, x, weight, *cast, s_ref, SCALE, dropout)
    assert dA.dtype == dB.dtype == torch.float32 and dx.dtype == torch.bfloat16
    assert torch.equal(dx, dx_ref)
    for got, ref in ((dA, dA_ref), (dB, dB_ref)):
        assert ((got - ref.float()).abs() <= got.abs() * 2**-7).all()


def test_an_int_seed_drops_as_its_tensor_in_every_kernel(monkeypatch):
    # An int reaches a kernel as its scalar seed_salt beside a zero in memory, a tensor through seed_ptr: one 64-bit
    # seed, one mask, bit for bit, in every launch of the op (TMA and plain, fused and separate backward).
    skip_without_tma()
    real_fused = dispatch._dx_takes_fused
    launched = count_launches(monkeypatch)
    for M, K, N, dtype in ((64, 96, 80, torch.bfloat16), (37, 30, 22, torch.float32)):
        x, weight, b, lora_A, lora_B, dy = make_inputs(M, K, N, 8, dtype)
        for name in ("pre", "post"):
            as_tensor = DROPOUTS[name]
            for fused in (True, False):
                monkeypatch.setattr(dispatch, "_dx_takes_fused", real_fused if fused else lambda dy, w: False)
                runs = []
                for seed in (as_tensor.seed, int(as_tensor.seed), int(as_tensor.seed) + 1):
                    drop = dataclasses.replace(as_tensor, seed=seed)
                    dispatch.clear_sites()
                    y, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, drop)
                    runs.append((y, s_lora, *kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, drop)))
                tensor_run, int_run, other_run = runs
                for what, t, i in zip(("y", "S", "dx", "dA", "dB"), tensor_run, int_run, strict=True):
                    assert torch.equal(t, i), f"{name}, {dtype}, fused={fused}: {what}"
                assert not torch.equal(tensor_run[1 if name == "post" else 3], other_run[1 if name == "post" else 3])
    dispatch.clear_sites()
    assert set(launched) == set(LAUNCH_NAMES), f"not every kernel ran: {sorted(set(LAUNCH_NAMES) - set(launched))}"


def test_adapter_grads_multi_split_matches_eager_repeats_and_resets_counters():
    # M = 130 splits the dA / dB reduction over M into several fp32 partials in the interpreter; the last
    # program of each tile sums them. A counter left non-zero would make the next launch store nothing.
    x, weight, b, lora_A, lora_B, dy = make_inputs(130, 40, 40, 8, torch.float32)
    if INTERPRETING:
        assert split_rows(130, 80, x.device)[0] > 1, "the shape no longer exercises the multi-split path"
    drop = Dropout(p=0.3, seed=seed_tensor(9, DEVICE), position="pre", k_offset=3)
    check_against_eager(x, weight, b, lora_A, lora_B, dy, SCALE, drop)
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, drop)
    first = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, drop)
    second = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, drop)
    for a, c in zip(first, second, strict=True):
        assert torch.equal(a, c)
    assert workspace.COUNTERS, "the multi-split path did not use the shared workspace"
    for count in workspace.COUNTERS.values():
        assert not count.any(), "arrival counters were left non-zero"


@pytest.mark.parametrize("drop", list(DROPOUTS), ids=list(DROPOUTS))
def test_shrink_split_over_k_matches_eager_repeats_and_resets_counters(drop):
    # Few rows split K (S's and G's shrinks alike); the row block's last arrival sums the splits in order.
    x, weight, b, lora_A, lora_B, dy = make_inputs(40, 600, 520, 8, torch.float32)
    assert k_splits(40, 600, x.device)[0] > 1 and k_splits(40, 520, x.device)[0] > 1
    workspace.G_COUNTERS.clear()
    workspace.G_PARTIALS.clear()
    dropout = DROPOUTS[drop]
    check_against_eager(x, weight, b, lora_A, lora_B, dy, SCALE, dropout)
    runs = []
    for _ in range(2):
        y, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, dropout)
        runs.append((y, s_lora, *kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, dropout)))
    for a, c in zip(*runs, strict=True):
        assert torch.equal(a, c)
    assert workspace.G_COUNTERS, "the split shrink did not use the shared workspace"
    for count in workspace.G_COUNTERS.values():
        assert not count.any(), "arrival counters were left non-zero"


@pytest.mark.parametrize("wanted", ["dA", "dB"])
@pytest.mark.parametrize("M", [9, 130], ids=["one_split", "multi_split"])
def test_op_one_adapter_gradient_alone_matches_eager(M, wanted):
    # The fused launch with the other gradient's columns empty (a frozen lora_A or lora_B).
    x, weight, b, lora_A, lora_B, dy = make_inputs(M, 40, 24, 8, torch.float32)
    drop = Dropout(p=0.3, seed=seed_tensor(5, DEVICE), position="pre", k_offset=2)
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, drop)
    outs = kernels.backward(
        dy, x, weight, lora_A, lora_B, s_lora, SCALE, drop, needs_dx=False,
        needs_dA=wanted == "dA", needs_dB=wanted == "dB",
    )  # fmt: skip
    ref = reference(x, weight, b, lora_A, lora_B, dy, SCALE, drop)
    mag = reference(x, weight, b, lora_A, lora_B, dy, SCALE, drop, absolute=True)
    i = ("dx", "dA", "dB").index(wanted)
    assert all(t is None for j, t in enumerate(outs) if j != i)
    assert_matches(wanted, outs[i], ref[2 + i], mag[2 + i], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_op_strided_inputs_match_eager(dtype):
    M, K, N, r = 33, 40, 24, 6
    x, weight, b, lora_A, lora_B, dy = make_inputs(M, K, N, r, dtype)
    # Strided / transposed views of the same values: every operand takes its strides into the kernel.
    x_nc = torch.zeros(M, 2 * K, dtype=dtype, device=DEVICE)[:, ::2]
    x_nc.copy_(x)
    weight_nc = weight.t().contiguous().t()
    b_nc = torch.zeros(2 * N, dtype=dtype, device=DEVICE)[::2]
    b_nc.copy_(b)
    lora_A_nc = lora_A.t().contiguous().t()
    lora_B_nc = lora_B.t().contiguous().t()
    dy_nc = dy.t().contiguous().t()
    assert not any(t.is_contiguous() for t in (x_nc, weight_nc, b_nc, lora_A_nc, lora_B_nc, dy_nc))
    drop = Dropout(p=0.3, seed=seed_tensor(4, DEVICE), position="pre", k_offset=11)
    check_against_eager(x_nc, weight_nc, b_nc, lora_A_nc, lora_B_nc, dy_nc, SCALE, drop)


def test_backward_needs_flags_skip_gradients():
    x, weight, b, lora_A, lora_B, dy = make_inputs(9, 16, 8, 4, torch.float32)
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, None)
    dx, dA, dB = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, None, needs_dx=False)
    assert dx is None and dA is not None and dB is not None
    dx, dA, dB = kernels.backward(
        dy, x, weight, lora_A, lora_B, s_lora, SCALE, None, needs_dA=False, needs_dB=False
    )
    assert dx is not None and dA is None and dB is None
    ref_dx = reference(x, weight, b, lora_A, lora_B, dy, SCALE, None)[2]
    mag_dx = reference(x, weight, b, lora_A, lora_B, dy, SCALE, None, absolute=True)[2]
    assert_matches("dx", dx, ref_dx, mag_dx, torch.float32)


def test_op_m_zero_returns_empty_outputs_without_launch(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched for M = 0")

    patch_bind(monkeypatch, no_launch)
    x, weight, b, lora_A, lora_B, dy = make_inputs(0, 16, 8, 4, torch.bfloat16)
    y, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, DROPOUTS["pre"])
    assert y.shape == (0, 8) and s_lora.shape == (0, 4) and y.dtype == s_lora.dtype == torch.bfloat16
    dx, dA, dB = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, DROPOUTS["pre"])
    assert dx.shape == (0, 16)
    # Gradients of a sum over zero rows are zeros, not uninitialized memory.
    assert torch.equal(dA, torch.zeros(4, 16, dtype=torch.bfloat16, device=DEVICE))
    assert torch.equal(dB, torch.zeros(8, 4, dtype=torch.bfloat16, device=DEVICE))


def test_op_check_fails_with_a_wrong_seed():
    # The comparison is not vacuous: the same call with another seed is far outside the tolerance.
    x, weight, b, lora_A, lora_B, dy = make_inputs(32, 48, 16, 8, torch.float32)
    drop = Dropout(p=0.5, seed=seed_tensor(1, DEVICE), position="pre")
    other = Dropout(p=0.5, seed=seed_tensor(2, DEVICE), position="pre")
    y, _ = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, other)
    y_ref = reference(x, weight, b, lora_A, lora_B, dy, SCALE, drop)[0]
    y_mag = reference(x, weight, b, lora_A, lora_B, dy, SCALE, drop, absolute=True)[0]
    assert rel_err(y, y_ref, y_mag) > 100 * TOL[torch.float32]


# ---------------------------------------------------------------------------------------------------------
# Input checks.
# ---------------------------------------------------------------------------------------------------------


def _bad_forward_cases():
    x, w, b, A, B, _ = make_inputs(4, 8, 6, 2, torch.float32)
    big_r = torch.randn(257, 8, device=DEVICE)
    return {
        "x_1d": ((x[0], w, b, A, B, 1.0, None), "x must be a 2-D"),
        "weight_k": ((x, w[:, :5], b, A, B, 1.0, None), "weight must have shape"),
        "lora_A_k": ((x, w, b, A[:, :5], B, 1.0, None), "lora_A must have shape"),
        "lora_B_r": ((x, w, b, A, B[:, :1], 1.0, None), "lora_B must have shape"),
        "bias_n": ((x, w, b[:3], A, B, 1.0, None), "bias must have shape"),
        "rank_257": ((x, w, b, big_r, torch.randn(6, 257, device=DEVICE), 1.0, None), "rank r"),
        "mixed_dtype": ((x.bfloat16(), w, b, A, B, 1.0, None), "one dtype"),
        "mixed_adapters": ((x, w, b, A, B.bfloat16(), 1.0, None), "lora_A and lora_B must share one dtype"),
        "int_dtype": ((x.int(), w.int(), None, A.int(), B.int(), 1.0, None), "float32, float16 or bfloat16"),
        "scale_nan": ((x, w, b, A, B, float("nan"), None), "scale"),
        "seed_on_cpu": ((x, w, b, A, B, 1.0, Dropout(0.1, seed_tensor(0, "cpu"))), "device")
        if DEVICE != "cpu"
        else ((x, w, b, A, B, 1.0, 0.1), "dropout must be a parallel_lora._dropout.Dropout"),
    }


@pytest.mark.parametrize("case", list(_bad_forward_cases()))
def test_forward_bad_input_raises_value_error(case):
    args, message = _bad_forward_cases()[case]
    with pytest.raises(ValueError, match=message):
        kernels.forward(*args)


def test_backward_bad_input_raises_value_error():
    x, w, _, A, B, dy = make_inputs(4, 8, 6, 2, torch.float32)
    s_lora = torch.randn(4, 2, device=DEVICE)
    with pytest.raises(ValueError, match="dy must have shape"):
        kernels.backward(dy[:, :5], x, w, A, B, s_lora, 1.0, None)
    with pytest.raises(ValueError, match="s_lora must have shape"):
        kernels.backward(dy, x, w, A, B, s_lora[:3], 1.0, None)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.backward(dy.half(), x, w, A, B, s_lora, 1.0, None)
