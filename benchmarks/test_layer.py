"""``benchmarks.layer``: its rows, the floors it judges in kernel time, the A/B against another tree, and the whole
flow of one variant on the CPU (Triton's interpreter, a stand-in clock)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import layer

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"shape", "impl", "dropout", "adapter_dtype", "fwd_ratio", "fwdbwd_ratio", "held_mib"}


def row(impl, fwd, fwdbwd, shape=(8192, 4096, 4096, 16), dropout=0.0, adapters="bfloat16", rounds=None):
    return {"shape": list(shape), "impl": impl, "dropout": dropout, "adapter_dtype": adapters, "fwd_ratio": fwd,
            "fwdbwd_ratio": fwdbwd, "fwd_ms_rounds": rounds, "fwdbwd_ms_rounds": rounds}  # fmt: skip


def test_layer_rows_take_each_ratio_to_the_base_of_the_same_round():
    times = {
        "base/fwd": [1.0, 2.0, 1.0], "base/fwdbwd": [2.0, 4.0, 2.0],
        "parallel_lora/fwd": [1.05, 2.1, 1.5], "parallel_lora/fwdbwd": [2.2, 4.4, 2.2],
    }  # fmt: skip
    rows = layer.layer_rows((8192, 4096, 4096, 16), 0.1, "float32", times, {"base": 0.0, "parallel_lora": 0.25}, {})
    base, ours = rows
    assert KEYS <= set(base) and KEYS <= set(ours)
    assert (base["impl"], base["fwd_ratio"], base["fwdbwd_ratio"]) == ("base", 1.0, 1.0)
    assert ours["shape"] == [8192, 4096, 4096, 16] and (ours["dropout"], ours["adapter_dtype"]) == (0.1, "float32")
    assert ours["fwd_ratio"] == pytest.approx(1.05)  # rounds 1.05, 1.05, 1.5: a slow round does not move it
    assert ours["fwdbwd_ratio"] == pytest.approx(1.1) and ours["held_mib"] == 0.25
    assert ours["fwd_ms"] == pytest.approx(1.5) and ours["fwd_ms_rounds"] == [1.05, 2.1, 1.5]


def test_floor_checks_judge_each_floor_and_the_dropout_and_fp32_costs():
    mlp = (8192, 4096, 14336, 16)
    rows = [
        row("base", 1.0, 1.0),
        row("parallel_lora", 1.089, 1.16),
        row("parallel_lora", 1.089, 1.16 * 1.12, dropout=0.1),
        row("parallel_lora", 1.089, 1.16 * 1.02, adapters="float32"),
        row("peft", 1.39, 1.43),  # another implementation: not judged
        row("parallel_lora", 1.09, 1.11, shape=mlp),
        row("parallel_lora", 1.3, 1.3, shape=(2048, 4096, 4096, 16)),  # no floor at this shape
    ]
    checks = {(tuple(c["shape"]), c["measure"]): c for c in layer.floor_checks(rows)}
    square = (8192, 4096, 4096, 16)
    assert set(checks) == {(square, "fwd / base"), (square, "fwd+bwd / base"), (square, "+ dropout 0.1"),
                           (square, "+ fp32 adapters"), (mlp, "fwd / base"), (mlp, "fwd+bwd / base")}  # fmt: skip
    assert checks[square, "fwd / base"]["met"] and checks[square, "fwd / base"]["floor"] == 1.09
    assert not checks[square, "fwd+bwd / base"]["met"]  # 1.16 over 1.15
    dropout, fp32 = checks[square, "+ dropout 0.1"], checks[square, "+ fp32 adapters"]
    assert dropout["value"] == pytest.approx(0.12) and not dropout["met"]  # 12% over 11%
    assert fp32["value"] == pytest.approx(0.02) and fp32["met"]
    assert checks[mlp, "fwd / base"]["met"] and checks[mlp, "fwd+bwd / base"]["met"]


def test_new_over_old_compares_the_trees_round_by_round():
    new, old = [0.9, 2.0, 1.0], [1.0, 2.0, 2.0]
    rows = [row("parallel_lora", 1.0, 1.0, rounds=new), row("parallel_lora_old", 1.0, 1.0, rounds=old)]
    (ab,) = layer.new_over_old(rows)
    assert ab["fwd"] == pytest.approx(0.9) and ab["fwdbwd"] == pytest.approx(0.9)


@pytest.fixture
def on_cpu(monkeypatch):
    """``benchmarks.layer`` measuring on the CPU: no CUDA synchronization or memory statistics."""
    monkeypatch.setattr(layer, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)


@pytest.mark.slow
def test_layer_measures_every_implementation_against_the_base_and_another_tree(on_cpu):
    # The flow of one variant on the CPU: every implementation built on the same W, A, B, validated, timed in
    # rounds (a stand-in clock that still calls each case) and reported, this tree also loaded as the --old one.
    calls = []

    def time_one(case):
        calls.append(case())
        return 1.0

    old = layer.load_tree(ROOT)
    rows = layer.measure((64, 64, 64, 8), 0.0, torch.float32, time_one, 2, False, None, old)
    impls = {r["impl"] for r in rows}
    assert {"base", "torch_eager", "addmm", "parallel_lora", "parallel_lora_old"} <= impls
    assert len(calls) == 2 * 2 * len(impls)  # forward and forward+backward of each, twice
    for r in rows:
        assert KEYS <= set(r) and r["adapter_dtype"] == "float32" and r["fwd_ratio"] == 1.0
        assert r["impl"] == "base" or r["rel_err"] < 2e-2
    assert layer.new_over_old(rows)[0]["fwdbwd"] == 1.0
    # --impls parallel_lora with --old still measures the other tree: the A/B is what --old asks for.
    rows = layer.measure((64, 64, 64, 8), 0.0, torch.float32, time_one, 1, False, {"parallel_lora"}, old)
    assert {r["impl"] for r in rows} == {"base", "parallel_lora", "parallel_lora_old"}


def test_kernel_time_rows_break_each_case_down_by_kernel(on_cpu, capsys):
    profiled = []

    def by_kernel(case):
        profiled.append(case())
        return {"_dx_and_grads_kernel": 40.0 + len(profiled), "_lora_shrink_kernel": 7.0}

    rows = layer.measure((64, 64, 64, 8), 0.0, torch.float32, lambda case: 1.0, 1, False, {"parallel_lora"}, None,
                         by_kernel)  # fmt: skip
    assert len(profiled) == 2 * len(rows)  # each implementation's forward and forward+backward, once
    ours = next(r for r in rows if r["impl"] == "parallel_lora")
    assert ours["kernels_us"]["fwdbwd"]["_lora_shrink_kernel"] == 7.0
    assert ours["kernels_us"]["fwd"] != ours["kernels_us"]["fwdbwd"]  # each case its own profile
    layer.print_kernels(rows)
    line = next(line for line in capsys.readouterr().out.splitlines() if "parallel_lora" in line)
    total = sum(ours["kernels_us"]["fwdbwd"].values())
    assert f"{total:.1f}: _dx_and_grads_kernel" in line and "_lora_shrink_kernel 7.0" in line


def test_kernel_time_breakdown_is_the_last_timed_round_not_another_profile(monkeypatch):
    profiles = []

    def kernel_us(fn, calls):
        profiles.append(fn)
        return {"_dx_and_grads_kernel": 40.0 * len(profiles), "_lora_shrink_kernel": 7.0}

    monkeypatch.setattr(layer, "kernel_us", kernel_us)
    time_one, _, by_kernel = layer.timer(layer.parse_args(["--kernel-time"]))
    case = object()
    assert time_one(case) == pytest.approx(0.047) and time_one(case) == pytest.approx(0.087)  # ms, summed
    assert by_kernel(case) == {"_dx_and_grads_kernel": 80.0, "_lora_shrink_kernel": 7.0} and len(profiles) == 2


@pytest.mark.slow
def test_layer_says_it_needs_a_gpu_instead_of_failing_with_a_traceback():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    command = [sys.executable, "-m", "benchmarks.layer", "--quick"]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 1 and "needs a CUDA GPU" in out.stderr and "Traceback" not in out.stderr


def test_kernel_time_judges_all_four_floor_shapes_by_default():
    args = layer.parse_args(["--kernel-time"])
    assert args.shapes == layer.SHAPES and set(layer.FLOORS) == set(layer.SHAPES) and len(layer.SHAPES) == 4
    assert layer.FLOORS[(8192, 4096, 14336, 16)] == (1.10, 1.12)


def test_layer_rejects_a_malformed_shape_naming_the_expected_form():
    with pytest.raises(SystemExit):
        layer.parse_args(["--shapes", "8192,4096,4096"])
    args = layer.parse_args(["--quick"])
    assert (args.shapes, args.dropouts, args.adapter_dtypes) == ([layer.SHAPES[0]], [0.0], [torch.bfloat16])


def test_graph_capture_lifts_the_old_trees_refusal_of_frozen_masks_and_restores_it(monkeypatch):
    # An --old tree from before device-drawn seeds refuses CUDA-graph capture with dropout; --graph times it anyway
    # (one mask per replay, the same work), and leaves the tree as it was.
    import types

    def refuse(dropout, x):
        raise RuntimeError("host seed under capture")

    tree = types.SimpleNamespace(refuse_frozen_masks=refuse)
    monkeypatch.setitem(sys.modules, "parallel_lora_old.functional", tree)
    with layer.old_masks_may_freeze():
        assert tree.refuse_frozen_masks(0.1, None) is None
    assert tree.refuse_frozen_masks is refuse
    monkeypatch.setitem(sys.modules, "parallel_lora_old.functional", types.SimpleNamespace())
    with layer.old_masks_may_freeze():  # a tree with nothing to lift
        pass
