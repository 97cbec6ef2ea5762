"""``tools.launch_paths``: the path each case is held to, the rows of one shape on the CPU (Triton's interpreter, a
stand-in clock), and the dispatch's slower picks."""

from __future__ import annotations

import pytest
import torch

from parallel_lora import kernels
from parallel_lora.kernels import dispatch, shrink_gemm
from tests._kernels import count_launches
from tools import launch_paths as paths


@pytest.fixture
def launched(monkeypatch) -> list[str]:
    """The kernel of every launch (the interpreter launches every one through a bound site)."""
    return count_launches(monkeypatch)


def operands(M=64, K=64, N=48, r=8):
    torch.manual_seed(0)
    x, dy = torch.randn(M, K, dtype=torch.bfloat16), torch.randn(M, N, dtype=torch.bfloat16)
    W = torch.randn(N, K, dtype=torch.bfloat16) / K**0.5
    return x, W, torch.randn(r, K) / K**0.5, torch.randn(N, r) / r, dy


def test_path_holds_both_passes_to_one_launch_path_and_restores_the_dispatch(launched):
    x, W, A, B, dy = operands()
    want = {"fused": (["shrink_gemm"], "dx_grads"), "separate": (["shrink", "gemm_tma"], "adapter_grads")}
    for name, (fwd, bwd) in want.items():
        with paths.path(name):
            launched.clear()
            y, s_lora = kernels.forward(x, W, None, A, B, 2.0, None)
            assert launched == fwd, name
            launched.clear()
            kernels.backward(dy, x, W, A, B, s_lora, 2.0, None)
            assert bwd in launched, (name, launched)
            assert paths.takes(x, W, A, B, dy, s_lora) == {"fwd": name, "bwd": name}
    assert dispatch.spares_keep_pace is shrink_gemm.spares_keep_pace
    assert not dispatch._FORWARD_SITES and not dispatch._BACKWARD_SITES, "no layout bound under a held path stays"


def test_measure_times_cublas_and_both_paths_of_each_pass(monkeypatch):
    monkeypatch.setattr(paths, "DEVICE", "cpu")
    timed = []

    def time_one(case):
        timed.append(case())
        return 10.0 * len(timed)

    rows = paths.measure((64, 64, 48, 8), torch.float32, time_one, 2)
    assert len(timed) == 2 * 6  # cuBLAS and the two paths of each pass, every round
    assert [r["pass"] for r in rows] == ["fwd", "bwd"]
    for r in rows:
        assert r["shape"] == [64, 64, 48, 8] and r["adapter_dtype"] == "float32" and r["takes"] in paths.PATHS
        assert all(len(r[f"{impl}_us_rounds"]) == 2 for impl in ("cublas", *paths.PATHS))
    assert dispatch.spares_keep_pace is shrink_gemm.spares_keep_pace


def test_measure_leaves_out_a_fused_launch_the_operands_cannot_take(monkeypatch):
    # "pre"-free, but rank 128 pads past the fused forward's 64: only the separate forward exists there.
    monkeypatch.setattr(paths, "DEVICE", "cpu")
    rows = paths.measure((64, 64, 48, 128), torch.bfloat16, lambda case: (case(), 1.0)[1], 1)
    fwd, bwd = rows
    assert fwd["fused_us"] is None and fwd["takes"] == "separate" and fwd["separate_us"] == 1.0
    assert bwd["fused_us"] == 1.0
    assert paths.slower_picks(rows) == []


def test_slower_picks_are_the_rows_whose_dispatch_path_loses_by_more_than_the_margin():
    def row(takes, fused, separate):
        return {"takes": takes, "fused_us": fused, "separate_us": separate}

    rows = [row("fused", 124.0, 106.4), row("fused", 39.2, 43.5), row("separate", 116.1, 116.2),
            row("fused", 102.0, 100.0), row("separate", None, 50.0)]  # fmt: skip
    assert paths.slower_picks(rows) == [rows[0]]


def test_paths_reads_its_shapes_and_dtypes_or_names_the_expected_form():
    args = paths.parse_args([])
    assert args.shapes == paths.SHAPES and args.adapter_dtypes == [torch.bfloat16, torch.float32]
    with pytest.raises(SystemExit):
        paths.parse_args(["--shapes", "2048,2048,512"])
    with pytest.raises(SystemExit):
        paths.parse_args(["--adapter-dtypes", "bf16"])
