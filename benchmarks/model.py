"""One training step of a Llama-family transformers model: LoRA on all seven projections against the frozen model
and against PEFT, side by side in one process on the same data (needs CUDA).

    python -m benchmarks.model                          # 4 decoder layers at Llama-3-8B's dimensions, 8192 tokens
    python -m benchmarks.model --layers 8 --vocab 128256 --batch 2 --seq-len 4096
    python -m benchmarks.model --compile                # also each case's decoder layers under torch.compile
    python -m benchmarks.model --smoke --out /tmp/model.json   # a tiny model on the CPU: the flow, no timings to read

The model is ``LlamaForCausalLM`` with random weights (hidden 4096, intermediate 14336, 32 heads / 8 key-value
heads of 128, vocab 32000 by default), bf16 base, SDPA attention, causal-LM loss on random tokens. The cases:

- ``frozen``                  forward+backward of the model with nothing to train. Its backward runs from the loss
                              down to the first layer's q, k and v outputs, the depth LoRA's gradients reach: the
                              base's share of a LoRA step's backward. A forward hook adds a trainable zero scalar to
                              each of those outputs (a hook that calls ``requires_grad_`` cannot be compiled); it
                              costs three elementwise passes and three sums, ~0.2% of the step.
- ``peft_fp32``               PEFT as shipped: ``LoraConfig(r=16, lora_alpha=32)`` on the seven projections, fp32
                              adapters (``autocast_adapter_dtype=True``), AdamW on the adapters.
- ``peft_bf16``               the same with bf16 adapters (``autocast_adapter_dtype=False``).
- ``parallel_lora_fp32``      ``apply_lora`` with ``LoRAConfig(r=16, alpha=32, lora_dtype=torch.float32)``, AdamW.
- ``parallel_lora_bf16``      the same with bf16 adapters.
- ``parallel_lora_autocast``  fp32 adapters, forward under ``torch.autocast("cuda", torch.bfloat16)``.
- with ``--compile``, ``frozen_compiled`` and ``parallel_lora_fp32_compiled``: those cases with every decoder layer
  compiled as torchtitan does, ``layer.compile(fullgraph=True)`` (Inductor); their ``ratio_to_frozen`` is taken to
  ``frozen_compiled``, and ``ratio_to_eager`` to the same case uncompiled.

Every case wraps the same base weights (one copy on the GPU, shared) with the same adapters: A and B drawn once
(B non-zero, so the adapters change the logits). Before timing, each LoRA case's step-0 loss, logits and adapter
gradients are checked against PEFT's with the same adapter dtype (autocast and compiled against PEFT fp32), and the
adapters must move the logits well beyond that tolerance.

A step is forward, backward, ``AdamW.step`` and ``zero_grad``. After warm-up steps (Triton's tuning, the
optimizer's state), every case is timed once per round in interleaved rounds, steps back to back between CUDA
events; ``ratio_to_frozen`` is the median over rounds of the step over the frozen step of the same round
(``benchmarks.common`` says why). ``peak_gib``: the base weights, the case's adapters and optimizer state, and the
most one step allocates beyond what was allocated before it (``torch.cuda.max_memory_allocated``): what a process
training that case alone would peak at. Prints a table, then the model-step targets of docs/design.md, met or not,
and writes ``{"meta", "validation", "rows", "targets"}`` to ``benchmarks/results/model_<gpu>.json``.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from benchmarks.common import (
    back_to_back_ms,
    module_command,
    ratio_over_rounds,
    require_cuda,
    results_path,
    run_meta,
    time_in_rounds,
    write_json,
)
from parallel_lora import LoRAConfig, LoRALinear, apply_lora

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IMPLS = ("frozen", "peft_fp32", "peft_bf16", "parallel_lora_fp32", "parallel_lora_bf16", "parallel_lora_autocast")
# Each of ours against PEFT with the same adapter dtype; autocast runs fp32 adapters.
PAIRS = (("parallel_lora_fp32", "peft_fp32"), ("parallel_lora_bf16", "peft_bf16"),
         ("parallel_lora_autocast", "peft_fp32"))  # fmt: skip
COMPILED = ("frozen_compiled", "parallel_lora_fp32_compiled")  # --compile: these cases' layers compiled
COMPILED_PAIR = ("parallel_lora_fp32_compiled", "peft_fp32")
# Model-step targets of docs/design.md, "Numbers": (measure, case, baseline, most allowed).
TARGETS = (("step / frozen", "parallel_lora_fp32", "frozen", 1.08),
           ("step / peft_fp32", "parallel_lora_fp32", "peft_fp32", 0.75))  # fmt: skip
LOSS_RTOL, LOGITS_TOL, GRAD_TOL = 5e-3, 5e-2, 5e-2  # ours against PEFT, bf16 rounding through the layers
EFFECT_MIN = 4 * LOGITS_TOL  # the adapters must move the logits this much, or the check could not see them
ADAPTER_SHARE = 0.5  # the adapter update's size, as a share of each projection's base output
SMOKE = {"hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "head_dim": 16, "vocab": 128, "layers": 2,
         "batch": 1, "seq_len": 32, "rounds": 1, "calls": 1, "batches": 1, "warmup": 1}  # fmt: skip


@dataclass
class Case:
    """One way to train the model: its module, its optimizer (None: nothing to train) and whether it autocasts."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    autocast: bool = False


def build_base(args: argparse.Namespace, device: str) -> nn.Module:
    """A random bf16 ``LlamaForCausalLM`` of ``args``' dimensions on ``device``, seeded with ``args.seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, vocab_size=args.vocab,
        num_hidden_layers=args.layers, max_position_embeddings=args.seq_len, tie_word_embeddings=False,
        use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(args.seed)
    with torch.device(device):  # bf16 weights drawn in place; RoPE's frequencies stay fp32, as when loaded
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    return model.train()


def shell(base: nn.Module) -> nn.Module:
    """A copy of ``base``'s modules holding ``base``'s own parameters and buffers: every case wraps the same
    weights, stored once."""
    shared = {id(t): t for t in [*base.parameters(), *base.buffers()]}
    return copy.deepcopy(base, memo=shared)


def reach_first_layer(model: nn.Module) -> None:
    """Make the frozen model's backward run as deep as LoRA's: the first layer's q, k and v outputs get a trainable
    zero added (LoRA's gradients need those outputs' gradients; nothing below them is trained). A parameter, not
    ``requires_grad_`` on the output, so that a compiled layer traces it."""
    zero = nn.Parameter(torch.zeros((), dtype=model.dtype, device=model.device))
    model.register_parameter("depth_marker", zero)

    def mark(module, inputs, output):
        return output + zero

    attn = model.model.layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(attn, name).register_forward_hook(mark)


def compile_layers(model: nn.Module) -> nn.Module:
    """Compile each decoder layer of ``model`` in place with ``fullgraph=True`` (a graph break is an error)."""
    for layer in model.model.layers:
        layer.compile(fullgraph=True)
    return model


def adapter_factors(model: nn.Module) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
    """``{base module name: (A [r, in], B [out, r])}`` of ours or PEFT's adapters, named as in the bare model."""
    from peft.tuners.lora import LoraLayer

    factors = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            factors[name] = (module.lora_A.weight, module.lora_B.weight)
        elif isinstance(module, LoraLayer):
            factors[name.removeprefix("base_model.model.")] = (
                module.lora_A["default"].weight, module.lora_B["default"].weight)  # fmt: skip
    return factors


def build_cases(base: nn.Module, r: int, alpha: float, backend: str, compiled: bool = False) -> dict[str, Case]:
    """Every case of ``IMPLS`` (and ``COMPILED`` if ``compiled``) over ``base``'s weights, its adapters at their
    libraries' initial values."""
    import peft

    def peft_case(autocast_adapter_dtype: bool) -> Case:
        config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(PROJECTIONS))
        model = peft.get_peft_model(shell(base), config, autocast_adapter_dtype=autocast_adapter_dtype)
        return Case(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))

    def ours(lora_dtype: torch.dtype, autocast: bool = False) -> Case:
        config = LoRAConfig(r=r, alpha=alpha, lora_dtype=lora_dtype, backend=backend, target_modules=PROJECTIONS)
        model = apply_lora(shell(base), config, verbose=False)
        return Case(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]), autocast)

    def frozen() -> Case:
        model = shell(base)
        for p in model.parameters():
            p.requires_grad_(False)
        reach_first_layer(model)
        return Case(model, None)

    cases = {
        "frozen": frozen(), "peft_fp32": peft_case(True), "peft_bf16": peft_case(False),
        "parallel_lora_fp32": ours(torch.float32), "parallel_lora_bf16": ours(torch.bfloat16),
        "parallel_lora_autocast": ours(torch.float32, autocast=True),
    }  # fmt: skip
    if compiled:
        cases["frozen_compiled"] = frozen()
        cases["parallel_lora_fp32_compiled"] = ours(torch.float32)
        for name in COMPILED:
            compile_layers(cases[name].model)
    return cases


def set_adapters(cases: dict[str, Case], alpha: float, seed: int) -> int:
    """The same A and B in every case with adapters, drawn once in fp32: A ~ N(0, 1/in), B sized so each
    projection's update is ``ADAPTER_SHARE`` of its base output. Returns the number of adapted modules."""
    factors = {name: adapter_factors(case.model) for name, case in cases.items() if case.optimizer is not None}
    names = sorted(factors["parallel_lora_fp32"])
    base = cases["frozen"].model
    for impl, found in factors.items():
        if sorted(found) != names:
            raise RuntimeError(f"{impl} adapts {sorted(found)[:3]}..., expected the modules {names[:3]}...")
    generator = torch.Generator(base.device).manual_seed(seed)
    with torch.no_grad():
        for name in names:
            W = base.get_submodule(name).weight.float()
            (out_features, in_features), r = W.shape, factors["parallel_lora_fp32"][name][0].shape[0]
            A = torch.randn(r, in_features, generator=generator, device=W.device) / math.sqrt(in_features)
            B = torch.randn(out_features, r, generator=generator, device=W.device)
            B *= ADAPTER_SHARE * W.std() * math.sqrt(in_features) / ((alpha / r) * math.sqrt(r))
            for found in factors.values():
                found[name][0].copy_(A)
                found[name][1].copy_(B)
    return len(names)


def step_fn(case: Case, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One training step of ``case`` on ``ids`` (also the labels): forward (under autocast if the case says so),
    backward, ``AdamW.step``, ``zero_grad``. Returns the loss."""

    def step() -> torch.Tensor:
        with torch.autocast(ids.device.type, torch.bfloat16, enabled=case.autocast):
            loss = case.model(input_ids=ids, labels=ids).loss
        loss.backward()
        if case.optimizer is not None:
            case.optimizer.step()
            case.optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def rel_err(x: torch.Tensor, ref: torch.Tensor, rows: int = 1024) -> float:
    """``||x - ref|| / ||ref||`` in fp32, ``rows`` of the flattened tensors at a time (logits can be GiBs)."""
    x, ref = x.reshape(-1, x.shape[-1]), ref.reshape(-1, ref.shape[-1])
    num = den = 0.0
    for i in range(0, ref.shape[0], rows):
        a, b = x[i : i + rows].float(), ref[i : i + rows].float()
        num += (a - b).square().sum().item()
        den += b.square().sum().item()
    return math.sqrt(num / den)


def first_step(case: Case, ids: torch.Tensor) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, logits, {adapter name: gradient})`` of ``case``'s step 0, without the optimizer step."""
    with torch.autocast(ids.device.type, torch.bfloat16, enabled=case.autocast):
        out = case.model(input_ids=ids, labels=ids)
    grads = {}
    if case.optimizer is not None:
        out.loss.backward()
        for name, (A, B) in adapter_factors(case.model).items():
            grads[f"{name}.A"], grads[f"{name}.B"] = A.grad.float(), B.grad.float()
        case.optimizer.zero_grad(set_to_none=True)
    return out.loss.item(), out.logits.detach(), grads


def validate(cases: dict[str, Case], ids: torch.Tensor) -> dict:
    """Each of ours against PEFT at step 0 (``PAIRS``): loss, logits and adapter gradients, and how far the
    adapters move the logits from the frozen model's. Raises ``RuntimeError`` on a disagreement."""
    firsts = {name: first_step(case, ids) for name, case in cases.items()}
    effect = rel_err(firsts["peft_fp32"][1], firsts["frozen"][1])
    pairs = []
    for ours, peft_name in PAIRS + ((COMPILED_PAIR,) if COMPILED_PAIR[0] in cases else ()):
        (loss, logits, grads), (ref_loss, ref_logits, ref_grads) = firsts[ours], firsts[peft_name]
        if sorted(grads) != sorted(ref_grads):
            raise RuntimeError(f"{ours} and {peft_name} train different adapters")
        names = sorted(ref_grads)
        grad_err = rel_err(torch.cat([grads[n].flatten() for n in names])[None],
                           torch.cat([ref_grads[n].flatten() for n in names])[None])  # fmt: skip
        pairs.append({"ours": ours, "peft": peft_name, "loss": loss, "peft_loss": ref_loss,
                      "loss_diff": abs(loss - ref_loss), "logits_err": rel_err(logits, ref_logits),
                      "grad_err": grad_err})  # fmt: skip
    report = {
        "losses": {name: first[0] for name, first in firsts.items()}, "pairs": pairs, "adapter_effect": effect,
        "tolerances": {"loss_rtol": LOSS_RTOL, "logits": LOGITS_TOL, "grads": GRAD_TOL, "effect_min": EFFECT_MIN},
    }  # fmt: skip
    if not effect >= EFFECT_MIN:
        raise RuntimeError(f"the adapters move the logits by {effect:.3g} only (< {EFFECT_MIN}): the check is blind")
    for p in pairs:
        if not (p["loss_diff"] <= LOSS_RTOL * abs(p["peft_loss"]) and p["logits_err"] <= LOGITS_TOL
                and p["grad_err"] <= GRAD_TOL):  # fmt: skip
            raise RuntimeError(f"{p['ours']} disagrees with {p['peft']} at step 0: loss {p['loss']:.5f} against "
                               f"{p['peft_loss']:.5f}, logits rel err {p['logits_err']:.3g}, "
                               f"adapter gradients rel err {p['grad_err']:.3g}")  # fmt: skip
    return report


def held_bytes(case: Case) -> int:
    """Bytes a case keeps between steps beyond the shared base: its adapters and their optimizer state."""
    if case.optimizer is None:
        return 0
    params = [p for group in case.optimizer.param_groups for p in group["params"]]
    state = [t for s in case.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in [*params, *state])


def step_peaks_gib(cases: dict[str, Case], steps: dict[str, Callable], base: nn.Module) -> dict[str, float]:
    """``{case: GiB}``: the base's weights, the case's held bytes, and the most one step allocates above what was
    allocated before it."""
    weights = sum(t.numel() * t.element_size() for t in [*base.parameters(), *base.buffers()])
    peaks = {}
    for name, step in steps.items():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - before + weights + held_bytes(cases[name])) / 2**30
    return peaks


def wall_ms(fn: Callable[[], object]) -> float:
    """Wall-clock ms of one call: the smoke run's stand-in for CUDA events."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def model_rows(times: dict[str, list[float]], tokens: int, peaks: dict[str, float | None]) -> list[dict]:
    """One row per case from its per-round step times (ms), each ratio taken to the frozen step of its round (the
    compiled frozen step for a compiled case, which also gets ``ratio_to_eager``: to itself uncompiled)."""
    rows = []
    for impl, ms in times.items():
        step_ms = statistics.median(ms)
        compiled = impl in COMPILED
        row = {
            "impl": impl, "step_ms": step_ms,
            "ratio_to_frozen": ratio_over_rounds(ms, times["frozen_compiled" if compiled else "frozen"]),
            "peak_gib": peaks.get(impl), "tokens_per_s": tokens / step_ms * 1e3, "step_ms_rounds": ms,
        }  # fmt: skip
        if compiled:
            row["ratio_to_eager"] = ratio_over_rounds(ms, times[impl.removesuffix("_compiled")])
        rows.append(row)
    return rows


def target_checks(times: dict[str, list[float]]) -> list[dict]:
    """The model-step targets of docs/design.md as ``{"measure", "impl", "value", "target", "met"}``."""
    return [
        {"measure": measure, "impl": impl, "value": (v := ratio_over_rounds(times[impl], times[base])),
         "target": target, "met": v <= target}
        for measure, impl, base, target in TARGETS
    ]  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    """Build, validate, warm up and time every case; print the table and targets. Returns what is written."""
    device = "cpu" if args.smoke else "cuda"
    base = build_base(args, device)
    cases = build_cases(base, args.r, args.alpha, backend="torch" if args.smoke else "triton", compiled=args.compile)
    adapted = set_adapters(cases, args.alpha, args.seed)
    ids = torch.randint(args.vocab, (args.batch, args.seq_len), device=device)
    validation = validate(cases, ids)
    validation["adapted_modules"] = adapted
    for p in validation["pairs"]:
        print(f"step 0, {p['ours']} against {p['peft']}: loss {p['loss']:.5f} / {p['peft_loss']:.5f}, logits rel "
              f"err {p['logits_err']:.2e}, adapter grads rel err {p['grad_err']:.2e}", flush=True)  # fmt: skip
    steps = {name: step_fn(case, ids) for name, case in cases.items()}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    if args.smoke:
        time_one, timing, peaks = wall_ms, "smoke: wall clock, one step per round, on the CPU", {}
    else:
        peaks = step_peaks_gib(cases, steps, base)
        time_one = lambda fn: back_to_back_ms(fn, args.calls, args.batches)  # noqa: E731
        timing = (f"steps back to back, {args.calls} per CUDA event pair, median of {args.batches}, "
                  f"{args.rounds} interleaved rounds, {args.warmup} warm-up steps each")  # fmt: skip
    times = time_in_rounds(steps, args.rounds, time_one)
    rows = model_rows(times, args.batch * args.seq_len, peaks)
    targets = target_checks(times)
    print(f"\n{'impl':>27} {'step_ms':>9} {'x frozen':>8} {'x eager':>7} {'tokens/s':>9} {'peak_GiB':>8}")
    for row in rows:
        peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.2f}"
        eager = f"{row['ratio_to_eager']:.3f}" if "ratio_to_eager" in row else "-"
        print(f"{row['impl']:>27} {row['step_ms']:9.2f} {row['ratio_to_frozen']:8.3f} {eager:>7} "
              f"{row['tokens_per_s']:9.0f} {peak:>8}")  # fmt: skip
    print("\nmodel-step targets of docs/design.md")
    for t in targets:
        print(f"{t['impl']:>22} {t['measure']:>17} {t['value']:6.3f} <= {t['target']:.2f} "
              f"{'met' if t['met'] else 'NOT met'}")  # fmt: skip
    dims = {k: getattr(args, k) for k in ("hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab",
                                          "layers", "batch", "seq_len", "r", "alpha", "compile")}  # fmt: skip
    command = module_command("benchmarks.model")
    meta = ({"command": command, "timing": timing, "device": "cpu", "torch": torch.__version__, "model": dims}
            if args.smoke else run_meta(command, timing, model=dims))  # fmt: skip
    return {"meta": meta, "validation": validation, "rows": rows, "targets": targets}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.model", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for flag, default, text in (
        ("--layers", 4, "decoder layers"), ("--hidden", 4096, "hidden size"),
        ("--intermediate", 14336, "MLP intermediate size"), ("--heads", 32, "attention heads"),
        ("--kv-heads", 8, "key-value heads (divides --heads)"), ("--head-dim", 128, "per-head dimension"),
        ("--vocab", 32000, "vocabulary (128256: Llama 3's)"), ("--batch", 1, "sequences per step"),
        ("--seq-len", 8192, "tokens per sequence"), ("--r", 16, "LoRA rank"), ("--alpha", 32, "LoRA alpha"),
        ("--rounds", 5, "interleaved timing rounds (medians)"), ("--calls", 2, "steps back to back per event pair"),
        ("--batches", 3, "event pairs per measurement (their median)"),
        ("--warmup", 3, "untimed steps per case first (tuning, optimizer state)"),
    ):  # fmt: skip
        parser.add_argument(flag, type=int, default=default, help=f"{text} (default {default})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, adapters and tokens")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time frozen and parallel_lora_fp32 with each decoder layer compiled",
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, one step per case: the flow")
    parser.add_argument("--out", default="", help="JSON path (default benchmarks/results/model_<gpu>.json; "
                                                  "--smoke writes only with --out)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    positive = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab", "batch", "seq_len",
                "r", "alpha", "rounds", "calls", "batches")  # fmt: skip
    bad = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in positive if getattr(args, k) < 1]
    if bad or args.warmup < 0:
        parser.error(f"expected positive integers (--warmup >= 0), got {', '.join(bad) or f'--warmup {args.warmup}'}")
    if args.heads % args.kv_heads:
        parser.error(f"--kv-heads must divide --heads, got {args.kv_heads} and {args.heads}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not args.smoke:
        require_cuda("python -m benchmarks.model")
    data = run(args)
    out = Path(args.out) if args.out else None if args.smoke else results_path("model")
    if out is not None:
        write_json(out, data)
        print(f"wrote {out}")
    return data


if __name__ == "__main__":
    main()
