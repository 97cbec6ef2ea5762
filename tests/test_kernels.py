"""Tests for ``parallel_lora.kernels`` (the fused Triton LoRA op).

Reference: ``parallel_lora.eager`` (the oracle), run in fp64 on the *same* inputs (the kernel's inputs cast
up exactly), with the same ``Dropout``; the keep-mask reference is ``parallel_lora.dropout.keep_mask``.
On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by ``conftest``), so the
shapes are small; the ``gpu``-marked tests at the end run the real shapes on CUDA.

Errors are measured elementwise against the magnitude of the terms each element sums,
``|out - ref| <= tol * mag`` with ``mag`` the same oracle run on ``|inputs|`` (dropout masks and scales are
non-negative, so ``mag`` is exactly ``sum |term|``): the standard floating-point bound for a sum of products,
which stays meaningful when the terms cancel (a small ``ref`` from large terms).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from parallel_lora import eager
from parallel_lora.dropout import Dropout, keep_mask
from parallel_lora.dropout import hash_uniform as torch_hash_uniform

HAS_CUDA = torch.cuda.is_available()
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

if not (INTERPRETING or HAS_CUDA):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (set by conftest without CUDA)", allow_module_level=True)

from parallel_lora import kernels  # noqa: E402  (after the skip: importing defines the jit functions)
from parallel_lora.kernels import configs as kconfigs  # noqa: E402
from parallel_lora.kernels.dropout_mask import hash_uniform as triton_hash_uniform  # noqa: E402
from parallel_lora.kernels.rank_reduce import split_rows  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

# dtype -> max of |out - ref| / mag (see the module docstring), with the reason.
TOL = {
    # fp32 accumulation (tl.dot runs "ieee", not tf32) and one fp32 rounding: ~1e-7 observed.
    torch.float32: 1e-5,
    # the output's fp16 rounding (2^-11) plus that of the saved S / G feeding the next product.
    torch.float16: 2e-3,
    # the same two bf16 roundings: 2^-9 each on GPU (round to nearest); the interpreter converts
    # fp32 -> bf16 by truncation (up to 2^-7 each).
    torch.bfloat16: 2e-2,
}
DTYPES = list(TOL)

SCALE = 2.0  # alpha / r != 1, so a missing or doubled scale is visible


def rel_err(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor) -> float:
    """max |out - ref| / mag; an element whose terms are all zero must come out exactly zero."""
    if ref.numel() == 0:
        return 0.0
    diff = (out.double() - ref).abs()
    return (diff / mag.clamp_min(1e-300)).max().item()


def assert_matches(name, out, ref, mag, dtype, tol=None) -> None:
    assert out.dtype == dtype, f"{name}: dtype {out.dtype}, expected {dtype}"
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    err = rel_err(out, ref, mag)
    tol = TOL[dtype] if tol is None else tol
    assert err <= tol, f"{name}: error {err:.3e} of the terms' magnitude > {tol:.1e} ({dtype})"


def skip_without_tma() -> None:
    """Skip on a CUDA GPU older than Hopper, which has no TMA (the interpreter emulates it)."""
    if HAS_CUDA and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("no TMA before Hopper")


def make_inputs(M, K, N, r, dtype, bias=True, device=DEVICE):
    """Unit-scale operands so the base and LoRA terms are the same size (neither hides the other)."""
    x = torch.randn(M, K, device=device).to(dtype)
    weight = (torch.randn(N, K, device=device) / max(K, 1) ** 0.5).to(dtype)
    b = torch.randn(N, device=device).to(dtype) if bias else None
    lora_A = (torch.randn(r, K, device=device) / max(K, 1) ** 0.5).to(dtype)
    lora_B = (torch.randn(N, r, device=device) / r**0.5).to(dtype)
    dy = torch.randn(M, N, device=device).to(dtype)
    return x, weight, b, lora_A, lora_B, dy


def _f64(t, absolute=False):
    if t is None:
        return None
    return t.double().abs() if absolute else t.double()


def reference(x, weight, b, lora_A, lora_B, dy, scale, dropout, absolute=False):
    """The eager oracle in fp64: ``(y, S, dx, dA, dB)``; with ``absolute``, the same on ``|inputs|``."""
    args = [_f64(t, absolute) for t in (x, weight, b, lora_A, lora_B, dy)]
    scale = abs(scale) if absolute else scale
    x, weight, b, lora_A, lora_B, dy = args
    y, s_lora = eager.forward(x, weight, b, lora_A, lora_B, scale, dropout)
    dx, dA, dB = eager.backward(dy, x, weight, lora_A, lora_B, s_lora, scale, dropout)
    return y, s_lora, dx, dA, dB


def check_against_eager(x, weight, b, lora_A, lora_B, dy, scale, dropout, tol=None):
    dtype = x.dtype
    y, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, scale, dropout)
    dx, dA, dB = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, scale, dropout)
    ref = reference(x, weight, b, lora_A, lora_B, dy, scale, dropout)
    mag = reference(x, weight, b, lora_A, lora_B, dy, scale, dropout, absolute=True)
    outs = (y, s_lora, dx, dA, dB)
    for name, out, want, m in zip(("y", "S", "dx", "dA", "dB"), outs, ref, mag, strict=True):
        assert_matches(name, out, want, m, dtype, tol)


DROPOUTS = {
    "none": None,
    # k_offset != 0: a row-parallel shard whose first input column is global column 5.
    "pre": Dropout(p=0.3, seed=123_456_789_012, position="pre", k_offset=5),
    # An even offset: each pair of columns is one hash word (an odd one is compiled apart, drop_tile's ODD).
    "pre_even": Dropout(p=0.3, seed=2**50 + 1, position="pre", k_offset=96),
    "post": Dropout(p=0.25, seed=77, position="post"),
}

SHAPES = {
    "multi_tile": (64, 96, 80, 16),  # several tiles along every dim in the interpreter (blocks of 32)
    "m1_odd": (1, 17, 33, 5),
    "tiny_kn_r1": (37, 3, 1, 1),
    "odd_r33": (33, 65, 17, 33),  # r pads to 64: two rank chunks are not needed, but a masked tail is
}


# ---------------------------------------------------------------------------------------------------------
# Forward and backward against the eager oracle.
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("drop", list(DROPOUTS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_and_backward_match_eager(dtype, shape, drop):
    M, K, N, r = SHAPES[shape]
    inputs = make_inputs(M, K, N, r, dtype, bias=(shape != "tiny_kn_r1"))
    check_against_eager(*inputs, SCALE, DROPOUTS[drop])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rank_256_matches_eager(dtype):
    # r = 256 is the largest rank: four BLOCK_R = 64 chunks in the GEMM, a 256-wide rank tile elsewhere.
    inputs = make_inputs(5, 40, 24, 256, dtype)
    check_against_eager(*inputs, SCALE, Dropout(p=0.2, seed=2**40 + 3, position="pre", k_offset=7))


def test_multi_split_reduction_matches_eager_is_deterministic_and_resets_its_counters():
    # M = 130 splits the dA / dB reduction over M into several fp32 partials in the interpreter; the last
    # program of each tile sums them. A counter left non-zero would make the next launch store nothing.
    from parallel_lora.kernels import rank_reduce

    x, weight, b, lora_A, lora_B, dy = make_inputs(130, 40, 40, 8, torch.float32)
    if INTERPRETING:
        assert split_rows(130, 80, x.device)[0] > 1, "the shape no longer exercises the multi-split path"
    drop = Dropout(p=0.3, seed=9, position="pre", k_offset=3)
    check_against_eager(x, weight, b, lora_A, lora_B, dy, SCALE, drop)
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, drop)
    first = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, drop)
    second = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, drop)
    for a, c in zip(first, second, strict=True):
        assert torch.equal(a, c)
    assert rank_reduce._COUNTERS, "the multi-split path did not use the shared workspace"
    for count in rank_reduce._COUNTERS.values():
        assert not count.any(), "arrival counters were left non-zero"


def test_pre_dropout_forward_keeps_the_separate_masked_shrink(monkeypatch):
    # The "pre" mask hashes every element of x: too much compute for the fused forward's spare SMs (GEMM tiles
    # would wait for S), so that mode runs the masked shrink on every SM, then the GEMM.
    from parallel_lora.kernels import lora

    skip_without_tma()
    x, weight, b, lora_A, lora_B, _ = make_inputs(37, 64, 48, 8, torch.bfloat16)
    launched = _count_launches(monkeypatch)
    lora._FORWARD_SITES.clear()
    for mode, expected in (("pre", ["shrink", "gemm_tma"]), ("post", ["shrink_gemm"])):
        kernels.forward(x, weight, b, lora_A, lora_B, SCALE, DROPOUTS[mode])  # binds (on GPU: tunes) the sites
        launched.clear()
        kernels.forward(x, weight, b, lora_A, lora_B, SCALE, DROPOUTS[mode])
        assert launched == expected, mode
    lora._FORWARD_SITES.clear()


@pytest.mark.parametrize("shape", [(37, 64, 48), (64, 96, 80)], ids=["spare_programs", "tiles_claim"])
@pytest.mark.parametrize("drop", ["none", "post"])
def test_fused_shrink_gemm_equals_the_separate_launches_bit_for_bit(monkeypatch, drop, shape):
    # On the TMA path the forward's S and y are one launch. In the interpreter (3 programs, run one after
    # another) a problem of 4 tiles leaves one spare program, which produces every S row block first; one of 6
    # tiles leaves none, so each tile claims and computes its row block's S itself. Either way S and y must be
    # exactly the separate launches' (same tiles, same order), and the launch must leave its queue at zero, its
    # epoch advanced and every flag published for that epoch.
    from parallel_lora.kernels import lora, shrink_gemm

    if not INTERPRETING:
        pytest.skip("the GPU tunes the two paths' tiles separately: the GPU tests compare them with fp64")
    M, K, N = shape
    x, weight, b, lora_A, lora_B, _ = make_inputs(M, K, N, 8, torch.bfloat16)
    dropout = DROPOUTS[drop]
    launched = _count_launches(monkeypatch)
    lora._FORWARD_SITES.clear()
    fused = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, dropout)
    assert launched == ["shrink_gemm"]
    (sync,) = shrink_gemm._SYNC.values()
    epoch = sync[0].item()
    again = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, dropout)
    assert sync[0].item() == epoch + 1 and sync[1:3].tolist() == [0, 0]
    row_blocks = -(-M // kconfigs.INTERP_CONFIGS["shrink_gemm"]["BLOCK_M"])
    assert sync[3 : 3 + row_blocks].tolist() == [2 * epoch + 2] * row_blocks
    lora._FORWARD_SITES.clear()
    monkeypatch.setattr(lora, "_y_takes_fused", lambda *args: False)
    separate = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, dropout)
    assert launched[2:] == ["shrink", "gemm_tma"]
    for name, a, c, d in zip(("y", "S"), fused, again, separate, strict=True):
        assert torch.equal(a, c) and torch.equal(a, d), name
    lora._FORWARD_SITES.clear()


@pytest.mark.parametrize("wanted", [("dA", "dB"), ("dA",), ("dB",)], ids="+".join)
@pytest.mark.parametrize("drop", list(DROPOUTS))
@pytest.mark.parametrize("shape", [(130, 64, 48), (9, 24, 16)], ids=["multi_split", "spare_program"])
def test_fused_dx_and_grads_equal_the_separate_launches_bit_for_bit(monkeypatch, shape, drop, wanted):
    # On the TMA path dx and the adapter gradients share one launch. In the interpreter both paths run the same
    # tiles (GEMM and reductions), so the fused launch must reproduce the separate ones exactly, over several
    # M splits, with either gradient alone, and leave its queue and arrival counters at zero. The second shape
    # has one dx tile for the interpreter's two programs: the other one skips the GEMM (one program runs after
    # the other there, so the first has drained the queue). dB reduced from dy here, as at ranks above
    # shrink_db.MAX_DB_R_PAD (below it, from shrink_db's partials: the next test).
    from parallel_lora.kernels import lora, rank_reduce, shrink_db

    if not INTERPRETING:
        pytest.skip("the GPU tunes the two paths' tiles separately: the GPU tests compare them with fp64")
    monkeypatch.setattr(shrink_db, "MAX_DB_R_PAD", 0)
    lora._BACKWARD_SITES.clear()
    M, K, N = shape
    x, weight, b, lora_A, lora_B, dy = make_inputs(M, K, N, 8, torch.bfloat16)
    if M > 100:
        assert split_rows(M, K + N, x.device)[0] > 1, "the shape no longer exercises the multi-split path"
    dropout = DROPOUTS[drop]
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, dropout)
    needs = {"needs_dA": "dA" in wanted, "needs_dB": "dB" in wanted}
    launched = _count_launches(monkeypatch)
    fused = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, dropout, **needs)
    assert launched == ["shrink", "dx_grads"]
    lora._BACKWARD_SITES.clear()
    monkeypatch.setattr(lora, "_dx_takes_fused", lambda dy, weight: False)
    separate = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, dropout, **needs)
    assert launched[2:] == ["shrink", "gemm_tma", "reduce"]
    for name, a, c in zip(("dx", "dA", "dB"), fused, separate, strict=True):
        assert (a is None) == (c is None) and (a is None or torch.equal(a, c)), name
    for count in rank_reduce._COUNTERS.values():
        assert not count.any(), "the queue or an arrival counter was left non-zero"
    lora._BACKWARD_SITES.clear()


@pytest.mark.parametrize("wanted", [("dA", "dB"), ("dB",)], ids="+".join)
@pytest.mark.parametrize("drop", ["none", "post"])
@pytest.mark.parametrize("r", [5, 16, 20])
def test_backward_takes_g_and_db_partials_from_one_read_of_dy(monkeypatch, r, drop, wanted):
    # Up to shrink_db.MAX_DB_R_PAD the TMA backward launches shrink_db (G and dB's per-row-block partials from one
    # read of dy; several row blocks and column splits here, whose G partials the last arrival sums), then
    # dx_grads, which sums dB's partials on its spare programs instead of reducing dy. The gradients match the
    # path that reduces dy (another summation order: to rounding) and eager, repeat bit for bit, and every
    # counter ends at zero.
    from parallel_lora.kernels import lora, rank_reduce, shrink_db

    if not INTERPRETING:
        pytest.skip("the interpreter's split sizes; the GPU tests compare with fp64")
    M, K, N = 60, 64, 80  # two row blocks, the second part-filled; three column splits
    assert shrink_db.db_blocks(M) > 1 and shrink_db.column_splits(M, N, torch.device("cpu"))[0] > 1
    x, weight, b, lora_A, lora_B, dy = make_inputs(M, K, N, r, torch.bfloat16)
    dropout = DROPOUTS[drop]
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, dropout)
    needs = {"needs_dA": "dA" in wanted, "needs_dB": True}
    launched = _count_launches(monkeypatch)
    lora._BACKWARD_SITES.clear()
    one_read = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, dropout, **needs)
    again = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, dropout, **needs)
    assert launched == ["shrink_db", "dx_grads"] * 2
    monkeypatch.setattr(shrink_db, "MAX_DB_R_PAD", 0)
    lora._BACKWARD_SITES.clear()
    reduced = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, dropout, **needs)
    assert launched[4:] == ["shrink", "dx_grads"]
    ref = reference(x, weight, b, lora_A, lora_B, dy, SCALE, dropout)
    mag = reference(x, weight, b, lora_A, lora_B, dy, SCALE, dropout, absolute=True)
    for i, name in enumerate(("dx", "dA", "dB")):
        a, c, d = one_read[i], again[i], reduced[i]
        assert (a is None) == (name == "dA" and "dA" not in wanted), name
        if a is None:
            continue
        assert torch.equal(a, c), name
        torch.testing.assert_close(a.float(), d.float(), rtol=2e-2, atol=2e-2, msg=name)
        assert_matches(name, a, ref[2 + i], mag[2 + i], torch.bfloat16)
    for count in (*rank_reduce._COUNTERS.values(), *shrink_db._G_COUNTERS.values()):
        assert not count.any(), "a queue or an arrival counter was left non-zero"
    lora._BACKWARD_SITES.clear()


@pytest.mark.parametrize("case", ["pre_dropout", "rank_above_max"])
def test_pre_dropout_and_larger_ranks_reduce_db_from_dy(monkeypatch, case):
    # Under "pre" dropout the masked dA items set the fused launch's tail, so dB's partials would only add
    # shrink_db's cost; dB's partials grow with the rank. Both keep G's plain shrink and reduce dB from dy.
    from parallel_lora.kernels import lora, shrink_db

    skip_without_tma()
    r = shrink_db.MAX_DB_R_PAD + 1 if case == "rank_above_max" else 8
    drop = DROPOUTS["pre"] if case == "pre_dropout" else None
    x, weight, b, lora_A, lora_B, dy = make_inputs(40, 48, 56, r, torch.bfloat16)
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, drop)
    launched = _count_launches(monkeypatch)
    lora._BACKWARD_SITES.clear()
    kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, drop)
    assert launched == ["shrink", "dx_grads"]
    lora._BACKWARD_SITES.clear()


def test_db_partials_are_taken_from_8192_tokens_at_ranks_up_to_32_while_they_stay_small(monkeypatch):
    # The sizes where the GPUs measured a gain (shrink_db.MIN_M_GPU, MAX_DB_R_PAD); the partials, kept with the
    # stream's workspaces, at most MAX_DB_PARTIALS_BYTES. The interpreter takes the path at every size that
    # fits, so that the tests' small problems exercise it.
    from parallel_lora.kernels import shrink_db

    monkeypatch.setattr(shrink_db, "interpreting", lambda: False)
    takes = shrink_db.takes_db_partials
    assert takes(8192, 4096, 16) and takes(8192, 14336, 16) and takes(16384, 14336, 16)
    assert takes(8192, 4096, 32) and takes(8192, 14336, 32) and not takes(16384, 14336, 32)
    assert not takes(4096, 4096, 16) and not takes(2048, 4096, 16) and not takes(8192, 4096, 64)
    assert not takes(65536, 14336, 16) and takes(65536, 4096, 16) and not takes(131072, 4096, 16)
    assert shrink_db.db_rows() == 256 and shrink_db.db_blocks(8192) == 32
    monkeypatch.setattr(shrink_db, "sm_count", lambda index: 132)
    # 32 row blocks times 4 column splits of 1024: one wave of 128 programs on 132 SMs.
    assert shrink_db.column_splits(8192, 4096, torch.device("cuda", 0)) == (4, 1024)
    assert shrink_db.column_splits(8192, 14336, torch.device("cuda", 0)) == (4, 3584)


@pytest.mark.parametrize("wanted", ["dA", "dB"])
@pytest.mark.parametrize("M", [9, 130], ids=["one_split", "multi_split"])
def test_one_adapter_gradient_alone_matches_eager(M, wanted):
    # The fused launch with the other gradient's columns empty (a frozen lora_A or lora_B).
    x, weight, b, lora_A, lora_B, dy = make_inputs(M, 40, 24, 8, torch.float32)
    drop = Dropout(p=0.3, seed=5, position="pre", k_offset=2)
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


# Every kernel spec's name (``KernelSpec.name``): what the op's launches can be.
_LAUNCH_NAMES = ("shrink", "gemm", "gemm_tma", "reduce", "dx_grads", "shrink_gemm", "shrink_db")


def _patch_launches(monkeypatch, fn) -> None:
    """Route every kernel launch (each kernel module imports ``configs.launch`` by name) through ``fn``."""
    for module in kernels.LAUNCH_MODULES:
        monkeypatch.setattr(module, "launch", fn)


def test_launch_modules_name_every_kernel_module():
    # Benchmarks and tests stub or record launches through kernels.LAUNCH_MODULES: a kernel module missing
    # there would run for real under a stub (python_overhead.py timed the interpreter for one that was).
    import pkgutil

    import parallel_lora.kernels as package

    specs = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"parallel_lora.kernels.{info.name}")
        if hasattr(module, "_SPEC"):
            specs.add(module)
    assert specs == set(kernels.LAUNCH_MODULES)
    assert {m._SPEC.name for m in specs} == set(_LAUNCH_NAMES)


def _count_launches(monkeypatch) -> list[str]:
    """Record the kernel of every launch the LoRA kernels make (first launches of a layout and bound ones)."""
    from parallel_lora.kernels import configs

    launched = []
    real = configs.Bound.launch

    def spy(self, tensors, runtime):
        launched.append(self.name)
        return real(self, tensors, runtime)

    monkeypatch.setattr(configs.Bound, "launch", spy)
    return launched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M", [9, 130], ids=["one_split", "multi_split"])
def test_backward_is_at_most_three_launches_two_on_the_tma_path_and_nothing_else(monkeypatch, M, dtype):
    # G, the dx GEMM, and both adapter gradients in one launch (on the TMA path, dx and both gradients in
    # one, after G or G with dB's partials); no torch sum or cast of partials after it.
    from parallel_lora.kernels import shrink_db

    if dtype != torch.float32:
        skip_without_tma()
    x, weight, b, lora_A, lora_B, dy = make_inputs(M, 40, 40, 8, dtype)
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, DROPOUTS["pre"])
    launched = _count_launches(monkeypatch)
    monkeypatch.setattr(torch.Tensor, "sum", lambda *a, **k: pytest.fail("a torch sum ran in backward"))
    kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, DROPOUTS["pre"])
    assert launched == (["shrink", "gemm", "reduce"] if dtype == torch.float32 else ["shrink", "dx_grads"])
    launched.clear()
    kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, None)
    g_launch = "shrink_db" if shrink_db.takes_db_partials(M, 40, 16) else "shrink"
    assert launched == (["shrink", "gemm", "reduce"] if dtype == torch.float32 else [g_launch, "dx_grads"])
    launched.clear()
    kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, None, needs_dx=False)
    assert launched == ["shrink", "reduce"]
    launched.clear()
    kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, None, needs_dx=False, needs_dA=False)
    assert launched == ["reduce"]


def test_a_grown_workspace_keeps_the_buffer_it_replaces_alive():
    # A CUDA graph captured while the smaller buffer was current still uses its address: freeing it would let
    # the caching allocator give that memory to another tensor, which each replay would then overwrite.
    import weakref

    from parallel_lora.kernels import _interp

    cache, dev = {}, torch.device("cpu")
    small = _interp.stream_buffer(cache, dev, 10, torch.int32, zeroed=True)
    assert _interp.stream_buffer(cache, dev, 1000, torch.int32, zeroed=True) is small  # within its size
    alive = weakref.ref(small)
    del small
    big = _interp.stream_buffer(cache, dev, 4096, torch.int32, zeroed=True)
    assert big.numel() >= 4096 and not big.any() and cache[(dev, 0)] is big
    assert alive() is not None and any(t is alive() for t in _interp._RETIRED)


def test_split_on_gpu_is_a_function_of_the_shape_and_fills_the_device(monkeypatch):
    # On GPU the M reduction splits until the adapter gradients' column tiles (128 wide) times the splits
    # reach the program target; each split is a whole number of the largest BLOCK_M and the splits cover M.
    from parallel_lora.kernels import rank_reduce

    monkeypatch.setattr(rank_reduce, "interpreting", lambda: False)
    monkeypatch.setattr(rank_reduce, "_num_programs_target", lambda device: 264)
    assert rank_reduce.split_rows(2048, 8192, None) == (4, 512)
    assert rank_reduce.split_rows(100, 8192, None) == (1, 128)
    assert rank_reduce.split_rows(8192, 4096 + 14336, None) == (1, 8192)  # 144 tiles already fill it
    # The fused backward caps an item's rows (its tail after the GEMM); a cap above the split changes nothing.
    assert rank_reduce.split_rows(8192, 4096 + 14336, None, max_rows=2048) == (4, 2048)
    assert rank_reduce.split_rows(2048, 8192, None, max_rows=2048) == (4, 512)
    for M, F in ((8192, 8192), (2048, 4096), (16384, 2048), (1000, 1024)):
        split, rows = rank_reduce.split_rows(M, F, None)
        assert split > 1 and rows % kconfigs.REDUCE_M_ALIGN_GPU == 0 and (split - 1) * rows < M <= split * rows
        assert split * (F // 128) <= 264


def test_fused_backward_splits_long_reductions_into_short_items(monkeypatch):
    # Items no longer than dx_grads.ITEM_ROWS (here 32 rows, so 130 rows take 5 splits where the program
    # target alone gives 2): the gradients still match the separate launches (another summation order, so
    # to rounding) and repeat bit for bit, and the queue and arrival counters end at zero.
    from parallel_lora.kernels import dx_grads, lora, rank_reduce

    if not INTERPRETING:
        pytest.skip("the interpreter's split sizes; the GPU tests cover the GPU's")
    monkeypatch.setattr(dx_grads, "ITEM_ROWS", 32)
    lora._BACKWARD_SITES.clear()  # a site bound by an earlier test would skip the split
    seen = []
    real_split = dx_grads.split_rows
    monkeypatch.setattr(dx_grads, "split_rows", lambda *a, **k: seen.append(real_split(*a, **k)) or seen[-1])
    x, weight, b, lora_A, lora_B, dy = make_inputs(130, 64, 48, 8, torch.bfloat16)
    assert split_rows(130, 64 + 48, x.device)[0] == 2
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, None)
    fused = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, None)
    assert seen == [(5, 32)]
    again = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, None)
    lora._BACKWARD_SITES.clear()
    monkeypatch.setattr(lora, "_dx_takes_fused", lambda dy, weight: False)
    separate = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, None)
    for name, a, c, d in zip(("dx", "dA", "dB"), fused, again, separate, strict=True):
        assert torch.equal(a, c), name
        torch.testing.assert_close(a.float(), d.float(), rtol=1e-2, atol=1e-2, msg=name)
    for count in rank_reduce._COUNTERS.values():
        assert not count.any(), "the queue or an arrival counter was left non-zero"
    lora._BACKWARD_SITES.clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_contiguous_inputs_match_eager(dtype):
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
    drop = Dropout(p=0.3, seed=4, position="pre", k_offset=11)
    check_against_eager(x_nc, weight_nc, b_nc, lora_A_nc, lora_B_nc, dy_nc, SCALE, drop)


def _gemm_paths(monkeypatch) -> list[str]:
    """Record the GEMMs that take the TMA path: ``lora_gemm`` sending a call to the TMA kernel ("tma"), the
    forward's GEMM fused with the shrink ("fused_y") and the backward's dx GEMM fused with the adapter gradients
    ("fused_dx"); the fused launches are TMA only."""
    from parallel_lora.kernels import gemm, lora

    taken = []

    def spy(module, name, label):
        real = getattr(module, name)

        def recorded(*args, **kwargs):
            taken.append(label)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)

    spy(gemm, "lora_gemm_tma", "tma")
    spy(lora, "lora_shrink_gemm", "fused_y")
    spy(lora, "lora_dx_and_grads", "fused_dx")
    return taken


@pytest.mark.parametrize(
    "dtype, K, N, tma",
    [
        (torch.bfloat16, 96, 80, True),  # 16-bit, rows a multiple of 16 bytes: TMA for y and dx
        (torch.float16, 96, 80, True),
        (torch.bfloat16, 97, 80, False),  # x and W rows of 194 bytes cannot be described
        (torch.bfloat16, 96, 81, False),  # y and dy rows of 162 bytes
        (torch.float32, 96, 80, False),  # fp32 stays on the pointer kernel
    ],
)
def test_gemm_takes_tma_path_exactly_for_describable_16bit_operands(monkeypatch, dtype, K, N, tma):
    skip_without_tma()
    taken = _gemm_paths(monkeypatch)
    inputs = make_inputs(70, K, N, 16, dtype)  # M = 70: a tail of rows in every tile size
    check_against_eager(*inputs, SCALE, DROPOUTS["post"])  # "pre" keeps y's separate launches
    assert taken == (["fused_y", "fused_dx"] if tma else [])


def _misaligned_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values at an address 2 bytes past a 16-byte boundary: no TMA descriptor can read it."""
    flat = torch.empty(t.numel() + 1, device=t.device, dtype=t.dtype)[1:]
    return flat.view(t.shape).copy_(t)


@pytest.mark.parametrize("r", [8, 16])  # r = 8: the rank tile is wider than S's rows (the descriptor zero-fills)
@pytest.mark.parametrize("orient", ["y", "dx"])
def test_tma_gemm_gives_the_same_bits_with_rank_tiles_through_tma_or_pointers(orient, r):
    # With TMA rank tiles the loops are flattened (``gemm_tma.gemm_tiles``); S or G at a misaligned address
    # keeps the nested loops and pointer loads. The accumulation order is the same, so are the bits.
    skip_without_tma()
    from parallel_lora.kernels.gemm import lora_gemm
    from parallel_lora.kernels.gemm_tma import rank_tma

    x, weight, b, lora_A, lora_B, dy = make_inputs(150, 96, 80, r, torch.bfloat16)
    s = torch.randn(150, r, device=DEVICE).to(torch.bfloat16)
    act, w, bias, f = (x, weight.t(), b, lora_B.t()) if orient == "y" else (dy, weight, None, lora_A)
    slow = _misaligned_copy(s)
    assert rank_tma(s, f, False) == {"RANK_TMA": True, "F_T": orient == "y"}
    assert rank_tma(slow, f, False) == {"RANK_TMA": False, "F_T": False}
    out = lora_gemm(act, w, bias, s, f)
    assert torch.equal(out, lora_gemm(act, w, bias, slow, f))
    ref = act.double() @ w.double() + s.double() @ f.double() + (0 if bias is None else bias.double())
    assert rel_err(out, ref, act.double().abs() @ w.double().abs() + 1) < TOL[torch.bfloat16]


@pytest.mark.parametrize(
    "r, dtype, lora_drop, expected",
    [
        (16, torch.bfloat16, False, True),
        (8, torch.float16, False, True),  # rows of 16 bytes: the least a descriptor takes
        (64, torch.bfloat16, False, True),  # one MAX_BLOCK_R chunk
        (4, torch.bfloat16, False, False),  # rows of 8 bytes
        (128, torch.bfloat16, False, False),  # two chunks would each take shared memory of their own
        (16, torch.float32, False, False),  # TMA here is for 16-bit operands
        (16, torch.bfloat16, True, False),  # "pre" dropout: the masked rank term goes first, loops nested
    ],
)
def test_rank_tiles_go_through_tma_only_where_a_descriptor_reads_them(r, dtype, lora_drop, expected):
    skip_without_tma()
    from parallel_lora.kernels.gemm_tma import rank_tma

    s = torch.zeros(64, r, device=DEVICE, dtype=dtype)
    lora_A = torch.zeros(r, 96, device=DEVICE, dtype=dtype)
    lora_B = torch.zeros(80, r, device=DEVICE, dtype=dtype)
    assert rank_tma(s, lora_A, lora_drop) == {"RANK_TMA": expected, "F_T": False}  # dx: A [r, K] read as is
    assert rank_tma(s, lora_B.t(), lora_drop) == {"RANK_TMA": expected, "F_T": expected}  # y: B^T via B's rows


def test_m_zero_returns_empty_outputs_without_launch(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched for M = 0")

    _patch_launches(monkeypatch, no_launch)
    x, weight, b, lora_A, lora_B, dy = make_inputs(0, 16, 8, 4, torch.bfloat16)
    y, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, DROPOUTS["pre"])
    assert y.shape == (0, 8) and s_lora.shape == (0, 4) and y.dtype == s_lora.dtype == torch.bfloat16
    dx, dA, dB = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, DROPOUTS["pre"])
    assert dx.shape == (0, 16)
    # Gradients of a sum over zero rows are zeros, not uninitialized memory.
    assert torch.equal(dA, torch.zeros(4, 16, dtype=torch.bfloat16, device=DEVICE))
    assert torch.equal(dB, torch.zeros(8, 4, dtype=torch.bfloat16, device=DEVICE))


def test_needs_flags_skip_gradients():
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


def test_wrong_seed_fails_the_check():
    # The comparison is not vacuous: the same call with another seed is far outside the tolerance.
    x, weight, b, lora_A, lora_B, dy = make_inputs(32, 48, 16, 8, torch.float32)
    drop = Dropout(p=0.5, seed=1, position="pre")
    y, _ = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, Dropout(p=0.5, seed=2, position="pre"))
    y_ref = reference(x, weight, b, lora_A, lora_B, dy, SCALE, drop)[0]
    y_mag = reference(x, weight, b, lora_A, lora_B, dy, SCALE, drop, absolute=True)[0]
    assert rel_err(y, y_ref, y_mag) > 100 * TOL[torch.float32]


# ---------------------------------------------------------------------------------------------------------
# Dropout masks.
# ---------------------------------------------------------------------------------------------------------

SEEDS = [0, 1, 2**31 + 7, 2**32 - 1, 2**32, 2**32 + 1, 2**62 - 1, 2**64 - 1, 987_654_321_987]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rows, cols, offset", [(45, 67, 1000), (33, 5, 0), (1, 97, 2**31 - 50)])
def test_triton_hash_uniform_is_bit_exact_with_torch(seed, rows, cols, offset):
    u = triton_hash_uniform(seed, rows, cols, offset, DEVICE)
    m = torch.arange(rows, device=DEVICE).unsqueeze(1)
    k = torch.arange(offset, offset + cols, device=DEVICE).unsqueeze(0)
    ref = torch_hash_uniform(seed, m, k)
    assert ref.shape == (rows, cols) and ref.dtype == torch.float32
    assert torch.equal(u, ref)
    assert ((u >= 0) & (u < 1)).all() and torch.equal(u * 2**16, (u * 2**16).floor())


@pytest.mark.parametrize("position,k_offset", [("pre", 0), ("pre", 37), ("post", 0), ("post", 37)])
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("seed", [3, 2**33 + 5])
def test_triton_mask_equals_keep_mask(position, k_offset, p, seed):
    drop = Dropout(p=p, seed=seed, position=position, k_offset=k_offset)
    mask = kernels.dropout_keep_mask(drop, 50, 70, DEVICE)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, keep_mask(drop, 50, 70, DEVICE))
    assert abs(mask.float().mean().item() - (1 - p)) < 0.05


def test_triton_mask_keeps_exactly_the_uniforms_at_or_above_p():
    # The kernels test an integer threshold on each 16-bit half of the hash, not u >= p: at p equal to a drawn
    # uniform u (a multiple of 2**-16) that element is kept, in either half of its word, and at p half a step
    # above it (exact in fp32 below 0.5) it is dropped; at the largest p (1 - 2**-16) the shifted threshold must
    # not overflow (only v = 2**16 - 1 is kept). Odd widths and offsets pair columns across tiles and words.
    u = triton_hash_uniform(5, 64, 64, 0, DEVICE)
    low = u[:, 0::2]
    high = u[:, 1::2]
    picks = [*low[low < 0.5][:2].tolist(), *high[high < 0.5][:2].tolist()]
    for p in (*picks, *(v + 2**-17 for v in picks), 0.1, 2**-16, 1 - 2**-15, 1 - 2**-16, 0.0):
        for cols, offset in ((64, 0), (37, 5)):
            mask = kernels.dropout_keep_mask(Dropout(p=p, seed=5, position="pre", k_offset=offset), 64, cols, DEVICE)
            want = triton_hash_uniform(5, 64, cols, offset, DEVICE) >= torch.tensor(p, dtype=torch.float32)
            assert torch.equal(mask, want), (p, offset)
            if p == picks[0]:
                assert want.any() and not want.all()


def test_shard_mask_is_a_slice_of_the_full_mask():
    full = kernels.dropout_keep_mask(Dropout(p=0.3, seed=8, position="pre"), 20, 96, DEVICE)
    shard = kernels.dropout_keep_mask(Dropout(p=0.3, seed=8, position="pre", k_offset=48), 20, 48, DEVICE)
    assert torch.equal(shard, full[:, 48:])


def test_different_seeds_give_different_masks():
    masks = [kernels.dropout_keep_mask(Dropout(p=0.5, seed=s), 32, 32, DEVICE) for s in (1, 2, 2**32 + 1)]
    for i in range(len(masks)):
        for j in range(i):
            assert (masks[i] != masks[j]).float().mean() > 0.3


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
        "int_dtype": ((x.int(), w.int(), None, A.int(), B.int(), 1.0, None), "float32, float16 or bfloat16"),
        "scale_nan": ((x, w, b, A, B, float("nan"), None), "scale"),
        "p_one": ((x, w, b, A, B, 1.0, Dropout(p=1.0, seed=0)), "dropout.p"),
        # Below 1, but its 16-bit keep threshold (2**16) would not fit the mask's uniforms.
        "p_past_16_bits": ((x, w, b, A, B, 1.0, Dropout(p=1 - 2**-16, seed=0)), r"1 - 2\*\*-16\)"),
        "position": ((x, w, b, A, B, 1.0, Dropout(p=0.1, seed=0, position="mid")), "dropout.position"),
    }


@pytest.mark.parametrize("case", list(_bad_forward_cases()))
def test_bad_forward_input_raises_value_error(case):
    args, message = _bad_forward_cases()[case]
    with pytest.raises(ValueError, match=message):
        kernels.forward(*args)


def test_bad_backward_input_raises_value_error():
    x, w, _, A, B, dy = make_inputs(4, 8, 6, 2, torch.float32)
    s_lora = torch.randn(4, 2, device=DEVICE)
    with pytest.raises(ValueError, match="dy must have shape"):
        kernels.backward(dy[:, :5], x, w, A, B, s_lora, 1.0, None)
    with pytest.raises(ValueError, match="s_lora must have shape"):
        kernels.backward(dy, x, w, A, B, s_lora[:3], 1.0, None)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.backward(dy.half(), x, w, A, B, s_lora, 1.0, None)


# ---------------------------------------------------------------------------------------------------------
# GPU configs: every kernel keeps a config that fits a ~100 KB shared-memory GPU at every rank and dtype.
# ---------------------------------------------------------------------------------------------------------

_SPECS = {
    "gemm": ("parallel_lora.kernels.gemm", {"M": 8192, "N_OUT": 4096, "K_RED": 4096}),
    "gemm_tma": ("parallel_lora.kernels.gemm_tma", {"M": 8192, "N_OUT": 4096, "K_RED": 4096}),
    "shrink": ("parallel_lora.kernels.shrink", {"M": 8192, "K": 4096}),
    "reduce": ("parallel_lora.kernels.rank_reduce", {"M": 8192, "F_A": 4096, "F_B": 4096}),
    "dx_grads": ("parallel_lora.kernels.dx_grads", {"M": 8192, "N_OUT": 4096, "K_RED": 4096, "F_A": 4096, "F_B": 4096}),
    "shrink_gemm": ("parallel_lora.kernels.shrink_gemm", {"M": 8192, "N_OUT": 4096, "K_RED": 4096}),
    "shrink_db": ("parallel_lora.kernels.shrink_db", {"M": 8192, "N": 4096}),
}


def _consts(kernel, r_pad, monkeypatch) -> dict:
    """The rank-derived constexprs a launch of ``kernel`` passes at this rank on a GPU."""
    consts = {"R_PAD": r_pad, "BLOCK_R": min(r_pad, 64)}
    if kernel == "dx_grads":
        from parallel_lora.kernels import dx_grads

        monkeypatch.setattr(dx_grads, "interpreting", lambda: False)
        consts.update(zip(("RED_BLOCK_M", "RED_STAGES"), dx_grads.red_tiles(r_pad), strict=True))
    if kernel == "shrink":
        consts["DROP_PRE"] = True  # the larger estimate: the "pre"-masked x tile staged for the tensor cores
    if kernel == "shrink_gemm":
        from parallel_lora.kernels import shrink_gemm

        consts["S_STAGES"] = shrink_gemm.S_STAGES
    if kernel == "shrink_db":
        from parallel_lora.kernels import shrink_db

        monkeypatch.setattr(shrink_db, "interpreting", lambda: False)
        consts["ROWS"] = shrink_db.db_rows()
    return consts


def _spec(kernel):
    import importlib

    module, sizes = _SPECS[kernel]
    return importlib.import_module(module)._SPEC, sizes


@pytest.mark.parametrize("smem_limit", [101_376, 232_448], ids=["100KB", "H200"])
@pytest.mark.parametrize("r_pad", [16, 32, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernel", list(_SPECS))
def test_pruned_configs_fit_shared_memory(monkeypatch, kernel, dtype, r_pad, smem_limit):
    from parallel_lora.kernels import shrink_db

    if kernel in ("gemm_tma", "dx_grads", "shrink_gemm") and dtype == torch.float32:
        pytest.skip("the TMA GEMM takes 16-bit operands only (fp32 goes to the pointer kernel)")
    if kernel == "shrink_gemm" and r_pad > 64:
        pytest.skip("ranks above 64 keep the separate shrink (shrink_gemm.MAX_FUSED_R_PAD)")
    if kernel == "shrink_db" and (r_pad > shrink_db.MAX_DB_R_PAD or dtype == torch.float32):
        pytest.skip("shrink_db runs before the fused dx launch (16-bit), at ranks up to shrink_db.MAX_DB_R_PAD")
    spec, sizes = _spec(kernel)
    consts = _consts(kernel, r_pad, monkeypatch)
    nargs = {spec.dtype_arg: torch.empty(1, dtype=dtype), "R": r_pad, **sizes}
    kept = kconfigs.prune(spec, spec.configs(), nargs, smem_limit=smem_limit, **consts)
    assert kept
    elem = torch.empty(0, dtype=dtype).element_size()
    for c in kept:
        assert spec.smem(c.kwargs, c.num_stages, elem, {**nargs, **consts}) <= smem_limit, c


def test_smem_estimates_bound_what_the_installed_triton_compiles_for_hopper():
    # Pruning trusts the estimates: one below the compiled size lets a config through that a ~100 KB part cannot
    # launch. Triton 3.8 stages the "pre"-masked x tile of the shrink in shared memory, where 3.6 (the device's)
    # and 3.9 feed it from registers; only compiling with the installed Triton shows it. The quick launches here, for
    # sm_90a on the CPU (the fused GEMM launches take minutes: `python benchmarks/compile_check.py`).
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas")
    root = Path(__file__).resolve().parents[1]
    launches = "shrink_S,shrink_S_drop,shrink_G,reduce_drop,shrink_db,gemm_y"
    out = subprocess.run(
        [sys.executable, "benchmarks/compile_check.py", "--launches", launches],
        cwd=root, capture_output=True, text=True, timeout=600, check=True,
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},  # compiled, not interpreted
    ).stdout  # fmt: skip
    compiled = [line.split()[0] for line in out.splitlines()[2:] if not line.startswith("CHECK")]
    assert set(compiled) == set(launches.split(",")), out
    assert not [line for line in out.splitlines() if line.startswith("CHECK") and "spills" not in line], out


@pytest.mark.parametrize("kernel", list(_SPECS))
def test_small_problems_take_one_config_and_large_ones_autotune(monkeypatch, kernel):
    spec, sizes = _spec(kernel)
    consts = _consts(kernel, 16, monkeypatch)
    large = {spec.dtype_arg: torch.empty(1, dtype=torch.bfloat16), "R": 16, **sizes}
    small = {**large, **{name: 64 for name in sizes}}
    assert len(kconfigs.prune(spec, spec.configs(), small, smem_limit=232_448, **consts)) == 1
    assert len(kconfigs.prune(spec, spec.configs(), large, smem_limit=232_448, **consts)) > 1


def test_launch_sizes_bucket_the_token_count_and_keep_the_layer_sizes():
    # Autotuned configs and compiled kernels are shared by the Ms of one power-of-two bucket; K, N and r are
    # a layer's own and stay exact.
    from parallel_lora.kernels import shrink

    spec, kernel = shrink._SPEC, shrink._lora_shrink_kernel

    def sizes(M, K, R):
        args = [0] * len(kernel.arg_names)
        for name, v in (("M", M), ("K", K), ("R", R)):
            args[kernel.arg_names.index(name)] = v
        return kconfigs.bucketed_sizes(spec, kernel, tuple(args))

    assert sizes(3000, 4096, 16) == sizes(2049, 4096, 16) == sizes(4096, 4096, 16) == (4096, 4096, 16)
    assert sizes(4097, 4096, 16) == (8192, 4096, 16)
    assert sizes(3000, 4095, 16) != sizes(3000, 4096, 16) and sizes(3000, 4096, 8) != sizes(3000, 4096, 16)
    with pytest.raises(ValueError, match="start with the token count M"):
        kconfigs.KernelSpec("x", spec.configs, ("K", "M"), spec.smem, spec.fits, spec.work, "x_ptr")


def test_each_constexpr_variant_of_a_kernel_tunes_its_own_config():
    # A dx GEMM with the "pre" mask (more registers) must not reuse the config tuned, and pruned for shared
    # memory, for the plain dx GEMM of the same sizes (Triton's autotuner keyed its cache on sizes and dtypes
    # only): the constexprs are part of the tuned config's key.
    from parallel_lora.kernels import gemm

    spec, kernel = gemm._SPEC, gemm._lora_gemm_kernel
    args = [torch.empty(1, dtype=torch.bfloat16)] + [64] * (len(kernel.arg_names) - 1)
    plain = {"HAS_BIAS": False, "LORA_DROP": False, "BLOCK_R": 16}
    masked = {**plain, "LORA_DROP": True}
    key = kconfigs.best_key(spec, kernel, tuple(args), plain)
    assert kconfigs.best_key(spec, kernel, tuple(args), dict(plain)) == key
    assert kconfigs.best_key(spec, kernel, tuple(args), masked) != key
    half = [torch.empty(1, dtype=torch.float16)] + args[1:]
    assert kconfigs.best_key(spec, kernel, tuple(half), plain) != key


def test_tuning_inside_cuda_graph_capture_says_to_run_a_step_eagerly_first(monkeypatch):
    # Timing candidates needs synchronization, which a capture forbids: a clear error, not a CUDA one.
    from parallel_lora.kernels import gemm

    spec, kernel = gemm._SPEC, gemm._lora_gemm_kernel
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    two = spec.configs()[:2]
    monkeypatch.setattr(kconfigs, "prune", lambda *args, **kwargs: two)
    args = (torch.empty(1, dtype=torch.bfloat16),) + (64,) * (len(kernel.arg_names) - 1)
    with pytest.raises(RuntimeError, match="cannot happen inside CUDA graph capture. Run one step eagerly"):
        kconfigs.tune(spec, kernel, (1,), args, {})
    monkeypatch.setattr(kconfigs, "prune", lambda *args, **kwargs: two[:1])
    assert kconfigs.tune(spec, kernel, (1,), args, {}) is two[0], "one candidate needs no timing"


def test_tuning_takes_the_lowest_median_over_rounds_each_led_by_another_candidate():
    # Candidate 1 is the fastest but for one slow round; candidate 2 is fast once (timed first on a cool GPU).
    samples = {0: [10.0] * 5, 1: [5.0, 5.0, 50.0, 5.0, 5.0], 2: [1.0, 9.0, 9.0, 9.0, 9.0]}
    order = []

    def time_one(i):
        order.append(i)
        return samples[i][sum(o == i for o in order) - 1]

    assert kconfigs.fastest(3, time_one, rounds=5) == 1
    assert [order[3 * k] for k in range(5)] == [0, 1, 2, 0, 1], "each round must start at another candidate"
    assert sorted(order) == [0] * 5 + [1] * 5 + [2] * 5
    assert kconfigs.fastest(2, lambda i: 1.0, rounds=3) == 0, "ties go to the first (listed) candidate"


def _layouts(M, K, N, r, dtype, bias):
    """One problem under several operand layouts: transposed storage (of all, of the adapters, of dy alone), and
    rows shifted off 16-byte alignment."""
    x, weight, b, lora_A, lora_B, dy = make_inputs(M, K, N, r, dtype, bias=bias)

    def shifted(t):  # same values, storage one element further on: its address is no longer 16-byte aligned
        return torch.cat([t.new_zeros(1), t.flatten()])[1:].view_as(t)

    return b, [
        (x, weight, lora_A, lora_B, dy),
        (x.t().contiguous().t(), weight.t().contiguous().t(), lora_A, lora_B, dy.t().contiguous().t()),
        (x, weight, lora_A.t().contiguous().t(), lora_B.t().contiguous().t(), dy),
        (x, weight, lora_A, lora_B, dy.t().contiguous().t()),
        (shifted(x), weight, lora_A, lora_B, shifted(dy)),
    ]


def test_a_launch_signature_fixes_every_argument_but_addresses_and_runtime_scalars(monkeypatch):
    # On GPU a signature's first launch binds its compiled kernel, grid and size/stride arguments, and every
    # later launch with an equal signature reuses them: two calls whose signatures match but whose build()
    # differs would silently run with another call's strides. Record both over many operand layouts.
    from parallel_lora.kernels import configs

    seen: dict[tuple, tuple] = {}

    def record(spec, kernel, signature, tensors, runtime, build):
        static, grid, consts = build()
        meta = {**consts, **configs.INTERP_CONFIGS[spec.name]}
        aligned = tuple(t.data_ptr() % 16 == 0 for t in tensors)
        launch = (static, grid(meta), tuple(sorted(consts.items())), tuple(t.dtype for t in tensors))
        assert seen.setdefault((spec.name, signature, aligned), launch) == launch, (spec.name, signature)

    _patch_launches(monkeypatch, record)
    for M, K, N, r in [(40, 48, 56, 8), (41, 48, 56, 8), (40, 56, 48, 8), (40, 48, 56, 16), (1, 48, 56, 8)]:
        for dtype in (torch.float32, torch.bfloat16):
            for bias in (True, False):
                b, layouts = _layouts(M, K, N, r, dtype, bias)
                for xi, wi, ai, bi, dyi in layouts:
                    for drop in DROPOUTS.values():
                        _, s_lora = kernels.forward(xi, wi, b, ai, bi, SCALE, drop)
                        for needs in ((True, True, True), (False, True, True), (True, False, False)):
                            kernels.backward(dyi, xi, wi, ai, bi, s_lora, SCALE, drop, *needs)
    assert {name for name, *_ in seen} == set(_LAUNCH_NAMES)
    assert len(seen) > 100


def test_an_op_layout_fixes_the_signature_of_every_launch_it_makes(monkeypatch):
    # kernels.forward / backward bind their launch sites to the op's key (every operand's layout, the dropout
    # position, the wanted grads) and skip the wrappers' own signatures at later calls: two calls with equal
    # keys whose wrappers would launch differently would run one with the other's strides. Record, per key,
    # what the wrappers launch with the sites always empty.
    from parallel_lora.kernels import lora

    launched: list[tuple] = []

    def record(spec, kernel, signature, tensors, runtime, build):
        launched.append((spec.name, signature, tuple(t.data_ptr() % 16 == 0 for t in tensors), build()[0]))

    _patch_launches(monkeypatch, record)
    seen: dict[tuple, list] = {}

    def check(key, op, *args):
        lora._FORWARD_SITES.clear()
        lora._BACKWARD_SITES.clear()
        launched.clear()
        out = op(*args)
        assert seen.setdefault(key, list(launched)) == launched, key
        return out

    for M, K, N, r in [(40, 48, 56, 8), (41, 48, 56, 8), (40, 56, 48, 16), (1, 48, 56, 8)]:
        for dtype in (torch.float32, torch.bfloat16):
            for bias in (True, False):
                b, layouts = _layouts(M, K, N, r, dtype, bias)
                for x, weight, lora_A, lora_B, dy in layouts:
                    for drop in DROPOUTS.values():
                        mask = lora.mask_key(drop)
                        key = lora.forward_key(x, weight, b, lora_A, lora_B, mask)
                        _, s_lora = check(key, kernels.forward, x, weight, b, lora_A, lora_B, SCALE, drop)
                        for needs in ((True, True, True), (False, True, True), (True, False, False)):
                            key = lora.backward_key(dy, x, weight, lora_A, lora_B, s_lora, mask, *needs)
                            check(key, kernels.backward, dy, x, weight, lora_A, lora_B, s_lora, SCALE, drop, *needs)
    names = {name for launches in seen.values() for name, *_ in launches}
    assert names == set(_LAUNCH_NAMES)
    assert len(seen) > 100


def test_bound_launch_sites_give_the_first_calls_results_bit_for_bit(monkeypatch):
    # The second call of a layout launches the kernels bound at its first call (no wrapper signature, no
    # checks); it must compute exactly what the first did, with new values in the same layout, and a new
    # layout must not reuse another's sites.
    from parallel_lora.kernels import configs, lora

    lora._FORWARD_SITES.clear()
    lora._BACKWARD_SITES.clear()
    slow = []
    real = configs.launch

    def spy(*args):
        slow.append(args[0].name)
        return real(*args)

    _patch_launches(monkeypatch, spy)
    for dtype in (torch.float32, torch.bfloat16):
        b, layouts = _layouts(37, 48, 40, 8, dtype, bias=True)
        for x, weight, lora_A, lora_B, dy in layouts:
            for drop in DROPOUTS.values():
                first = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, drop)
                first_bwd = kernels.backward(dy, x, weight, lora_A, lora_B, first[1], SCALE, drop)
                slow.clear()
                again = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, drop)
                again_bwd = kernels.backward(dy, x, weight, lora_A, lora_B, again[1], SCALE, drop)
                assert slow == [], "a layout seen before went through the wrappers' first-launch path"
                for a, c in zip((*first, *first_bwd), (*again, *again_bwd), strict=True):
                    assert torch.equal(a, c)
                # New values, same layout: bound sites, results of the new values.
                with torch.no_grad():
                    x.mul_(0.5)
                y, _ = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, drop)
                ref = reference(x, weight, b, lora_A, lora_B, dy, SCALE, drop)
                mag = reference(x, weight, b, lora_A, lora_B, dy, SCALE, drop, absolute=True)
                assert_matches("y", y, ref[0], mag[0], dtype)
                with torch.no_grad():
                    x.mul_(2.0)


def test_a_bound_layout_still_checks_scale_and_dropout():
    x, weight, b, lora_A, lora_B, _ = make_inputs(8, 16, 8, 4, torch.bfloat16)
    kernels.forward(x, weight, b, lora_A, lora_B, SCALE, None)
    with pytest.raises(ValueError, match="scale must be a finite float"):
        kernels.forward(x, weight, b, lora_A, lora_B, float("nan"), None)
    with pytest.raises(ValueError, match="dropout must be a parallel_lora.dropout.Dropout"):
        kernels.forward(x, weight, b, lora_A, lora_B, SCALE, 0.1)
    with pytest.raises(ValueError, match="x must be a 2-D tensor"):
        kernels.forward(None, weight, b, lora_A, lora_B, SCALE, None)


# ---------------------------------------------------------------------------------------------------------
# GPU: real shapes (skipped without CUDA).
# ---------------------------------------------------------------------------------------------------------

# GPU rounds fp32 -> bf16 to nearest (two roundings of 2^-9); fp32 sums up to 4096 terms.
GPU_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 8e-3}


@gpu
@needs_cuda
@pytest.mark.parametrize("position", ["pre", "post", None])
@pytest.mark.parametrize("N", [4096, 14336], ids=["attn", "mlp_up"])
def test_gpu_bf16_llama_shape_matches_fp64(position, N):
    # mlp_up: 144 adapter-gradient column tiles, whose M reductions the fused backward splits into
    # dx_grads.ITEM_ROWS chunks (the program target alone would not split them).
    torch.manual_seed(0)
    inputs = make_inputs(8192, 4096, N, 16, torch.bfloat16, device="cuda")
    drop = None if position is None else Dropout(p=0.1, seed=2**45 + 17, position=position, k_offset=4096)
    check_against_eager(*inputs, SCALE, drop, tol=GPU_TOL[torch.bfloat16])


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape",
    [
        (1, 4096, 4096, 16),
        (1000, 1001, 999, 5),  # unaligned rows: the pointer GEMM
        (1000, 1024, 1016, 5),  # aligned rows with M / N tails: the TMA GEMM on Hopper
        (333, 257, 129, 256),
        (333, 264, 136, 256),  # TMA with four rank chunks in the epilogue
        (77, 33, 65, 1),
    ],
)
def test_gpu_odd_shapes_match_fp64(dtype, shape):
    torch.manual_seed(0)
    inputs = make_inputs(*shape, dtype, device="cuda")
    check_against_eager(
        *inputs, SCALE, Dropout(p=0.1, seed=5, position="pre", k_offset=3), tol=GPU_TOL[dtype]
    )
    check_against_eager(*inputs, SCALE, Dropout(p=0.1, seed=5, position="post"), tol=GPU_TOL[dtype])


@gpu
@needs_cuda
@pytest.mark.parametrize("drop", ["none", "post"])
@pytest.mark.parametrize("r", [5, 16, 20])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_backward_with_db_partials_matches_fp64_and_repeats_exactly(monkeypatch, dtype, r, drop):
    # From 8192 tokens the Hopper backward takes dB's partial sums from G's launch (shrink_db). A last row block
    # part-filled (8229 rows), a column split ending off the 128 alignment (N = 520), rank tails (r = 5 in a 16-wide
    # rank tile, r = 20 in a 32-wide one).
    from parallel_lora.kernels import lora

    skip_without_tma()
    torch.manual_seed(0)
    inputs = make_inputs(8229, 1024, 520, r, dtype, device="cuda")
    lora._BACKWARD_SITES.clear()
    check_against_eager(*inputs, SCALE, DROPOUTS[drop], tol=GPU_TOL[dtype])
    x, weight, b, lora_A, lora_B, dy = inputs
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, DROPOUTS[drop])
    launched = _count_launches(monkeypatch)  # sees bound launches only: the layout's first call went before
    runs = [kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, DROPOUTS[drop]) for _ in range(2)]
    assert launched == ["shrink_db", "dx_grads"] * 2
    assert all(torch.equal(a, c) for a, c in zip(*runs, strict=True))


@gpu
@needs_cuda
def test_gpu_backward_is_bitwise_deterministic_and_masks_match():
    torch.manual_seed(0)
    x, weight, b, lora_A, lora_B, dy = make_inputs(4096, 1024, 2048, 16, torch.bfloat16, device="cuda")
    drop = Dropout(p=0.1, seed=11, position="pre", k_offset=1024)
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, drop)
    first = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, drop)
    second = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, drop)
    for a, c in zip(first, second, strict=True):
        assert torch.equal(a, c)
    assert torch.equal(kernels.dropout_keep_mask(drop, 512, 1024, "cuda"), keep_mask(drop, 512, 1024, "cuda"))


@gpu
@needs_cuda
def test_gpu_direct_launch_reuses_the_compiled_kernel_and_respects_alignment():
    # The second call of a signature skips Triton's launch path (launch() calls the bound compiled kernel); a
    # misaligned view of the same data must get its own entry and still be right.
    torch.manual_seed(0)
    x, weight, b, lora_A, lora_B, dy = make_inputs(520, 256, 264, 16, torch.bfloat16, device="cuda")
    storage = torch.randn(520 * 256 + 1, device="cuda").to(torch.bfloat16)
    x_off = storage[1:].view(520, 256)  # 2 bytes past a 16-byte boundary: no TMA, no alignment hint
    x_off.copy_(x)
    from parallel_lora.kernels import lora

    kconfigs._BOUND.clear()
    lora._FORWARD_SITES.clear()  # the op's launch sites hold bound kernels too
    lora._BACKWARD_SITES.clear()
    for operand in (x, x, x_off, x_off, x):
        check_against_eager(operand, weight, b, lora_A, lora_B, dy, SCALE, None, tol=GPU_TOL[torch.bfloat16])
    keys = list(kconfigs._BOUND)
    assert any(not all(key[4]) for key in keys), keys
    n = len(keys)
    check_against_eager(x_off, weight, b, lora_A, lora_B, dy, SCALE, None, tol=GPU_TOL[torch.bfloat16])
    assert len(kconfigs._BOUND) == n  # seen before: nothing new compiled or bound


@gpu
@needs_cuda
def test_gpu_tma_workspace_is_shared_per_stream_and_right_on_two_streams():
    # The descriptor workspace is one buffer per (device, stream); kernels on two streams at once must not
    # share one. Both streams run the op on different data concurrently and both must match the reference.
    from parallel_lora.kernels import gemm_tma

    torch.manual_seed(0)
    shapes = [(2048, 1024, 1024, 16), (1024, 2048, 512, 8)]
    inputs = [make_inputs(*shape, torch.bfloat16, device="cuda") for shape in shapes]
    refs = [reference(*i, SCALE, None)[0] for i in inputs]
    mags = [reference(*i, SCALE, None, absolute=True)[0] for i in inputs]
    streams = [torch.cuda.Stream() for _ in shapes]
    outs = [None, None]
    torch.cuda.synchronize()
    for _ in range(3):
        for j, (stream, i) in enumerate(zip(streams, inputs, strict=True)):
            with torch.cuda.stream(stream):
                outs[j] = kernels.forward(*i[:5], SCALE, None)[0]
        torch.cuda.synchronize()
        for out, ref, mag in zip(outs, refs, mags, strict=True):
            assert_matches("y", out, ref, mag, torch.bfloat16, GPU_TOL[torch.bfloat16])
    keys = {key for key in gemm_tma._SCRATCH if key[1] in {s.cuda_stream for s in streams}}
    assert len(keys) == 2, gemm_tma._SCRATCH.keys()


@gpu
@needs_cuda
def test_gpu_adapter_grads_with_many_splits_are_exact_and_reproducible_on_two_streams():
    # Dozens of splits per column tile: the last program to arrive sums every partial. Reading one before it
    # landed, or a counter another stream bumped, would show as a wrong or a run-to-run different result. At
    # these token counts dB comes from shrink_db's per-row-block partials, per-stream workspaces too.
    from parallel_lora.kernels import rank_reduce, shrink_db

    torch.manual_seed(0)
    shapes = [(65536, 256, 256, 16), (8192, 1024, 512, 8)]
    for M, K, N, _ in shapes:
        assert rank_reduce.split_rows(M, K + N, torch.device("cuda"))[0] >= 16
    inputs = [make_inputs(*shape, torch.bfloat16, device="cuda") for shape in shapes]
    s_loras = [kernels.forward(*i[:5], SCALE, None)[1] for i in inputs]
    refs = [reference(*i, SCALE, None) for i in inputs]
    mags = [reference(*i, SCALE, None, absolute=True) for i in inputs]
    streams = [torch.cuda.Stream() for _ in shapes]
    runs = []
    torch.cuda.synchronize()
    for _ in range(5):
        outs = [None, None]
        for j, (stream, (x, weight, _, lora_A, lora_B, dy)) in enumerate(zip(streams, inputs, strict=True)):
            with torch.cuda.stream(stream):
                outs[j] = kernels.backward(dy, x, weight, lora_A, lora_B, s_loras[j], SCALE, None)[1:]
        torch.cuda.synchronize()
        runs.append(outs)
    for j in range(len(shapes)):
        for name, out, ref, mag in zip(("dA", "dB"), runs[0][j], refs[j][3:], mags[j][3:], strict=True):
            assert_matches(name, out, ref, mag, torch.bfloat16, GPU_TOL[torch.bfloat16])
        for later in runs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(runs[0][j], later[j], strict=True))
    for count in (*rank_reduce._COUNTERS.values(), *shrink_db._G_COUNTERS.values()):
        assert not count.any(), "arrival counters were left non-zero"
    assert len([key for key in shrink_db._DB_PARTIALS if key[1] in {s.cuda_stream for s in streams}]) == 2


@gpu
@needs_cuda
def test_gpu_new_token_count_in_a_tuned_bucket_reuses_its_config_without_tuning(monkeypatch):
    # Variable-length batches: after the first M of a power-of-two bucket has tuned, other Ms of the bucket
    # launch with its configs (compiling at most a new specialization), never through the tuner again.
    tuner_calls = []
    real_tune = kconfigs.tune

    def spy(spec, *args, **kwargs):
        tuner_calls.append(spec.name)
        return real_tune(spec, *args, **kwargs)

    monkeypatch.setattr(kconfigs, "tune", spy)
    torch.manual_seed(0)
    K, N, r = 1024, 768, 16
    drop = Dropout(p=0.1, seed=3, position="pre")
    check_against_eager(*make_inputs(3000, K, N, r, torch.bfloat16, device="cuda"), SCALE, drop,
                        tol=GPU_TOL[torch.bfloat16])  # fmt: skip
    assert tuner_calls, "the first M of the bucket did not go through the tuner"
    tuner_calls.clear()
    for M in (3001, 2049, 4096, 3000):
        inputs = make_inputs(M, K, N, r, torch.bfloat16, device="cuda")
        check_against_eager(*inputs, SCALE, drop, tol=GPU_TOL[torch.bfloat16])
    assert tuner_calls == []
    check_against_eager(*make_inputs(4097, K, N, r, torch.bfloat16, device="cuda"), SCALE, drop,
                        tol=GPU_TOL[torch.bfloat16])  # fmt: skip
    assert tuner_calls, "a new bucket must tune"


@gpu
@needs_cuda
def test_gpu_tuning_skips_the_slow_fallback_and_leaves_the_fused_launches_consistent(monkeypatch):
    # ``tune`` runs every candidate many times in CUDA graphs on a side stream: the fused launches' queues and
    # flags must come out of it consistent (the op is right afterwards, twice), and it must not pick the 64x64
    # fallback tile, ~4x slower at this size.
    from parallel_lora.kernels import rank_reduce

    monkeypatch.setattr(kconfigs, "_BEST", {})
    monkeypatch.setattr(kconfigs, "_BOUND", {})
    picks = []
    real_tune = kconfigs.tune

    def recording(spec, *args):
        cfg = real_tune(spec, *args)
        picks.append((spec.name, cfg))
        return cfg

    monkeypatch.setattr(kconfigs, "tune", recording)
    torch.manual_seed(0)
    inputs = make_inputs(3072, 1536, 2560, 16, torch.bfloat16, device="cuda")  # a shape no other test tunes
    for _ in range(2):
        check_against_eager(*inputs, SCALE, None, tol=GPU_TOL[torch.bfloat16])
    tuned = dict(picks)
    assert {"shrink_gemm", "dx_grads"} <= set(tuned), f"the fused launches were not tuned: {sorted(tuned)}"
    for name in ("shrink_gemm", "dx_grads"):
        assert tuned[name].kwargs["BLOCK_M"] >= 128, f"{name} picked {tuned[name]}"
    for count in rank_reduce._COUNTERS.values():
        assert not count.any(), "arrival counters were left non-zero"


def _compile_every_config(checked: list):
    """A stand-in for ``configs.launch`` that compiles the launch with every config its shared-memory estimate
    keeps on this GPU and checks the estimate bounds what the compiler allocated (appending each to ``checked``)."""
    from triton.runtime.errors import OutOfResources

    limit = kconfigs.max_shared_mem(torch.cuda.current_device())

    def compile_each(spec, kernel, signature, tensors, runtime, build):
        static, grid, consts = build()
        args = (*tensors, *static, *runtime)
        nargs = dict(zip(kernel.arg_names, args, strict=False))
        elem = nargs[spec.dtype_arg].element_size()
        for cfg in spec.configs():
            need = spec.smem(cfg.kwargs, cfg.num_stages, elem, {**nargs, **consts})
            if need > limit:
                continue  # pruned before any launch
            try:
                compiled = kernel[grid](*args, **consts, **cfg.all_kwargs())
            except OutOfResources as err:
                pytest.fail(f"{cfg} estimated {need} B but did not fit: {err}")
            assert compiled.metadata.shared <= need, (cfg, compiled.metadata.shared, need)
            checked.append(cfg)

    return compile_each


@gpu
@needs_cuda
@pytest.mark.parametrize("r", [16, 256])
def test_gpu_adapter_grads_smem_estimate_bounds_every_compiled_config(monkeypatch, r):
    # The fused adapter-gradient kernel holds two reduction loops (x's tiles, dy's tiles); the pruning
    # estimate must still bound what the compiler allocates, or a ~100 KB GPU could be handed a config
    # that does not fit.
    from parallel_lora.kernels import rank_reduce

    checked = []
    compile_each = _compile_every_config(checked)
    monkeypatch.setattr(rank_reduce, "launch", compile_each)
    torch.manual_seed(0)
    M, K, N = 4096, 1024, 512
    x, dy = (torch.randn(M, n, device="cuda", dtype=torch.bfloat16) for n in (K, N))
    g, s_lora = (torch.randn(M, r, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rank_reduce.lora_adapter_grads(x, g, dy, s_lora, p=0.1, seed=1, drop_x=True)
    assert checked


@gpu
@needs_cuda
def test_gpu_fused_launches_with_no_spare_program_match_fp64_and_repeat_exactly():
    # M = 128 * SMs with N = 4096 makes the tile count a multiple of the SM count for every config (128x256,
    # 128x128, 64x64): no spare program. The forward's tiles then claim and compute S themselves while the row
    # block's other tiles wait, and the backward's GEMM programs work the whole reduction queue after their tiles.
    torch.manual_seed(0)
    sms = kconfigs.sm_count(torch.cuda.current_device())
    inputs = make_inputs(128 * sms, 1024, 4096, 16, torch.bfloat16, device="cuda")
    drop = Dropout(p=0.1, seed=7, position="pre")
    check_against_eager(*inputs, SCALE, drop, tol=GPU_TOL[torch.bfloat16])
    x, weight, b, lora_A, lora_B, dy = inputs
    runs = []
    for _ in range(2):
        y, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, drop)
        runs.append((y, s_lora, *kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, drop)))
    assert all(torch.equal(a, c) for a, c in zip(*runs, strict=True))


@gpu
@needs_cuda
@pytest.mark.parametrize("r", [16, 32, 64, 256])
@pytest.mark.parametrize("op", ["dx_grads", "dx_grads_db_sums", "shrink_gemm", "shrink_db"])
def test_gpu_fused_launch_smem_estimate_bounds_every_compiled_config(monkeypatch, op, r):
    # The fused launches hold the GEMM's pipelined loop and the loops of the work on its spare SMs (two
    # reductions, dA and the sums of dB's partials, or the producers' shrink); their buffers share shared memory
    # (the estimate takes the larger), which only holds if the compiler reuses them. shrink_db's two dots stage
    # dB's partial on its way out.
    from parallel_lora.kernels import dx_grads, shrink_db, shrink_gemm

    if op == "shrink_gemm" and r > 64:
        pytest.skip("ranks above 64 keep the separate shrink")
    if op in ("shrink_db", "dx_grads_db_sums") and r > shrink_db.MAX_DB_R_PAD:
        pytest.skip("ranks above MAX_DB_R_PAD reduce dB from dy")

    checked = []
    compile_each = _compile_every_config(checked)
    monkeypatch.setattr(dx_grads, "launch", compile_each)
    monkeypatch.setattr(shrink_gemm, "launch", compile_each)
    monkeypatch.setattr(shrink_db, "launch", compile_each)
    torch.manual_seed(0)
    M, K, N = 4096, 1024, 512
    x, weight, b, lora_A, lora_B, dy = make_inputs(M, K, N, r, torch.bfloat16, device="cuda")
    g, s_lora = (torch.randn(M, r, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if op == "dx_grads":
        dx_grads.lora_dx_and_grads(dy, weight, False, g, lora_A, x, s_lora, p=0.1, seed=1, lora_drop=True)
    elif op == "dx_grads_db_sums":
        parts = torch.zeros(shrink_db.db_blocks(M) * N * r, device="cuda")
        dx_grads.lora_dx_and_grads(dy, weight, False, g, lora_A, x, None, db_partials=parts,
                                   db_parts=shrink_db.db_blocks(M), p=0.1, seed=1, lora_drop=True)  # fmt: skip
    elif op == "shrink_db":
        shrink_db.lora_shrink_db(dy, lora_B, s_lora, 2.0, p=0.1, seed=1, drop_post=True)
    else:
        shrink_gemm.lora_shrink_gemm(x, weight, True, b, lora_A.t(), lora_B.t(), 2.0, p=0.1, seed=1, drop_post=True)
    assert checked
