"""One training step of a Llama-family transformers model: LoRA on all seven projections against the frozen model
and against PEFT, side by side in one process on the same data (needs CUDA).

    python -m benchmarks.model                          # --preset llama-8b-4l --tokens 8192
    python -m benchmarks.model --preset llama-1b --tokens 2048 --compile-mode default,reduce-overhead
    python -m benchmarks.model --preset llama-1b --layers 8 --batch 2 --tokens 8192   # a preset's dims overridden
    python -m benchmarks.model --preset llama-1b --tokens 2048 --profile   # and each case's GPU time by kernel group
    python -m benchmarks.model --smoke --out /tmp/model.json   # a tiny model on the CPU: the flow, no timings to read

The model is ``LlamaForCausalLM`` with random weights, bf16 base, SDPA attention, causal-LM loss on random tokens,
at a preset's dimensions (``PRESETS``): ``llama-8b-4l`` (the default) is Llama-3-8B's (hidden 4096, intermediate
14336, 32 heads / 8 key-value heads of 128) with 4 decoder layers and vocab 32000; ``llama-1b`` is Llama-3.2-1B's
(hidden 2048, intermediate 8192, 32 heads / 8 key-value heads of 64, 16 layers, vocab 128256). ``--tokens`` per
step (``--batch`` sequences of ``tokens / batch``). The cases:

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
- with ``--compile-mode default`` (or ``--compile``), ``frozen_compiled`` and ``parallel_lora_fp32_compiled``:
  those cases with every decoder layer compiled as torchtitan does, ``layer.compile(fullgraph=True)`` (Inductor);
  their ``ratio_to_frozen`` is taken to ``frozen_compiled``, and ``ratio_to_eager`` to the same case uncompiled.
- with ``--compile-mode reduce-overhead``, ``frozen_cudagraphs`` and ``parallel_lora_fp32_cudagraphs``: each layer
  ``layer.compile(fullgraph=True, mode="reduce-overhead")`` (Inductor's CUDA graphs; every step marked with
  ``torch.compiler.cudagraph_mark_step_begin()``), ours with fp32 adapters and dropout 0.1, fresh masks each
  replay; ratio to ``frozen_cudagraphs``. ``--compile-mode default,reduce-overhead`` times both.

Every case wraps the same base weights (one copy on the GPU, shared) with the same adapters: A and B drawn once
(B non-zero, so the adapters change the logits). Before timing, each LoRA case's step-0 loss, logits and adapter
gradients are checked against PEFT's with the same adapter dtype (autocast and compiled against PEFT fp32): ours
may be at most ``REL_TOL`` times as far from PEFT as PEFT bf16 is from PEFT fp32 (bf16 rounding grows through the
layers, so a fixed tolerance fails at depth), and the adapters must move the logits well beyond that. The warm-up
steps must train: every loss finite, and the CUDA-graph case's falling.

A step is forward, backward, ``AdamW.step`` and ``zero_grad``. Every case with adapters steps
``torch.optim.AdamW(fused=True)``, as torchtune's LoRA recipes configure it: one fused op for all the adapters,
where the default (foreach) optimizer issues a dozen per group from Python. After warm-up steps (Triton's tuning, the
optimizer's state), every case is timed once per round in interleaved rounds, steps back to back between CUDA
events; ``ratio_to_frozen`` is the median over rounds of the step over the frozen step of the same round
(``benchmarks.common`` says why). ``peak_gib``: the base weights, the case's adapters and optimizer state, and the
most one step allocates beyond what was allocated before it (``torch.cuda.max_memory_allocated``): what a process
training that case alone would peak at. Prints a table, then the model-step targets of docs/design.md, met or not,
and writes ``{"meta", "validation", "training", "rows", "targets"}`` to
``benchmarks/results/model_<gpu>_<preset>_<tokens>.json``.

The harness times what a plain loop runs: before anything else, a fresh process times a plain transformers loop
(``AutoModelForCausalLM.from_config``, frozen, ``enable_input_require_grads``, ``loss.backward()``, nothing else)
the same way, and ``meta["plain"]`` holds ``frozen_over_plain`` (must be within ``PLAIN_MAX``). Timed steps run
with the garbage collector paused and the objects of set-up frozen out of its scans (``gc.freeze``); each case's
row also holds a probe: one step's host issue time and device allocations, another's synchronizing calls. With
``--profile``, each row also holds ``gpu_ms_by_group``: the GPU time of ``--calls`` more steps per step, by kernel
group (``KERNEL_GROUPS``: ours, Inductor's, attention, the optimizer, cuBLAS GEMMs, the rest), beside which the
step time and the host issue time tell whether a step waits on the host or on a group of kernels.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from benchmarks.common import (
    back_to_back_ms,
    gc_paused,
    kernel_us,
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
ROOT = Path(__file__).resolve().parents[1]
PRESETS = {
    "llama-8b-4l": {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128,
                    "vocab": 32000, "layers": 4},
    "llama-1b": {"hidden": 2048, "intermediate": 8192, "heads": 32, "kv_heads": 8, "head_dim": 64,
                 "vocab": 128256, "layers": 16},
}  # fmt: skip
DIMS = tuple(PRESETS["llama-1b"])
# --compile-mode: the cases each mode adds, their layers compiled in that mode; ours under CUDA graphs with dropout.
COMPILE_MODES = {"default": ("frozen_compiled", "parallel_lora_fp32_compiled"),
                 "reduce-overhead": ("frozen_cudagraphs", "parallel_lora_fp32_cudagraphs")}  # fmt: skip
COMPILED = tuple(name for names in COMPILE_MODES.values() for name in names)
FROZEN_OF = {name: names[0] for names in COMPILE_MODES.values() for name in names}  # each mode's frozen step
# The same case uncompiled (ours under CUDA graphs has dropout, its eager case none: no such ratio).
EAGER_OF = {"frozen_compiled": "frozen", "parallel_lora_fp32_compiled": "parallel_lora_fp32",
            "frozen_cudagraphs": "frozen"}  # fmt: skip
COMPILED_PAIR = ("parallel_lora_fp32_compiled", "peft_fp32")
GRAPH_DROPOUT = 0.1
# Model-step targets of docs/design.md, "Numbers", per (preset, tokens): most allowed step / frozen step, eager and
# compiled (each compiled mode against its own frozen step); and against PEFT fp32 in every run.
STEP_TARGETS = {("llama-1b", 2048): (1.12, 1.15), ("llama-1b", 8192): (1.06, None),
                ("llama-8b-4l", 8192): (1.05, None)}  # fmt: skip
PEFT_TARGET = 0.75
# The step-0 check: ours may be REL_TOL times as far from PEFT as PEFT bf16 is from PEFT fp32 (both a bf16 rounding
# of the same model, grown alike through the layers), and never need be closer than the floors. Wrong math moves the
# logits by the adapters' effect, which must be EFFECT_MIN times the logits' limit.
REL_TOL = 3.0
FLOORS = {"loss": 1e-4, "logits": 1e-3, "grads": 1e-3}  # loss: relative to PEFT's loss
EFFECT_MIN = 4.0
PLAIN_MAX = 1.03  # the frozen step over a plain loop's, each in its own process
ADAPTER_SHARE = 0.5  # the adapter update's size, as a share of each projection's base output
# ``--profile``: a step's GPU kernels by who launches them, each kernel in the first group one of whose keys its
# lowercased name contains, else in ``other`` (elementwise, norms, the loss, copies).
KERNEL_GROUPS = (
    ("parallel_lora", ("_lora_", "_dx_and_grads_kernel", "_shrink_gemm_kernel")),
    ("inductor", ("triton_",)),
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("optimizer", ("adam", "multi_tensor")),
    ("gemm", ("nvjet", "gemm", "xmma", "cutlass", "cublas", "splitk")),
)
GROUP_NAMES = (*(group for group, _ in KERNEL_GROUPS), "other")
SMOKE = {"hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "head_dim": 16, "vocab": 128, "layers": 2,
         "batch": 1, "tokens": 32, "rounds": 1, "calls": 1, "batches": 1, "warmup": 2}  # fmt: skip


@dataclass
class Case:
    """One way to train the model: its module, its optimizer (None: nothing to train), whether it autocasts and
    whether its layers run as CUDA graphs (each step then marks its start)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    autocast: bool = False
    cudagraphs: bool = False
    marker: nn.Parameter | None = None  # the frozen model's ``reach_first_layer`` zero, its gradient dropped each step


def llama_config(args: argparse.Namespace):
    """The ``LlamaConfig`` of ``args``' dimensions (no KV cache, SDPA attention, untied head)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, vocab_size=args.vocab,
        num_hidden_layers=args.layers, max_position_embeddings=args.seq_len, tie_word_embeddings=False,
        use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip


def build_base(args: argparse.Namespace, device: str) -> nn.Module:
    """A random bf16 ``LlamaForCausalLM`` of ``args``' dimensions on ``device``, seeded with ``args.seed``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    with torch.device(device):  # bf16 weights drawn in place; RoPE's frequencies stay fp32, as when loaded
        model = LlamaForCausalLM._from_config(llama_config(args), dtype=torch.bfloat16)
    return model.train()


def token_ids(args: argparse.Namespace, device: str) -> torch.Tensor:
    """The step's ``[batch, tokens / batch]`` random token ids (also the labels), the same in every process."""
    generator = torch.Generator(device).manual_seed(args.seed + 1)
    return torch.randint(args.vocab, (args.batch, args.seq_len), device=device, generator=generator)


def shell(base: nn.Module) -> nn.Module:
    """A copy of ``base``'s modules holding ``base``'s own parameters and buffers: every case wraps the same
    weights, stored once."""
    shared = {id(t): t for t in [*base.parameters(), *base.buffers()]}
    return copy.deepcopy(base, memo=shared)


def reach_first_layer(model: nn.Module) -> nn.Parameter:
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
    return zero


def compile_layers(model: nn.Module, mode: str = "default") -> nn.Module:
    """Compile each decoder layer of ``model`` in place with ``fullgraph=True`` (a graph break is an error) in
    Inductor's ``mode``."""
    import torch._dynamo.config as dynamo_config

    # One process compiles every case's layers, several graphs of one code object (a plain run compiles one or two).
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    for layer in model.model.layers:
        layer.compile(fullgraph=True, mode=None if mode == "default" else mode)
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


def adamw(model: nn.Module) -> torch.optim.AdamW:
    """The optimizer of a case with adapters: fused AdamW over its trainable parameters."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True)


def build_cases(base: nn.Module, r: int, alpha: float, backend: str, modes: tuple[str, ...] = ()) -> dict[str, Case]:
    """Every case of ``IMPLS`` (and those of each of ``COMPILE_MODES``' ``modes``) over ``base``'s weights, its
    adapters at their libraries' initial values."""
    import peft

    def peft_case(autocast_adapter_dtype: bool) -> Case:
        config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(PROJECTIONS))
        model = peft.get_peft_model(shell(base), config, autocast_adapter_dtype=autocast_adapter_dtype)
        return Case(model, adamw(model))

    def ours(lora_dtype: torch.dtype, autocast: bool = False, dropout: float = 0.0) -> Case:
        config = LoRAConfig(r=r, alpha=alpha, dropout=dropout, lora_dtype=lora_dtype, backend=backend,
                            target_modules=PROJECTIONS)  # fmt: skip
        model = apply_lora(shell(base), config, verbose=False)
        return Case(model, adamw(model), autocast)

    def frozen() -> Case:
        model = shell(base)
        for p in model.parameters():
            p.requires_grad_(False)
        return Case(model, None, marker=reach_first_layer(model))

    cases = {
        "frozen": frozen(), "peft_fp32": peft_case(True), "peft_bf16": peft_case(False),
        "parallel_lora_fp32": ours(torch.float32), "parallel_lora_bf16": ours(torch.bfloat16),
        "parallel_lora_autocast": ours(torch.float32, autocast=True),
    }  # fmt: skip
    for mode in modes:
        frozen_name, ours_name = COMPILE_MODES[mode]
        graphs = mode == "reduce-overhead"
        cases[frozen_name] = frozen()
        cases[ours_name] = ours(torch.float32, dropout=GRAPH_DROPOUT if graphs else 0.0)
        for name in (frozen_name, ours_name):
            cases[name].cudagraphs = graphs
            compile_layers(cases[name].model, mode)
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
        if case.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(ids.device.type, torch.bfloat16, enabled=case.autocast):
            loss = case.model(input_ids=ids, labels=ids).loss
        loss.backward()
        if case.optimizer is not None:
            case.optimizer.step()
            case.optimizer.zero_grad(set_to_none=True)
        elif case.marker is not None:  # a kept gradient would accumulate into a CUDA graph's output, overwritten
            case.marker.grad = None  # by the next replay
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
    if case.cudagraphs:
        torch.compiler.cudagraph_mark_step_begin()
    with torch.autocast(ids.device.type, torch.bfloat16, enabled=case.autocast):
        out = case.model(input_ids=ids, labels=ids)
    grads = {}
    if case.optimizer is not None:
        out.loss.backward()
        for name, (A, B) in adapter_factors(case.model).items():
            grads[f"{name}.A"], grads[f"{name}.B"] = A.grad.float(), B.grad.float()
        case.optimizer.zero_grad(set_to_none=True)
    return out.loss.item(), out.logits.detach(), grads


def distances(got: tuple, ref: tuple) -> dict:
    """How far one ``first_step`` is from another: loss (absolute and relative), logits and adapter gradients
    (relative Frobenius norms, the gradients concatenated)."""
    (loss, logits, grads), (ref_loss, ref_logits, ref_grads) = got, ref
    if sorted(grads) != sorted(ref_grads):
        raise RuntimeError("the two cases train different adapters")
    names = sorted(ref_grads)
    grad_err = rel_err(torch.cat([grads[n].flatten() for n in names])[None],
                       torch.cat([ref_grads[n].flatten() for n in names])[None]) if names else 0.0  # fmt: skip
    return {"loss": loss, "peft_loss": ref_loss, "loss_diff": abs(loss - ref_loss),
            "loss_rel": abs(loss - ref_loss) / abs(ref_loss), "logits_err": rel_err(logits, ref_logits),
            "grad_err": grad_err}  # fmt: skip


def validate(cases: dict[str, Case], ids: torch.Tensor) -> dict:
    """Each of ours against PEFT at step 0 (``PAIRS``, and the compiled pair): loss, logits and adapter gradients,
    each within ``REL_TOL`` times PEFT bf16's distance from PEFT fp32 (at least ``FLOORS``), and how far the adapters
    move the logits from the frozen model's. Step 0 of every other case gives its loss. Raises ``RuntimeError`` on a
    disagreement. One case's logits are held at a time beside the three references'."""
    refs = {name: first_step(cases[name], ids) for name in ("frozen", "peft_fp32", "peft_bf16")}
    losses = {name: ref[0] for name, ref in refs.items()}
    effect = rel_err(refs["peft_fp32"][1], refs["frozen"][1])
    del refs["frozen"]
    noise = distances(refs["peft_bf16"], refs["peft_fp32"])
    limits = {"loss": max(REL_TOL * noise["loss_rel"], FLOORS["loss"]),
              "logits": max(REL_TOL * noise["logits_err"], FLOORS["logits"]),
              "grads": max(REL_TOL * noise["grad_err"], FLOORS["grads"])}  # fmt: skip
    against = dict(PAIRS + (COMPILED_PAIR,))
    pairs = []
    for name, case in cases.items():
        if name in losses:
            continue
        first = first_step(case, ids)
        losses[name] = first[0]
        if name in against:
            pairs.append({"ours": name, "peft": against[name], **distances(first, refs[against[name]])})
        del first
    report = {
        "losses": losses, "pairs": pairs, "adapter_effect": effect,
        "tolerances": {"rel_tol": REL_TOL, "floors": FLOORS, "effect_min": EFFECT_MIN,
                       "peft_bf16_from_fp32": {k: noise[k] for k in ("loss_rel", "logits_err", "grad_err")},
                       "limits": limits},
    }  # fmt: skip
    if not effect >= EFFECT_MIN * limits["logits"]:
        raise RuntimeError(f"the adapters move the logits by {effect:.3g} only (< {EFFECT_MIN} x the logits' limit "
                           f"{limits['logits']:.3g}): the check is blind")  # fmt: skip
    for p in pairs:
        if not (p["loss_rel"] <= limits["loss"] and p["logits_err"] <= limits["logits"]
                and p["grad_err"] <= limits["grads"]):  # fmt: skip
            raise RuntimeError(f"{p['ours']} disagrees with {p['peft']} at step 0: loss {p['loss']:.5f} against "
                               f"{p['peft_loss']:.5f} (rel {p['loss_rel']:.3g}, limit {limits['loss']:.3g}), logits "
                               f"rel err {p['logits_err']:.3g} (limit {limits['logits']:.3g}), adapter gradients rel "
                               f"err {p['grad_err']:.3g} (limit {limits['grads']:.3g}); PEFT bf16 is "
                               f"{noise['logits_err']:.3g} / {noise['grad_err']:.3g} from PEFT fp32")  # fmt: skip
    return report


def drop_failing(cases: dict[str, Case], ids: torch.Tensor, names: tuple[str, ...]) -> dict[str, str]:
    """Run three steps of each of ``names`` (one compiled mode's cases, those in ``cases``): if one raises, all of
    them are dropped from ``cases`` (a case's ratio needs its frozen step) and its error returned, so that a mode
    failing leaves the rest of the run its rows."""
    failed = {}
    for name in names:
        if name not in cases:
            continue
        try:
            step = step_fn(cases[name], ids)
            for _ in range(3):
                step()
        except Exception as e:  # a mode that cannot run is reported, not fatal
            failed[name] = f"{type(e).__name__}: {e}"[:2000]
            print(f"{name} failed: {failed[name][:500]}", flush=True)
    if failed:
        for name in names:
            cases.pop(name, None)
        print(f"left out: {', '.join(names)}", flush=True)
    return failed


def warm_up(cases: dict[str, Case], steps: dict[str, Callable], count: int) -> dict:
    """Run ``count`` (at least 2) untimed steps of every case (tuning, optimizer state, compilation, graph capture)
    and check that they train: ``{case: {"losses", "finite", "falls"}}`` (``falls`` None without an optimizer).
    Raises ``RuntimeError`` on a non-finite loss."""
    training = {}
    for name, step in steps.items():
        losses = [step().detach() for _ in range(max(count, 2))]
        values = [float(loss) for loss in losses]
        finite = all(math.isfinite(v) for v in values)
        falls = values[-1] < values[0] if cases[name].optimizer is not None else None
        training[name] = {"losses": values, "finite": finite, "falls": falls}
        if not finite:
            raise RuntimeError(f"{name} does not train: losses {values}")
    return training


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


def kernel_group(name: str) -> str:
    """The ``KERNEL_GROUPS`` group of the GPU kernel called ``name``, else ``other``."""
    low = name.lower()
    return next((group for group, keys in KERNEL_GROUPS if any(key in low for key in keys)), "other")


def gpu_ms_by_group(per_kernel_us: dict[str, float]) -> dict[str, float]:
    """GPU ms per step of each kernel group (and their ``total``), from GPU us per step by kernel name."""
    groups = dict.fromkeys(GROUP_NAMES, 0.0)
    for name, us in per_kernel_us.items():
        groups[kernel_group(name)] += us / 1e3
    return {**groups, "total": sum(groups.values())}


def profile_groups(step: Callable[[], object], calls: int) -> dict:
    """``gpu_ms_by_group`` of ``calls`` profiled steps, or ``{"error"}``: a profile that fails costs no timings."""
    try:
        return gpu_ms_by_group(kernel_us(step, calls))
    except RuntimeError as error:
        return {"error": f"{type(error).__name__}: {str(error)[-300:]}"}


def wall_ms(fn: Callable[[], object]) -> float:
    """Wall-clock ms of one call: the smoke run's stand-in for CUDA events."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def probe(step: Callable[[], object]) -> dict:
    """One more step, looked at (CUDA): its host issue time (the GPU idle when it starts), its wall time to the
    sync and the device allocations it made; then another, untimed, counting its synchronizing calls
    (``torch.cuda.set_sync_debug_mode``, kept out of the timed step)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    start = time.perf_counter()
    step()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    after = torch.cuda.memory_stats()
    delta = {key: after.get(key, 0) - before.get(key, 0) for key in ("num_device_alloc", "num_device_free",
                                                                     "num_alloc_retries")}  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return {"host_issue_ms": issued * 1e3, "wall_ms": wall * 1e3, "syncs": syncs, **delta}


def plain_loop(args: argparse.Namespace) -> dict:
    """A plain transformers loop, timed like a case: ``AutoModelForCausalLM.from_config`` of the same config and
    tokens, frozen, ``enable_input_require_grads`` (its backward reaches the first layer's input, a little deeper than
    the frozen case's), ``loss.backward()`` and nothing else."""
    from transformers import AutoModelForCausalLM

    device = "cpu" if args.smoke else "cuda"
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(llama_config(args), dtype=torch.bfloat16)
    model.requires_grad_(False)
    model.enable_input_require_grads()
    model.train()
    ids = token_ids(args, device)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    for _ in range(args.warmup):
        step()
    time_one = wall_ms if args.smoke else (lambda fn: back_to_back_ms(fn, args.calls, args.batches))
    with gc_paused():
        ms = [time_one(step) for _ in range(args.rounds)]
    return {"step_ms": statistics.median(ms), "step_ms_rounds": ms, "probe": None if args.smoke else probe(step)}


def plain_check(args: argparse.Namespace, argv: list[str]) -> dict:
    """``plain_loop`` in a fresh process (nothing of this harness in it), run with this run's ``argv``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plain.json"
        command = [sys.executable, "-m", "benchmarks.model", *argv, "--plain-only", "--out", str(out)]
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.plain_timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {args.plain_timeout} s"}
        if done.returncode != 0 or not out.exists():
            return {"error": done.stderr[-2000:]}
        return json.loads(out.read_text())


def model_rows(times: dict[str, list[float]], tokens: int, peaks: dict[str, float | None],
               probes: dict[str, dict] | None = None,
               profiles: dict[str, dict] | None = None) -> list[dict]:  # fmt: skip
    """One row per case from its per-round step times (ms), each ratio taken to the frozen step of its round (a
    compiled case's: the frozen step compiled the same way; it also gets ``ratio_to_eager``, to itself uncompiled,
    where that is the same case)."""
    rows = []
    for impl, ms in times.items():
        step_ms = statistics.median(ms)
        frozen = times[FROZEN_OF.get(impl, "frozen")]
        row = {
            "impl": impl, "step_ms": step_ms, "ratio_to_frozen": ratio_over_rounds(ms, frozen),
            "peak_gib": peaks.get(impl), "tokens_per_s": tokens / step_ms * 1e3, "step_ms_rounds": ms,
        }  # fmt: skip
        if impl in EAGER_OF and EAGER_OF[impl] in times:
            row["ratio_to_eager"] = ratio_over_rounds(ms, times[EAGER_OF[impl]])
        if probes and impl in probes:
            row["probe"] = probes[impl]
        if profiles and impl in profiles:
            row["gpu_ms_by_group"] = profiles[impl]
        rows.append(row)
    return rows


def target_checks(times: dict[str, list[float]], preset: str, tokens: int) -> list[dict]:
    """The model-step targets of docs/design.md for this preset and token count, as ``{"measure", "impl", "value",
    "target", "met"}``: ours fp32 over the frozen step (eager, and each compiled mode over its own frozen step) and
    over PEFT fp32's."""
    eager, compiled = STEP_TARGETS.get((preset, tokens), (None, None))
    wanted = [("step / peft_fp32", "parallel_lora_fp32", "peft_fp32", PEFT_TARGET)]
    if eager is not None:
        wanted.insert(0, ("step / frozen", "parallel_lora_fp32", "frozen", eager))
    if compiled is not None:
        for frozen_name, ours_name in COMPILE_MODES.values():
            wanted.append((f"step / {frozen_name}", ours_name, frozen_name, compiled))
    return [
        {"measure": measure, "impl": impl, "value": (v := ratio_over_rounds(times[impl], times[base])),
         "target": target, "met": v <= target}
        for measure, impl, base, target in wanted if impl in times and base in times
    ]  # fmt: skip


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    """The plain check, then build, validate, warm up and time every case; print the table and targets. Returns what
    is written."""
    device = "cpu" if args.smoke else "cuda"
    plain = plain_check(args, argv) if args.plain_check else None
    base = build_base(args, device)
    cases = build_cases(base, args.r, args.alpha, backend="torch" if args.smoke else "triton", modes=args.modes)
    adapted = set_adapters(cases, args.alpha, args.seed)
    ids = token_ids(args, device)
    failed = drop_failing(cases, ids, COMPILE_MODES["reduce-overhead"])  # CUDA graphs: tried first, may be left out
    validation = validate(cases, ids)
    validation["adapted_modules"] = adapted
    for p in validation["pairs"]:
        print(f"step 0, {p['ours']} against {p['peft']}: loss {p['loss']:.5f} / {p['peft_loss']:.5f}, logits rel "
              f"err {p['logits_err']:.2e}, adapter grads rel err {p['grad_err']:.2e}", flush=True)  # fmt: skip
    limits = validation["tolerances"]["limits"]
    print(f"limits (x{REL_TOL:g} PEFT bf16's distance from PEFT fp32): loss rel {limits['loss']:.2e}, logits "
          f"{limits['logits']:.2e}, grads {limits['grads']:.2e}; adapter effect "
          f"{validation['adapter_effect']:.3g}")  # fmt: skip
    steps = {name: step_fn(case, ids) for name, case in cases.items()}
    training = warm_up(cases, steps, args.warmup)
    # Set-up leaves millions of objects (models, compiled graphs) that every full collection would scan: freeze
    # them out of it, and hand the allocator's validation-sized blocks back, as a fresh training process starts.
    gc.collect()
    gc.freeze()
    if not args.smoke:
        torch.cuda.empty_cache()
        for step in steps.values():
            step()
    if args.smoke:
        time_one, timing, peaks, probes = wall_ms, "smoke: wall clock, one step per round, on the CPU", {}, {}
    else:
        peaks = step_peaks_gib(cases, steps, base)

        def time_one(fn: Callable[[], object]) -> float:
            gc.collect()
            with gc_paused():
                return back_to_back_ms(fn, args.calls, args.batches)

        timing = (f"steps back to back, {args.calls} per CUDA event pair, median of {args.batches}, {args.rounds} "
                  f"interleaved rounds, {args.warmup} warm-up steps each, garbage collector paused")  # fmt: skip
    try:
        times = time_in_rounds(steps, args.rounds, time_one)
        if not args.smoke:
            probes = {name: probe(step) for name, step in steps.items()}
        profiles = {name: profile_groups(step, args.calls) for name, step in steps.items()} if args.profile else {}
    finally:
        gc.unfreeze()
    rows = model_rows(times, args.tokens, peaks, probes, profiles)
    targets = target_checks(times, args.preset, args.tokens)
    ours_graphs = COMPILE_MODES["reduce-overhead"][1]
    if ours_graphs in training:
        t = training[ours_graphs]
        targets.append({"measure": "last / first warm-up loss", "impl": ours_graphs,
                        "value": t["losses"][-1] / t["losses"][0], "target": 1.0, "met": bool(t["falls"])})  # fmt: skip
    print(f"\n{'impl':>29} {'step_ms':>9} {'x frozen':>8} {'x eager':>7} {'tokens/s':>9} {'peak_GiB':>8} "
          f"{'host_ms':>8} {'syncs':>5}")  # fmt: skip
    for row in rows:
        peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.2f}"
        eager = f"{row['ratio_to_eager']:.3f}" if "ratio_to_eager" in row else "-"
        probed = row.get("probe") or {}
        host = f"{probed['host_issue_ms']:.1f}" if probed else "-"
        print(f"{row['impl']:>29} {row['step_ms']:9.2f} {row['ratio_to_frozen']:8.3f} {eager:>7} "
              f"{row['tokens_per_s']:9.0f} {peak:>8} {host:>8} {probed.get('syncs', '-'):>5}")  # fmt: skip
    if profiles:
        groups = [*GROUP_NAMES, "total"]
        print(f"\nGPU ms per step by kernel group (torch.profiler, {args.calls} steps)\n{'impl':>29} "
              + " ".join(f"{g:>13}" for g in groups))  # fmt: skip
        for name, ms in profiles.items():
            cells = ms["error"] if "error" in ms else " ".join(f"{ms[g]:13.2f}" for g in groups)
            print(f"{name:>29} {cells}")
    dims = {k: getattr(args, k) for k in (*DIMS, "batch", "seq_len", "r", "alpha")}
    model = {"preset": args.preset, **dims, "tokens_per_step": args.tokens, "compile_modes": list(args.modes)}
    if plain is not None and "step_ms" in plain:
        frozen_ms = statistics.median(times["frozen"])
        plain["frozen_step_ms"] = frozen_ms
        plain["frozen_over_plain"] = frozen_ms / plain["step_ms"]
        plain["max"], plain["met"] = PLAIN_MAX, frozen_ms / plain["step_ms"] <= PLAIN_MAX
        print(f"\nplain transformers loop, fresh process: {plain['step_ms']:.2f} ms; frozen step / plain step "
              f"{plain['frozen_over_plain']:.3f} (<= {PLAIN_MAX}: {'met' if plain['met'] else 'NOT met'})")  # fmt: skip
    elif plain is not None:
        print(f"\nplain loop failed: {plain['error'][-500:]}")
    print("\nmodel-step targets of docs/design.md")
    for t in targets:
        print(f"{t['impl']:>29} {t['measure']:>26} {t['value']:6.3f} <= {t['target']:.2f} "
              f"{'met' if t['met'] else 'NOT met'}")  # fmt: skip
    command = module_command("benchmarks.model")
    meta = ({"command": command, "timing": timing, "device": "cpu", "torch": torch.__version__, "model": model}
            if args.smoke else run_meta(command, timing, model=model))  # fmt: skip
    meta["plain"] = plain
    data = {"meta": meta, "validation": validation, "training": training, "rows": rows, "targets": targets}
    if failed:
        data["failed"] = failed
    return data


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.model", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-8b-4l", help="model dimensions")
    for flag, text in (("--layers", "decoder layers"), ("--hidden", "hidden size"),
                       ("--intermediate", "MLP intermediate size"), ("--heads", "attention heads"),
                       ("--kv-heads", "key-value heads (divides --heads)"), ("--head-dim", "per-head dimension"),
                       ("--vocab", "vocabulary")):  # fmt: skip
        parser.add_argument(flag, type=int, default=None, help=f"{text} (default: the preset's)")
    for flag, default, text in (
        ("--tokens", 8192, "tokens per step"), ("--batch", 1, "sequences per step (divides --tokens)"),
        ("--r", 16, "LoRA rank"), ("--alpha", 32, "LoRA alpha"),
        ("--rounds", 5, "interleaved timing rounds (medians)"), ("--calls", 2, "steps back to back per event pair"),
        ("--batches", 3, "event pairs per measurement (their median)"),
        ("--warmup", 3, "untimed steps per case first (tuning, optimizer state, compilation; at least 2 run)"),
        ("--plain-timeout", 300, "seconds the plain loop's process may take"),
    ):  # fmt: skip
        parser.add_argument(flag, type=int, default=default, help=f"{text} (default {default})")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default --tokens / --batch)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, adapters and tokens")
    parser.add_argument("--compile", action="store_true", help="the same as --compile-mode default")
    parser.add_argument("--compile-mode", default="", help="comma-separated torch.compile modes of the compiled "
                                                           "cases: default, reduce-overhead")  # fmt: skip
    parser.add_argument("--no-plain-check", dest="plain_check", action="store_false",
                        help="skip the plain transformers loop in a fresh process")  # fmt: skip
    parser.add_argument("--plain-only", action="store_true", help=argparse.SUPPRESS)  # plain_check's child
    parser.add_argument("--profile", action="store_true", help="after timing, each case's GPU ms per step by kernel "
                                                               "group (torch.profiler)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, one step per case: the flow")
    parser.add_argument("--out", default="", help="JSON path (default benchmarks/results/model_<gpu>_<preset>_"
                                                  "<tokens>.json; --smoke writes only with --out)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.seq_len is not None:
        args.tokens = args.batch * args.seq_len
    custom = [k for k in DIMS if getattr(args, k) is not None and getattr(args, k) != PRESETS[args.preset][k]]
    for key in DIMS:
        if getattr(args, key) is None:
            setattr(args, key, PRESETS[args.preset][key])
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args.smoke and args.profile:
        parser.error("--profile reads GPU kernels, and --smoke runs on the CPU: drop one of them")
    args.preset = "smoke" if args.smoke else "custom" if custom else args.preset
    modes = [m for m in args.compile_mode.split(",") if m] + (["default"] if args.compile else [])
    if not set(modes) <= set(COMPILE_MODES):
        parser.error(f"--compile-mode: expected some of {', '.join(COMPILE_MODES)}, got {args.compile_mode!r}")
    args.modes = tuple(m for m in COMPILE_MODES if m in modes)
    positive = (*DIMS, "batch", "tokens", "r", "alpha", "rounds", "calls", "batches")
    bad = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in positive if getattr(args, k) < 1]
    if bad or args.warmup < 0:
        parser.error(f"expected positive integers (--warmup >= 0), got {', '.join(bad) or f'--warmup {args.warmup}'}")
    if args.tokens % args.batch:
        parser.error(f"--batch must divide --tokens, got {args.batch} and {args.tokens}")
    args.seq_len = args.tokens // args.batch
    if args.heads % args.kv_heads:
        parser.error(f"--kv-heads must divide --heads, got {args.kv_heads} and {args.heads}")
    return args


def out_suffix(args: argparse.Namespace) -> str:
    """``_<preset>_<tokens>``: one results file per preset (``custom`` with its dims overridden) and token count."""
    return f"_{args.preset}_{args.tokens}"


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if not args.smoke:
        require_cuda("python -m benchmarks.model")
    if args.plain_only:
        data = plain_loop(args)
        write_json(args.out, data)
        return data
    data = run(args, argv)
    out = Path(args.out) if args.out else None if args.smoke else results_path("model", out_suffix(args))
    if out is not None:
        write_json(out, data)
        print(f"wrote {out}")
    return data


if __name__ == "__main__":
    main()
