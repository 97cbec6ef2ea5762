"""``benchmarks.model``: its rows and targets, the step-0 check against PEFT, and the whole flow on a tiny model on
the CPU (``--smoke``)."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
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
    return cases, model.token_ids(args, "cpu")


@pytest.mark.slow
def test_model_smoke_run_writes_every_case_checked_against_peft(tmp_path):
    # Inductor on the CPU, every layer traced whole, in both modes (reduce-overhead: no CUDA graphs on the CPU,
    # but the same cases, ours with dropout, and each step marked).
    out = tmp_path / "model.json"
    model.main(["--smoke", "--compile-mode", "default,reduce-overhead", "--out", str(out)])
    data = json.loads(out.read_text())
    rows = {row["impl"]: row for row in data["rows"]}
    assert set(rows) == {*model.IMPLS, *model.COMPILED} and all(KEYS <= set(row) for row in rows.values())
    assert rows["frozen"]["ratio_to_frozen"] == 1.0 and rows["frozen"]["peak_gib"] is None  # no CUDA: no peak
    assert rows["frozen_compiled"]["ratio_to_frozen"] == 1.0 and rows["frozen_cudagraphs"]["ratio_to_frozen"] == 1.0
    assert {impl for impl, row in rows.items() if "ratio_to_eager" in row} == set(model.EAGER_OF)
    for row in rows.values():
        assert row["step_ms"] > 0 and row["tokens_per_s"] == pytest.approx(32 / row["step_ms"] * 1e3)
    check = data["validation"]
    assert check["adapted_modules"] == 7 * 2  # seven projections in each of the two layers
    assert [(p["ours"], p["peft"]) for p in check["pairs"]] == [
        ("parallel_lora_fp32", "peft_fp32"), ("parallel_lora_bf16", "peft_bf16"),
        ("parallel_lora_autocast", "peft_fp32"), ("parallel_lora_fp32_compiled", "peft_fp32"),
    ]  # fmt: skip
    limits = check["tolerances"]["limits"]
    assert check["adapter_effect"] >= model.EFFECT_MIN * limits["logits"]  # B is not zero: the adapters show
    assert all(p["logits_err"] <= limits["logits"] and p["grad_err"] <= limits["grads"] for p in check["pairs"])
    assert set(check["losses"]) == set(rows)
    assert all(t["finite"] for t in data["training"].values())
    assert data["training"]["parallel_lora_fp32_cudagraphs"]["falls"]  # dropout 0.1, compiled: it trains
    assert {(t["measure"], t["impl"]) for t in data["targets"]} == {
        ("step / peft_fp32", "parallel_lora_fp32"), ("last / first warm-up loss", "parallel_lora_fp32_cudagraphs")
    }  # fmt: skip  # no step targets for the smoke model
    meta = data["meta"]
    assert meta["model"]["hidden"] == 64 and meta["device"] == "cpu" and meta["model"]["tokens_per_step"] == 32
    assert meta["model"]["compile_modes"] == ["default", "reduce-overhead"] and meta["model"]["preset"] == "smoke"
    assert meta["plain"]["step_ms"] > 0 and meta["plain"]["frozen_over_plain"] > 0  # timed in a fresh process


def test_validate_compares_each_of_ours_with_peft_of_the_same_adapter_dtype():
    cases, ids = tiny_cases()
    B = model.adapter_factors(cases["parallel_lora_bf16"].model)["model.layers.1.mlp.down_proj"][1]
    with torch.no_grad():
        B.mul_(3.0)  # only our bf16 case differs: the fp32 pairs still agree
    with pytest.raises(RuntimeError, match="parallel_lora_bf16 disagrees with peft_bf16"):
        model.validate(cases, ids)


def test_validate_scales_its_limits_with_peft_bf16s_distance_from_peft_fp32():
    # bf16 rounding grows with depth: the limits follow what PEFT itself shows, not a fixed tolerance.
    cases, ids = tiny_cases()
    report = model.validate(cases, ids)
    noise, limits = report["tolerances"]["peft_bf16_from_fp32"], report["tolerances"]["limits"]
    assert noise["logits_err"] > 0 and noise["grad_err"] > 0
    assert limits["logits"] == max(model.REL_TOL * noise["logits_err"], model.FLOORS["logits"])
    assert limits["grads"] == max(model.REL_TOL * noise["grad_err"], model.FLOORS["grads"])


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
    checks = {c["measure"]: c for c in model.target_checks(times, "llama-1b", 8192)}
    assert checks["step / frozen"]["met"] and checks["step / frozen"]["value"] == pytest.approx(1.05)
    assert checks["step / frozen"]["target"] == 1.06
    assert checks["step / peft_fp32"]["value"] == pytest.approx(0.75) and checks["step / peft_fp32"]["met"]
    times["parallel_lora_fp32"][0] = 106.0  # 0.757, 0.75, 1.0: over 0.75
    assert not {c["measure"]: c for c in model.target_checks(times, "llama-1b", 8192)}["step / peft_fp32"]["met"]
    assert not model.target_checks(times, "llama-8b-4l", 8192)[0]["met"]  # 1.05 there: 1.06 is over it
    assert [c["measure"] for c in model.target_checks(times, "custom", 4096)] == ["step / peft_fp32"]


def test_compiled_rows_take_their_ratios_to_the_compiled_frozen_step_and_to_themselves_eager():
    times = {"frozen": [100.0, 100.0, 100.0], "parallel_lora_fp32": [110.0, 110.0, 110.0],
             "frozen_compiled": [80.0, 80.0, 80.0], "parallel_lora_fp32_compiled": [84.0, 88.0, 84.0],
             "frozen_cudagraphs": [50.0, 50.0, 50.0], "parallel_lora_fp32_cudagraphs": [58.0, 58.0, 58.0]}  # fmt: skip
    rows = {r["impl"]: r for r in model.model_rows(times, 8192, {})}
    ours = rows["parallel_lora_fp32_compiled"]
    assert ours["ratio_to_frozen"] == pytest.approx(1.05) and ours["ratio_to_eager"] == pytest.approx(84 / 110)
    assert rows["frozen_compiled"]["ratio_to_eager"] == pytest.approx(0.8)
    assert "ratio_to_eager" not in rows["parallel_lora_fp32"]
    graphs = rows["parallel_lora_fp32_cudagraphs"]
    assert graphs["ratio_to_frozen"] == pytest.approx(1.16) and "ratio_to_eager" not in graphs  # it has dropout
    checks = {c["measure"]: c for c in model.target_checks(times, "llama-1b", 2048)}
    assert checks["step / frozen_compiled"]["met"] and not checks["step / frozen_cudagraphs"]["met"]  # 1.16 > 1.15


def test_a_compiled_mode_that_fails_is_left_out_whole_and_reported():
    class Failing(torch.nn.Module):
        def forward(self, **kwargs):
            raise RuntimeError("Detected 2 tensor(s) in the cudagraph pool not tracked as outputs")

    frozen_name, ours_name = model.COMPILE_MODES["reduce-overhead"]
    cases = {"frozen": model.Case(torch.nn.Identity(), None), frozen_name: model.Case(torch.nn.Identity(), None),
             ours_name: model.Case(Failing(), None)}  # fmt: skip
    cases[frozen_name].model = lambda **kwargs: type("Out", (), {"loss": torch.zeros((), requires_grad=True)})()
    failed = model.drop_failing(cases, torch.zeros(1, 4, dtype=torch.long), (frozen_name, ours_name))
    assert set(failed) == {ours_name} and "cudagraph pool" in failed[ours_name]
    assert list(cases) == ["frozen"]  # the frozen graph case goes too: nothing to take the ratio to


def test_frozen_backward_reaches_the_first_layers_qkv_outputs_and_no_deeper():
    cases, ids = tiny_cases()
    frozen = cases["frozen"].model
    frozen(input_ids=ids, labels=ids).loss.backward()
    assert frozen.depth_marker.grad is not None  # the q, k and v outputs got gradients
    assert all(p.grad is None for name, p in frozen.named_parameters() if name != "depth_marker")


def test_frozen_step_keeps_no_gradient_between_steps():
    # Under CUDA graphs a gradient kept across steps would accumulate into a graph output the next replay overwrites.
    cases, ids = tiny_cases()
    model.step_fn(cases["frozen"], ids)()
    assert cases["frozen"].model.depth_marker.grad is None


@pytest.mark.slow
def test_model_says_it_needs_a_gpu_instead_of_failing_with_a_traceback():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = subprocess.run([sys.executable, "-m", "benchmarks.model"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 1 and "needs a CUDA GPU" in out.stderr and "Traceback" not in out.stderr


def test_presets_give_the_dims_and_tokens_name_the_results_file():
    args = model.parse_args(["--preset", "llama-1b", "--tokens", "2048", "--compile-mode", "reduce-overhead"])
    assert (args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim, args.vocab, args.layers) == (
        2048, 8192, 32, 8, 64, 128256, 16)  # fmt: skip
    assert (args.batch, args.seq_len, args.modes) == (1, 2048, ("reduce-overhead",))
    assert model.out_suffix(args) == "_llama-1b_2048"
    default = model.parse_args(["--compile"])
    assert (default.preset, default.hidden, default.layers, default.vocab, default.seq_len) == (
        "llama-8b-4l", 4096, 4, 32000, 8192)  # fmt: skip
    assert default.modes == ("default",)
    custom = model.parse_args(["--preset", "llama-1b", "--layers", "8", "--batch", "2", "--tokens", "8192"])
    assert (custom.preset, custom.layers, custom.seq_len) == ("custom", 8, 4096)
    assert model.out_suffix(custom) == "_custom_8192"
    for bad in (["--compile-mode", "max-autotune"], ["--batch", "3", "--tokens", "8192"]):
        with pytest.raises(SystemExit):
            model.parse_args(bad)


def test_model_rejects_key_value_heads_that_do_not_divide_the_heads():
    with pytest.raises(SystemExit):
        model.parse_args(["--heads", "32", "--kv-heads", "5"])


def test_cases_with_adapters_step_fused_adamw_over_the_trainable_parameters_only():
    layer = torch.nn.Linear(4, 4)
    layer.bias.requires_grad_(False)
    optimizer = model.adamw(layer)
    assert optimizer.defaults["fused"] is True
    assert [p for group in optimizer.param_groups for p in group["params"]] == [layer.weight]


def test_kernel_groups_name_who_launched_each_kernel():
    named = {
        "_dx_and_grads_kernel": "parallel_lora", "_lora_shrink_db_kernel": "parallel_lora",
        "_shrink_gemm_kernel": "parallel_lora", "triton_poi_fused__to_copy_add_mul_0": "inductor",
        "triton_tem_fused_mm_1": "inductor", "nvjet_sm90_tst_256x128_64x4_1x2_h_bz": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas": "gemm",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "gemm",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t>>":
            "attention",
        "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor>":
            "optimizer",
        "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<c10::BFloat16>>": "other",
    }  # fmt: skip
    assert {name: model.kernel_group(name) for name in named} == named


def test_gpu_ms_by_group_sums_each_groups_kernels_per_step():
    ms = model.gpu_ms_by_group({"_dx_and_grads_kernel": 300.0, "_lora_shrink_db_kernel": 30.0,
                                "nvjet_sm90_tst_x": 1200.0, "elementwise_x": 70.0})  # fmt: skip
    assert ms["parallel_lora"] == pytest.approx(0.33) and ms["gemm"] == pytest.approx(1.2)
    assert ms["other"] == pytest.approx(0.07) and ms["attention"] == 0.0 and ms["total"] == pytest.approx(1.6)
    assert list(ms) == [*(group for group, _ in model.KERNEL_GROUPS), "other", "total"]


def test_every_kernel_the_package_launches_groups_as_ours():
    import importlib
    import pkgutil

    from triton.runtime.jit import KernelInterface  # JITFunction, or InterpretedFunction under TRITON_INTERPRET

    import parallel_lora.kernels as kernels

    modules = [importlib.import_module(f"{kernels.__name__}.{m.name}") for m in pkgutil.iter_modules(kernels.__path__)]
    launched = {obj.fn.__name__ for mod in modules for obj in vars(mod).values()
                if isinstance(obj, KernelInterface) and obj.fn.__name__.endswith("_kernel")}  # fmt: skip
    assert len(launched) >= 6 and {model.kernel_group(name) for name in launched} == {"parallel_lora"}


def test_profile_puts_each_cases_gpu_time_by_group_in_its_row(monkeypatch, capsys):
    seen = []

    def fake_kernel_us(step, calls):
        seen.append(calls)
        return {"_shrink_gemm_kernel": 50.0, "nvjet_sm90_x": 950.0}

    monkeypatch.setattr(model, "kernel_us", fake_kernel_us)
    args = model.parse_args(["--smoke", "--no-plain-check"])
    args.profile = True  # the parser refuses it with --smoke: on the CPU there are no kernels to read
    rows = model.run(args, [])["rows"]
    assert len(seen) == len(rows) == len(model.IMPLS) and set(seen) == {args.calls}
    assert all(row["gpu_ms_by_group"]["total"] == pytest.approx(1.0) for row in rows)
    assert "GPU ms per step by kernel group" in capsys.readouterr().out


def test_profile_is_refused_on_the_cpu_smoke_run(capsys):
    with pytest.raises(SystemExit):
        model.parse_args(["--smoke", "--profile"])
    assert "--profile reads GPU kernels" in capsys.readouterr().err


def test_a_profile_that_fails_is_reported_in_its_row_not_raised(monkeypatch):
    def broken(step, calls):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    monkeypatch.setattr(model, "kernel_us", broken)
    assert model.profile_groups(lambda: None, 2) == {"error": "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"}


def test_probe_times_its_step_without_sync_debug_mode_and_counts_syncs_in_another(monkeypatch):
    modes, allocs = [0], iter([{"num_device_alloc": 5}, {"num_device_alloc": 7}])
    seen = []

    def step():
        seen.append(modes[-1])
        if modes[-1] == "warn":
            warnings.warn("called a synchronizing CUDA operation", stacklevel=2)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: next(allocs))
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    probed = model.probe(step)
    assert seen == [0, "warn"] and modes[-1] == 0  # the timed step ran with the debug mode off, and it is off after
    assert probed["syncs"] == 1 and probed["num_device_alloc"] == 2 and probed["host_issue_ms"] >= 0
