"""Probe: what each tuning candidate of the op's launches costs, and which one each tuner picks (CUDA).

    python benchmarks/probe_tuning.py --shapes "8192,4096,4096,16" --trials 5 --rounds 3 --profile 20 --out t.json

Experiments, not library code. The op's forward and backward (bare and with "pre" dropout 0.1) run once with
every kernel module's ``launch`` wrapped, which records each launch's arguments. Then, for each launch: every
config its autotuner would try (``configs.prune``) is timed in interleaved rounds, back to back
(``kernel_breakdown.back_to_back``: the kernel's GPU time per call over ``--profile`` calls); and two tuners run
``--trials`` times each on the same arguments, recording their picks: the library's (``configs.tune``: CUDA-graph
replays in interleaved rounds) and Triton's autotuner (``do_bench``, one config after the other; the library's
until session 17), with the times it measured. The question: does the pick depend on the run (two A/B runs of
one tree read its backward at 426 and 404 us, NOTES.md, session 17), and what does a wrong pick cost?
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_breakdown import back_to_back, problem  # noqa: E402  (benchmarks/ is this script's directory)
from report import parse_shapes, run_meta, write_json  # noqa: E402
from rounds import time_in_rounds  # noqa: E402

from parallel_lora import kernels  # noqa: E402
from parallel_lora.dropout import Dropout  # noqa: E402
from parallel_lora.kernels import LAUNCH_MODULES, configs  # noqa: E402


def captured_launches(M: int, K: int, N: int, r: int) -> dict[str, tuple]:
    """``{label: (spec, kernel, args, consts, grid)}`` of the op's launches at this shape: forward and backward,
    bare and with "pre" dropout 0.1, bf16. Each launch runs as usual; its arguments are recorded on the way."""
    x, W, A, B, dy = problem(M, K, N, r)
    seen: dict[str, tuple] = {}
    real = configs.launch

    def recording(spec, kernel, signature, tensors, runtime, build):
        static, grid, consts = build()
        flags = ",".join(k for k, v in consts.items() if isinstance(v, bool) and v)
        seen.setdefault(f"{spec.name}[{flags}]", (spec, kernel, (*tensors, *static, *runtime), consts, grid))
        return real(spec, kernel, signature, tensors, runtime, build)

    for module in LAUNCH_MODULES:
        module.launch = recording
    try:
        drop = Dropout(p=0.1, seed=1234, position="pre")
        for d in (None, drop):
            _, S = kernels.forward(x, W, None, A, B, 2.0, d)
            kernels.backward(dy, x, W, A, B, S, 2.0, d)
        torch.cuda.synchronize()
    finally:
        for module in LAUNCH_MODULES:
            module.launch = real
    return seen


def candidates(spec, kernel, args: tuple, consts: dict) -> list:
    nargs = dict(zip(kernel.arg_names, args, strict=False))
    return configs.prune(spec, spec.configs(), nargs, **consts)


def label(cfg) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.kwargs.items()) + f" s{cfg.num_stages} w{cfg.num_warps}"


def probe_launch(name: str, spec, kernel, args: tuple, consts: dict, grid, rounds: int, calls: int, trials: int):
    cands = candidates(spec, kernel, args, consts)
    cases = {label(cfg): (lambda c=cfg: kernel[grid](*args, **consts, **c.all_kwargs())) for cfg in cands}
    for case in cases.values():  # compile every candidate before timing any
        case()
    torch.cuda.synchronize()
    times = time_in_rounds(cases, rounds, back_to_back(calls)) if len(cases) > 1 else {}
    picks = {"library": [], "triton": []}
    for _ in range(trials if len(cases) > 1 else 0):
        picks["library"].append({"pick": label(configs.tune(spec, kernel, grid, args, consts))})
        # Triton's autotuner as the library used it until session 17: do_bench, one config after the other.
        tuner = triton.autotune(configs=cands, key=list(spec.key))(kernel)
        tuner[grid](*args, **consts)
        torch.cuda.synchronize()
        picks["triton"].append({"pick": label(tuner.best_config),
                                "measured_ms": {label(c): t[0] for c, t in tuner.configs_timings.items()}})  # fmt: skip
    row = {"launch": name, "configs": {k: {"us": statistics.median(v) * 1e3, "us_rounds": [t * 1e3 for t in v]}
                                       for k, v in times.items()}, "tuners": picks}  # fmt: skip
    print(f"{name}")
    for k, v in row["configs"].items():
        counts = " ".join(f"{tuner} {sum(p['pick'] == k for p in ps)}/{trials}" for tuner, ps in picks.items())
        rounds_us = " ".join(f"{t:7.1f}" for t in v["us_rounds"])
        print(f"  {k:>70}  {v['us']:8.1f} us  {rounds_us}  picked: {counts}")
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8192,4096,4096,16", help="M,K,N,r;M,K,N,r;...")
    parser.add_argument("--launches", default="", help="comma-separated spec names to probe (default: all)")
    parser.add_argument("--trials", type=int, default=5, help="runs of each tuner per launch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", type=int, default=20, help="calls back to back per timing")
    parser.add_argument("--out", default="probe_tuning.json")
    args = parser.parse_args()
    wanted = set(args.launches.split(",")) if args.launches else None
    rows = []
    for shape in parse_shapes(args.shapes):
        launches = captured_launches(*shape)
        for name, (spec, kernel, call_args, consts, grid) in launches.items():
            if wanted and spec.name not in wanted:
                continue
            row = probe_launch(name, spec, kernel, call_args, consts, grid, args.rounds, args.profile, args.trials)
            rows.append({"shape": list(shape), **row})
    # The library's picks at the op's first calls in this process (a fresh process tunes on a cold GPU, right
    # after compiling: where Triton's autotuner went wrong).
    first = configs.tuned_summary()
    for name in sorted(first):
        if not wanted or name in wanted:
            print(f"first call, {name}: " + "; ".join(pick.split(": ", 1)[1] for pick in first[name]))
    write_json(args.out, {"meta": run_meta(first_picks=first), "rows": rows})


if __name__ == "__main__":
    main()
