"""Which launches the op makes, and that each fused launch computes exactly what the separate ones do.

The TMA path (16-bit operands with describable rows; emulated by the interpreter) fuses S into y's GEMM
(``shrink_gemm``) and dA, dB into dx's (``dx_grads``), and from 8192 tokens takes dB's partials from G's launch
(``shrink_db``). Reference: the separate launches, bit for bit where both run the same tiles, and the eager oracle.
"""

from __future__ import annotations

import pytest
import torch

from parallel_lora import kernels
from parallel_lora.kernels import adapter_grads, dispatch, dx_grads, gemm, shrink_db, shrink_gemm, workspace
from parallel_lora.kernels.adapter_grads import split_rows
from tests._kernels import (
    DEVICE,
    DROPOUTS,
    INTERPRETING,
    SCALE,
    TOL,
    assert_matches,
    check_against_eager,
    count_launches,
    make_inputs,
    reference,
    rel_err,
    skip_without_tma,
)


def test_forward_pre_dropout_keeps_the_separate_masked_shrink(monkeypatch):
    # The "pre" mask hashes every element of x: too much compute for the fused forward's spare SMs (GEMM tiles
    # would wait for S), so that mode runs the masked shrink on every SM, then the GEMM.
    skip_without_tma()
    x, weight, b, lora_A, lora_B, _ = make_inputs(37, 64, 48, 8, torch.bfloat16)
    launched = count_launches(monkeypatch)
    dispatch.clear_sites()
    for mode, expected in (("pre", ["shrink", "gemm_tma"]), ("post", ["shrink_gemm"])):
        kernels.forward(x, weight, b, lora_A, lora_B, SCALE, DROPOUTS[mode])  # binds (on GPU: tunes) the sites
        launched.clear()
        kernels.forward(x, weight, b, lora_A, lora_B, SCALE, DROPOUTS[mode])
        assert launched == expected, mode
    dispatch.clear_sites()


@pytest.mark.parametrize("r", [16, 32, 64])
def test_forward_fp32_adapters_above_r16_take_the_separate_launches(monkeypatch, r):
    # Wide adapter tiles staged by the fused forward's producers crowd its GEMM configs out of shared memory; the
    # separate launches are faster there (docs/kernels.md), and match the eager oracle all the same.
    skip_without_tma()
    x, weight, b, lora_A, lora_B, dy = make_inputs(37, 64, 48, r, torch.bfloat16)
    lora_A, lora_B = lora_A.float(), lora_B.float()
    launched = count_launches(monkeypatch)
    dispatch.clear_sites()
    kernels.forward(x, weight, b, lora_A, lora_B, SCALE, None)  # binds (on GPU: tunes) the sites
    launched.clear()
    kernels.forward(x, weight, b, lora_A, lora_B, SCALE, None)
    assert launched == (["shrink_gemm"] if r == 16 else ["shrink", "gemm_tma"])
    ref = reference(x, weight, b, lora_A, lora_B, dy, SCALE, None)
    mag = reference(x, weight, b, lora_A, lora_B, dy, SCALE, None, absolute=True)
    outs = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, None)
    for name, out, want, m in zip(("y", "S"), outs, ref[:2], mag[:2], strict=True):
        assert_matches(name, out, want, m, torch.bfloat16)
    kernels.forward(x, weight, b, lora_A.bfloat16(), lora_B.bfloat16(), SCALE, None)
    kernels.forward(x, weight, b, lora_A.bfloat16(), lora_B.bfloat16(), SCALE, None)
    assert launched[-1] == "shrink_gemm", "bf16 adapters keep the fused forward at every rank up to 64"
    dispatch.clear_sites()


def test_spares_keep_pace_from_4096_columns_or_in_one_wave():
    # On 132 SMs with 128 x 256 tiles: llama-1b's q, o and down at 8192 tokens (4 waves, 4 spare programs) fall
    # behind, its wide gate and up keep pace, and every 2048-token projection is one wave.
    keeps = lambda M, N, elem, programs: shrink_gemm.spares_keep_pace(M, N, elem, programs, elem)  # noqa: E731
    assert not keeps(8192, 2048, 2, 132) and not keeps(8192, 1024, 2, 132)
    assert keeps(8192, 4096, 2, 132) and keeps(8192, 8192, 2, 132) and keeps(8192, 14336, 2, 132)
    assert keeps(2048, 2048, 2, 132) and keeps(8192, 512, 2, 132) and not keeps(8192, 4096, 4, 132)
    assert not keeps(8192, 4096, 2, 114), "1024 tiles in 9 waves fill 114 SMs: no spare program"


def test_one_wave_takes_the_separate_launches_for_wide_adapters_short_of_spares():
    # fp32 adapters over bf16 x in one wave: q, o and down at 2048 tokens (16 row blocks, 4 spare programs) go
    # apart; k and v (32 tiles, 100 spares) stay fused; adapters as wide as x stay fused; more waves keep the pace rule.
    keeps = shrink_gemm.spares_keep_pace
    assert not keeps(2048, 2048, 2, 132, 4) and not keeps(8192, 512, 2, 132, 4)
    assert keeps(2048, 512, 2, 132, 4) and keeps(2048, 2048, 2, 132, 2) and keeps(2048, 2048, 4, 132, 4)
    assert keeps(8192, 8192, 2, 132, 4) and not keeps(8192, 2048, 2, 132, 4)


def test_forward_takes_the_separate_launches_where_spares_fall_behind(monkeypatch):
    # One tile per 128 rows: on 4 programs 8 row blocks take two waves and leave no spare program; 4 fit one wave.
    skip_without_tma()
    monkeypatch.setattr(dispatch, "programs", lambda x: 4)
    launched = count_launches(monkeypatch)
    # fp32 adapters in that one wave: no spare program for the 4 row blocks, so apart.
    for M, expected, wide in ((1024, ["shrink", "gemm_tma"], False), (512, ["shrink_gemm"], False),
                              (512, ["shrink", "gemm_tma"], True)):  # fmt: skip
        x, weight, b, lora_A, lora_B, _ = make_inputs(M, 64, 48, 8, torch.bfloat16)
        if wide:
            lora_A, lora_B = lora_A.float(), lora_B.float()
        dispatch.clear_sites()
        kernels.forward(x, weight, b, lora_A, lora_B, SCALE, None)  # binds (on GPU: tunes) the sites
        launched.clear()
        kernels.forward(x, weight, b, lora_A, lora_B, SCALE, None)
        assert launched == expected, (M, wide)
    dispatch.clear_sites()


@pytest.mark.parametrize("shape", [(37, 64, 48), (64, 96, 80)], ids=["spare_programs", "tiles_claim"])
@pytest.mark.parametrize("drop", ["none", "post"])
def test_shrink_gemm_equals_the_separate_launches_bit_for_bit(monkeypatch, drop, shape):
    # On the TMA path the forward's S and y are one launch. In the interpreter (3 programs, run one after
    # another) a problem of 4 tiles leaves one spare program, which produces every S row block first; one of 6
    # tiles leaves none, so each tile claims and computes its row block's S itself. Either way S and y must be
    # exactly the separate launches' (same tiles, same order), and the launch must leave its queue at zero, its
    # epoch advanced and every flag published for that epoch.
    if not INTERPRETING:
        pytest.skip("the GPU tunes the two paths' tiles separately: the GPU tests compare them with fp64")
    M, K, N = shape
    x, weight, b, lora_A, lora_B, _ = make_inputs(M, K, N, 8, torch.bfloat16)
    dropout = DROPOUTS[drop]
    launched = count_launches(monkeypatch)
    dispatch.clear_sites()
    fused = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, dropout)
    assert launched == ["shrink_gemm"]
    (sync,) = workspace.SYNC.values()
    epoch = sync[0].item()
    again = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, dropout)
    assert sync[0].item() == epoch + 1 and sync[1:3].tolist() == [0, 0]
    row_blocks = -(-M // shrink_gemm.SPEC.interp["BLOCK_M"])
    assert sync[3 : 3 + row_blocks].tolist() == [2 * epoch + 2] * row_blocks
    dispatch.clear_sites()
    monkeypatch.setattr(dispatch, "_y_takes_fused", lambda *args: False)
    separate = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, dropout)
    assert launched[2:] == ["shrink", "gemm_tma"]
    for name, a, c, d in zip(("y", "S"), fused, again, separate, strict=True):
        assert torch.equal(a, c) and torch.equal(a, d), name
    dispatch.clear_sites()


@pytest.mark.slow
@pytest.mark.parametrize("wanted", [("dA", "dB"), ("dA",), ("dB",)], ids="+".join)
@pytest.mark.parametrize("drop", list(DROPOUTS))
@pytest.mark.parametrize("shape", [(130, 64, 48), (9, 24, 16)], ids=["multi_split", "spare_program"])
def test_dx_grads_equals_the_separate_launches_bit_for_bit(monkeypatch, shape, drop, wanted):
    # On the TMA path dx and the adapter gradients share one launch. In the interpreter both paths run the same
    # tiles (GEMM and reductions), so the fused launch must reproduce the separate ones exactly, over several
    # M splits, with either gradient alone, and leave its queue and arrival counters at zero. The second shape
    # has one dx tile for the interpreter's two programs: the other one skips the GEMM (one program runs after
    # the other there, so the first has drained the queue). dB reduced from dy here, as at ranks above
    # shrink_db.MAX_DB_R_PAD (below it, from shrink_db's partials: the next test).
    if not INTERPRETING:
        pytest.skip("the GPU tunes the two paths' tiles separately: the GPU tests compare them with fp64")
    monkeypatch.setattr(shrink_db, "MAX_DB_R_PAD", 0)
    dispatch.clear_sites()
    M, K, N = shape
    x, weight, b, lora_A, lora_B, dy = make_inputs(M, K, N, 8, torch.bfloat16)
    if M > 100:
        assert split_rows(M, K + N, x.device)[0] > 1, "the shape no longer exercises the multi-split path"
    dropout = DROPOUTS[drop]
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, dropout)
    needs = {"needs_dA": "dA" in wanted, "needs_dB": "dB" in wanted}
    launched = count_launches(monkeypatch)
    fused = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, dropout, **needs)
    assert launched == ["shrink", "dx_grads"]
    dispatch.clear_sites()
    monkeypatch.setattr(dispatch, "_dx_takes_fused", lambda dy, weight: False)
    separate = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, dropout, **needs)
    assert launched[2:] == ["shrink", "gemm_tma", "adapter_grads"]
    for name, a, c in zip(("dx", "dA", "dB"), fused, separate, strict=True):
        assert (a is None) == (c is None) and (a is None or torch.equal(a, c)), name
    for count in workspace.COUNTERS.values():
        assert not count.any(), "the queue or an arrival counter was left non-zero"
    dispatch.clear_sites()


@pytest.mark.slow
@pytest.mark.parametrize("wanted", [("dA", "dB"), ("dB",)], ids="+".join)
@pytest.mark.parametrize("drop", ["none", "post"])
@pytest.mark.parametrize("r", [5, 16, 20])
def test_shrink_db_gives_g_and_db_partials_from_one_read_of_dy(monkeypatch, r, drop, wanted):
    # Up to shrink_db.MAX_DB_R_PAD the TMA backward launches shrink_db (G and dB's per-row-block partials from one
    # read of dy; several row blocks and column splits here, whose G partials the last arrival sums), then
    # dx_grads, which sums dB's partials on its spare programs instead of reducing dy. The gradients match the
    # path that reduces dy (another summation order: to rounding) and eager, repeat bit for bit, and every
    # counter ends at zero.
    if not INTERPRETING:
        pytest.skip("the interpreter's split sizes; the GPU tests compare with fp64")
    M, K, N = 60, 64, 80  # two row blocks, the second part-filled; three column splits
    assert shrink_db.db_blocks(M) > 1 and shrink_db.column_splits(M, N, torch.device("cpu"))[0] > 1
    x, weight, b, lora_A, lora_B, dy = make_inputs(M, K, N, r, torch.bfloat16)
    dropout = DROPOUTS[drop]
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, dropout)
    needs = {"needs_dA": "dA" in wanted, "needs_dB": True}
    launched = count_launches(monkeypatch)
    dispatch.clear_sites()
    one_read = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, dropout, **needs)
    again = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, dropout, **needs)
    assert launched == ["shrink_db", "dx_grads"] * 2
    monkeypatch.setattr(shrink_db, "MAX_DB_R_PAD", 0)
    dispatch.clear_sites()
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
    for count in (*workspace.COUNTERS.values(), *workspace.G_COUNTERS.values()):
        assert not count.any(), "a queue or an arrival counter was left non-zero"
    dispatch.clear_sites()


@pytest.mark.parametrize("case", ["pre_dropout", "rank_above_max"])
def test_backward_pre_dropout_and_larger_ranks_reduce_db_from_dy(monkeypatch, case):
    # Under "pre" dropout the masked dA items set the fused launch's tail, so dB's partials would only add
    # shrink_db's cost; dB's partials grow with the rank. Both keep G's plain shrink and reduce dB from dy.
    skip_without_tma()
    r = shrink_db.MAX_DB_R_PAD + 1 if case == "rank_above_max" else 8
    drop = DROPOUTS["pre"] if case == "pre_dropout" else None
    x, weight, b, lora_A, lora_B, dy = make_inputs(40, 48, 56, r, torch.bfloat16)
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, drop)
    launched = count_launches(monkeypatch)
    dispatch.clear_sites()
    kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, drop)
    assert launched == ["shrink", "dx_grads"]
    dispatch.clear_sites()


def test_shrink_db_taken_from_8192_tokens_at_ranks_up_to_32_while_small(monkeypatch):
    # The sizes where the GPUs measured a gain (shrink_db.MIN_M_GPU, MAX_DB_R_PAD); the partials, kept with the
    # stream's workspaces, at most MAX_DB_PARTIALS_BYTES. The interpreter takes the path at every size that
    # fits, so that the tests' small problems exercise it.
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


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M", [9, 130], ids=["one_split", "multi_split"])
def test_backward_is_at_most_three_launches_two_on_the_tma_path(monkeypatch, M, dtype):
    # G, the dx GEMM, and both adapter gradients in one launch (on the TMA path, dx and both gradients in
    # one, after G or G with dB's partials); no torch sum or cast of partials after it.
    if dtype != torch.float32:
        skip_without_tma()
    x, weight, b, lora_A, lora_B, dy = make_inputs(M, 40, 40, 8, dtype)
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, DROPOUTS["pre"])
    launched = count_launches(monkeypatch)
    monkeypatch.setattr(torch.Tensor, "sum", lambda *a, **k: pytest.fail("a torch sum ran in backward"))
    kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, DROPOUTS["pre"])
    assert launched == (["shrink", "gemm", "adapter_grads"] if dtype == torch.float32 else ["shrink", "dx_grads"])
    launched.clear()
    kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, None)
    g_launch = "shrink_db" if shrink_db.takes_db_partials(M, 40, 16) else "shrink"
    assert launched == (["shrink", "gemm", "adapter_grads"] if dtype == torch.float32 else [g_launch, "dx_grads"])
    launched.clear()
    kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, None, needs_dx=False)
    assert launched == ["shrink", "adapter_grads"]
    launched.clear()
    kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, None, needs_dx=False, needs_dA=False)
    assert launched == ["adapter_grads"]


def test_adapter_grads_split_fills_the_gpu_as_a_function_of_the_shape(monkeypatch):
    # On GPU the M reduction splits until the adapter gradients' column tiles (128 wide) times the splits
    # reach the program target; each split is a whole number of the largest BLOCK_M and the splits cover M.
    monkeypatch.setattr(adapter_grads, "interpreting", lambda: False)
    monkeypatch.setattr(adapter_grads, "_num_programs_target", lambda device: 264)
    assert adapter_grads.split_rows(2048, 8192, None) == (4, 512)
    assert adapter_grads.split_rows(100, 8192, None) == (1, 128)
    assert adapter_grads.split_rows(8192, 4096 + 14336, None) == (1, 8192)  # 144 tiles already fill it
    # The fused backward caps an item's rows (its tail after the GEMM); a cap above the split changes nothing.
    assert adapter_grads.split_rows(8192, 4096 + 14336, None, max_rows=2048) == (4, 2048)
    assert adapter_grads.split_rows(2048, 8192, None, max_rows=2048) == (4, 512)
    for M, F in ((8192, 8192), (2048, 4096), (16384, 2048), (1000, 1024)):
        split, rows = adapter_grads.split_rows(M, F, None)
        assert split > 1 and rows % adapter_grads.REDUCE_M_ALIGN_GPU == 0 and (split - 1) * rows < M <= split * rows
        assert split * (F // 128) <= 264


def test_dx_grads_splits_long_reductions_into_short_items(monkeypatch):
    # Items no longer than dx_grads.ITEM_ROWS (here 32 rows, so 130 rows take 5 splits where the program
    # target alone gives 2): the gradients still match the separate launches (another summation order, so
    # to rounding) and repeat bit for bit, and the queue and arrival counters end at zero.
    if not INTERPRETING:
        pytest.skip("the interpreter's split sizes; the GPU tests cover the GPU's")
    monkeypatch.setattr(dx_grads, "ITEM_ROWS", 32)
    dispatch.clear_sites()  # a site bound by an earlier test would skip the split
    seen = []
    real_split = adapter_grads.split_rows  # through adapter_grads.partials_workspace
    monkeypatch.setattr(adapter_grads, "split_rows", lambda *a, **k: seen.append(real_split(*a, **k)) or seen[-1])
    x, weight, b, lora_A, lora_B, dy = make_inputs(130, 64, 48, 8, torch.bfloat16)
    assert split_rows(130, 64 + 48, x.device)[0] == 2
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, None)
    fused = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, None)
    assert seen == [(5, 32)]
    again = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, None)
    dispatch.clear_sites()
    monkeypatch.setattr(dispatch, "_dx_takes_fused", lambda dy, weight: False)
    separate = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, None)
    for name, a, c, d in zip(("dx", "dA", "dB"), fused, again, separate, strict=True):
        assert torch.equal(a, c), name
        torch.testing.assert_close(a.float(), d.float(), rtol=1e-2, atol=1e-2, msg=name)
    for count in workspace.COUNTERS.values():
        assert not count.any(), "the queue or an arrival counter was left non-zero"
    dispatch.clear_sites()


def test_workspace_grown_keeps_the_buffer_it_replaces_alive():
    # A CUDA graph captured while the smaller buffer was current still uses its address: freeing it would let
    # the caching allocator give that memory to another tensor, which each replay would then overwrite.
    import weakref

    cache, dev = {}, torch.device("cpu")
    small = workspace.stream_buffer(cache, dev, 10, torch.int32, zeroed=True)
    assert workspace.stream_buffer(cache, dev, 1000, torch.int32, zeroed=True) is small  # within its size
    alive = weakref.ref(small)
    del small
    big = workspace.stream_buffer(cache, dev, 4096, torch.int32, zeroed=True)
    assert big.numel() >= 4096 and not big.any() and cache[(dev, 0)] is big
    assert alive() is not None and any(t is alive() for t in workspace.RETIRED)


def _gemm_paths(monkeypatch) -> list[str]:
    """Record the GEMMs that take the TMA path: ``lora_gemm`` describing a TMA kernel launch ("tma"), the
    forward's GEMM fused with the shrink ("fused_y") and the backward's dx GEMM fused with the adapter gradients
    ("fused_dx"); the fused launches are TMA only."""
    taken = []

    def spy(module, name, label):
        real = getattr(module, name)

        def recorded(*args, **kwargs):
            taken.append(label)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)

    spy(gemm, "describe_tma_gemm", "tma")
    spy(dispatch, "lora_shrink_gemm", "fused_y")
    spy(dispatch, "lora_dx_and_grads", "fused_dx")
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
def test_gemm_takes_tma_exactly_for_describable_16bit_operands(monkeypatch, dtype, K, N, tma):
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
def test_gemm_tma_same_bits_with_rank_tiles_through_tma_or_pointers(orient, r):
    # With TMA rank tiles the loops are flattened (``blocks.gemm_tiles``); S or G at a misaligned address
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
def test_gemm_tma_rank_tiles_through_tma_only_where_describable(r, dtype, lora_drop, expected):
    skip_without_tma()
    from parallel_lora.kernels.gemm_tma import rank_tma

    s = torch.zeros(64, r, device=DEVICE, dtype=dtype)
    lora_A = torch.zeros(r, 96, device=DEVICE, dtype=dtype)
    lora_B = torch.zeros(80, r, device=DEVICE, dtype=dtype)
    assert rank_tma(s, lora_A, lora_drop) == {"RANK_TMA": expected, "F_T": False}  # dx: A [r, K] read as is
    assert rank_tma(s, lora_B.t(), lora_drop) == {"RANK_TMA": expected, "F_T": expected}  # y: B^T via B's rows
