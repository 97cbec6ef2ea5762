"""``benchmarks.host``: its margins, and the whole flow on the CPU (``--smoke``: tiny shapes, gloo, no graphs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import host

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"shape", "impl", "dropout", "adapter_dtype", "host_fwd_us", "host_fwdbwd_us", "gpu_fwd_us", "gpu_fwdbwd_us"}


def row(impl, fwd, fwdbwd, adapters="bfloat16", shape=(2048, 4096, 4096, 16)):
    return {"shape": list(shape), "impl": impl, "dropout": 0.0, "adapter_dtype": adapters,
            "host_fwd_us_rounds": fwd, "host_fwdbwd_us_rounds": fwdbwd}  # fmt: skip


def test_margins_take_each_lora_case_to_its_baseline_in_the_same_round():
    rows = [
        row("base", [30.0, 60.0, 30.0], [170.0, 340.0, 170.0], adapters=None),
        row("torch_colwise", [100.0, 100.0, 100.0], [400.0, 400.0, 400.0], adapters=None),
        row("parallel_lora", [70.0, 100.0, 300.0], [300.0, 480.0, 330.0]),  # +40, +40, +270; +130, +140, +160
        row("column_parallel", [160.0, 160.0, 160.0], [500.0, 500.0, 500.0]),  # +60 over torch's: not met
        row("peft", [200.0, 200.0, 200.0], [900.0, 900.0, 900.0]),
        row("parallel_lora", [30.0, 30.0, 30.0], [170.0, 170.0, 170.0], shape=(8, 8, 8, 4)),  # no base there
    ]
    checks = {c["impl"]: c for c in host.margins(rows)}
    assert set(checks) == {"parallel_lora", "column_parallel", "peft"}
    ours = checks["parallel_lora"]
    assert (ours["baseline"], ours["fwd_us"], ours["fwdbwd_us"]) == ("base", 40.0, 140.0)
    assert ours["met"]  # a slow round does not move the median
    assert checks["column_parallel"]["baseline"] == "torch_colwise" and not checks["column_parallel"]["met"]
    assert checks["peft"]["met"] is None  # a reference, not judged


def test_margin_over_rounds_needs_one_time_per_round_on_both_sides():
    assert host.margin_over_rounds([3.0, 5.0, 4.0], [1.0, 1.0, 1.0]) == 3.0
    with pytest.raises(ValueError, match="one time per round"):
        host.margin_over_rounds([1.0, 2.0], [1.0])


def test_host_smoke_run_times_every_case_and_leaves_the_gpu_columns_null(tmp_path):
    out = tmp_path / "host.json"
    host.main(["--smoke", "--shapes", "32,64,48,4", "--out", str(out)])
    data = json.loads(out.read_text())
    impls = {r["impl"] for r in data["rows"]}
    assert impls == {"base", "parallel_lora", "peft", "torch_colwise", "torch_rowwise", "column_parallel",
                     "row_parallel"}  # fmt: skip
    assert all(KEYS <= set(r) and r["shape"] == [32, 64, 48, 4] for r in data["rows"])
    assert all(r["host_fwd_us"] > 0 and r["host_fwdbwd_us"] > 0 for r in data["rows"])
    assert all(r["gpu_fwd_us"] is None and r["gpu_fwdbwd_us"] is None for r in data["rows"])
    ours = {(r["adapter_dtype"], r["dropout"]) for r in data["rows"] if r["impl"] == "parallel_lora"}
    assert ours == {("bfloat16", 0.0), ("float32", 0.0), ("bfloat16", 0.1), ("float32", 0.1)}
    judged = [c for c in data["margins"] if c["met"] is not None]
    assert {c["impl"] for c in judged} == set(host.JUDGED) and len(judged) == 3 * 4
    assert {c["baseline"] for c in judged if c["impl"] == "row_parallel"} == {"torch_rowwise"}
    assert data["meta"]["gpu"] is None and "commit" in data["meta"]


def test_build_cases_differentiates_the_adapters_of_each_lora_case_and_nothing_of_the_baselines():
    cases = host.build_cases(64, 32, 4, "cpu", "torch", None, {"parallel_lora"})
    assert [c.impl for c in cases] == ["base"] + ["parallel_lora"] * 4  # --impls keeps the baseline
    assert cases[0].params == [] and not any(p.requires_grad for p in cases[0].module.parameters())
    for case in cases[1:]:
        assert [tuple(p.shape) for p in case.params] == [(4, 64), (32, 4)]
        assert case.params[0].dtype == case.adapter_dtype and case.module.training
        assert case.module.weight is cases[0].module.weight  # the same frozen W


def test_host_rejects_an_unknown_implementation():
    with pytest.raises(SystemExit):
        host.parse_args(["--impls", "parallel_lora,unsloth"])


def test_host_says_it_needs_a_gpu_instead_of_failing_with_a_traceback():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = subprocess.run([sys.executable, "-m", "benchmarks.host"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 1 and "needs a CUDA GPU" in out.stderr and "Traceback" not in out.stderr
