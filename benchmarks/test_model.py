"""``benchmarks.model``: its rows and targets, the step-0 check against PEFT, and the whole flow on a tiny model on
the CPU (``--smoke``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import model

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"impl", "step_ms", "ratio_to_frozen", "peak_gib", "tokens_per_s"}


def tiny_cases():
    args = model.parse_args(["--smoke"])
    cases = model.build_cases(model.build_base(args, "cpu"), args.r, args.alpha, backend="torch")
    model.set_adapters(cases, args.alpha, args.seed)
    return cases, torch.randint(args.vocab, (args.batch, args.seq_len))


@pytest.mark.slow
def test_model_smoke_run_writes_every_case_checked_against_peft(tmp_path):
    out = tmp_path / "model.json"
    model.main(["--smoke", "--compile", "--out", str(out)])  # Inductor on the CPU: every layer traced whole
    data = json.loads(out.read_text())
    rows = {row["impl"]: row for row in data["rows"]}
    assert set(rows) == {*model.IMPLS, *model.COMPILED} and all(KEYS <= set(row) for row in rows.values())
    assert rows["frozen"]["ratio_to_frozen"] == 1.0 and rows["frozen"]["peak_gib"] is None  # no CUDA: no peak
    assert rows["frozen_compiled"]["ratio_to_frozen"] == 1.0
    assert {impl for impl, row in rows.items() if "ratio_to_eager" in row} == set(model.COMPILED)
    for row in rows.values():
        assert row["step_ms"] > 0 and row["tokens_per_s"] == pytest.approx(32 / row["step_ms"] * 1e3)
    check = data["validation"]
    assert check["adapted_modules"] == 7 * 2  # seven projections in each of the two layers
    assert [(p["ours"], p["peft"]) for p in check["pairs"]] == [
        ("parallel_lora_fp32", "peft_fp32"), ("parallel_lora_bf16", "peft_bf16"),
        ("parallel_lora_autocast", "peft_fp32"), ("parallel_lora_fp32_compiled", "peft_fp32"),
    ]  # fmt: skip
    assert check["adapter_effect"] >= model.EFFECT_MIN  # B is not zero: the adapters change the logits
    assert all(p["logits_err"] <= model.LOGITS_TOL and p["grad_err"] <= model.GRAD_TOL for p in check["pairs"])
    assert {(t["measure"], t["target"]) for t in data["targets"]} == {("step / frozen", 1.08),
                                                                      ("step / peft_fp32", 0.75)}  # fmt: skip
    assert data["meta"]["model"]["hidden"] == 64 and data["meta"]["device"] == "cpu"


def test_validate_compares_each_of_ours_with_peft_of_the_same_adapter_dtype():
    cases, ids = tiny_cases()
    B = model.adapter_factors(cases["peft_bf16"].model)["model.layers.1.mlp.down_proj"][1]
    with torch.no_grad():
        B.mul_(3.0)  # only PEFT's bf16 case differs: the fp32 pairs still agree
    with pytest.raises(RuntimeError, match="parallel_lora_bf16 disagrees with peft_bf16"):
        model.validate(cases, ids)


def test_validate_refuses_adapters_too_small_to_tell_from_the_frozen_model():
    cases, ids = tiny_cases()
    with torch.no_grad():
        for name in ("peft_fp32", "parallel_lora_fp32"):
            for _, B in model.adapter_factors(cases[name].model).values():
                B.zero_()
    with pytest.raises(RuntimeError, match="the check is blind"):
        model.validate(cases, ids)


def test_set_adapters_gives_every_case_the_same_nonzero_factors():
    cases, _ = tiny_cases()
    ours = model.adapter_factors(cases["parallel_lora_fp32"].model)
    theirs = model.adapter_factors(cases["peft_bf16"].model)
    assert sorted(ours) == sorted(theirs) and len(ours) == 14
    for name, (A, B) in ours.items():
        assert B.abs().sum() > 0 and B.dtype == torch.float32
        assert torch.equal(A.bfloat16(), theirs[name][0]) and torch.equal(B.bfloat16(), theirs[name][1])


def test_model_rows_and_targets_take_each_ratio_in_its_round():
    times = {"frozen": [100.0, 200.0, 100.0], "peft_fp32": [140.0, 280.0, 150.0],
             "parallel_lora_fp32": [105.0, 210.0, 150.0]}  # fmt: skip
    rows = {r["impl"]: r for r in model.model_rows(times, 8192, {"frozen": 20.0})}
    ours = rows["parallel_lora_fp32"]
    assert ours["ratio_to_frozen"] == pytest.approx(1.05)  # rounds 1.05, 1.05, 1.5: a slow round does not move it
    assert ours["step_ms"] == 150.0 and ours["tokens_per_s"] == pytest.approx(8192 / 0.15)
    assert rows["frozen"]["peak_gib"] == 20.0 and ours["peak_gib"] is None
    checks = {c["measure"]: c for c in model.target_checks(times)}
    assert checks["step / frozen"]["met"] and checks["step / frozen"]["value"] == pytest.approx(1.05)
    assert checks["step / peft_fp32"]["value"] == pytest.approx(0.75) and checks["step / peft_fp32"]["met"]
    times["parallel_lora_fp32"][0] = 106.0  # 0.757, 0.75, 1.0: over 0.75
    assert not {c["measure"]: c for c in model.target_checks(times)}["step / peft_fp32"]["met"]


def test_compiled_rows_take_their_ratios_to_the_compiled_frozen_step_and_to_themselves_eager():
    times = {"frozen": [100.0, 100.0, 100.0], "parallel_lora_fp32": [110.0, 110.0, 110.0],
             "frozen_compiled": [80.0, 80.0, 80.0], "parallel_lora_fp32_compiled": [84.0, 88.0, 84.0]}  # fmt: skip
    rows = {r["impl"]: r for r in model.model_rows(times, 8192, {})}
    ours = rows["parallel_lora_fp32_compiled"]
    assert ours["ratio_to_frozen"] == pytest.approx(1.05) and ours["ratio_to_eager"] == pytest.approx(84 / 110)
    assert rows["frozen_compiled"]["ratio_to_eager"] == pytest.approx(0.8)
    assert "ratio_to_eager" not in rows["parallel_lora_fp32"]


def test_frozen_backward_reaches_the_first_layers_qkv_outputs_and_no_deeper():
    cases, ids = tiny_cases()
    frozen = cases["frozen"].model
    frozen(input_ids=ids, labels=ids).loss.backward()
    assert frozen.depth_marker.grad is not None  # the q, k and v outputs got gradients
    assert all(p.grad is None for name, p in frozen.named_parameters() if name != "depth_marker")


@pytest.mark.slow
def test_model_says_it_needs_a_gpu_instead_of_failing_with_a_traceback():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = subprocess.run([sys.executable, "-m", "benchmarks.model"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 1 and "needs a CUDA GPU" in out.stderr and "Traceback" not in out.stderr


def test_model_rejects_key_value_heads_that_do_not_divide_the_heads():
    with pytest.raises(SystemExit):
        model.parse_args(["--heads", "32", "--kv-heads", "5"])
