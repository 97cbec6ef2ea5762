"""Probe: the op from two trees of the library, in one process and in the same interleaved rounds (CUDA).

    git archive <rev> parallel_lora | tar -x -C old_tree       # the tree to compare against
    python benchmarks/probe_ab.py --old old_tree --shapes "8192,4096,4096,16" --rounds 5 --out ab.json

Experiments, not library code. Two breakdowns run one after the other compare the trees across minutes of
drift: cuBLAS itself read 2-6% slower in the second of two back-to-back runs (benchmarks/NOTES.md, session 14),
as large as the changes measured. Here the old tree's package is imported a second time, as
``parallel_lora_old`` (its imports are relative), and the forward and backward of both trees, with and
without "pre" dropout 0.1, are timed in the same rounds (``rounds.time_in_rounds``, ``do_bench`` medians), with
cuBLAS's two GEMMs beside them; ``--profile N`` times each case by its kernels' GPU time over N calls back to
back instead (``kernel_breakdown.back_to_back``: no L2 flush, rounds within ~1 us of each other). Prints
per-round times and the median over rounds of new / old per case; writes ``{"meta": ..., "rows": [...]}``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_breakdown import SHAPES, back_to_back, bench, problem  # noqa: E402  (benchmarks/ is this script's directory)
from report import parse_shapes, run_meta, write_json  # noqa: E402
from rounds import ratio_over_rounds, time_in_rounds  # noqa: E402

from parallel_lora import kernels  # noqa: E402
from parallel_lora.dropout import Dropout  # noqa: E402


def load_tree(root: Path, name: str = "parallel_lora_old"):
    """``root/parallel_lora`` imported as package ``name``: ``(its kernels module, its Dropout class)``."""
    spec = importlib.util.spec_from_file_location(
        name, root / "parallel_lora" / "__init__.py", submodule_search_locations=[str(root / "parallel_lora")]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return importlib.import_module(f"{name}.kernels"), importlib.import_module(f"{name}.dropout").Dropout


def cases(trees: dict, M: int, K: int, N: int, r: int, close: bool = False) -> dict:
    """The timed calls of one shape: cuBLAS's y and dx, and each tree's forward and backward, bare and with
    "pre" dropout 0.1 (checked against each other first: the bare op must agree across trees, bit for bit, or
    to rounding with ``close``)."""
    x, W, A, B, dy = problem(M, K, N, r)
    s = 2.0
    out = {"cublas_y": lambda: F.linear(x, W), "cublas_dx": lambda: dy @ W}
    bare = {}
    for tag, (ops, dropout_class) in trees.items():
        drop = dropout_class(p=0.1, seed=1234, position="pre")
        _, S = ops.forward(x, W, None, A, B, s, None)
        _, S_drop = ops.forward(x, W, None, A, B, s, drop)
        bare[tag] = ops.backward(dy, x, W, A, B, S, s, None)
        out[f"{tag}_forward"] = lambda k=ops: k.forward(x, W, None, A, B, s, None)
        out[f"{tag}_forward_drop"] = lambda k=ops, d=drop: k.forward(x, W, None, A, B, s, d)
        out[f"{tag}_backward"] = lambda k=ops, S=S: k.backward(dy, x, W, A, B, S, s, None)
        out[f"{tag}_backward_drop"] = lambda k=ops, S=S_drop, d=drop: k.backward(dy, x, W, A, B, S, s, d)
    for a, b in zip(bare["old"], bare["new"], strict=True):
        if close:  # the trees sum in another order: equal to rounding
            tol = 2e-2 * b.float().abs().max().item()  # of the output's scale: its small elements are sums that cancel
            torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=tol)
        else:
            assert torch.equal(a, b), "the trees' bare backward differs: not the comparison this probe is for"
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="directory holding the old tree's parallel_lora/")
    parser.add_argument("--shapes", default="", help="M,K,N,r;M,K,N,r;... (default: the DESIGN shapes)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=40, help="ms of timed repetitions per case and round")
    parser.add_argument("--profile", type=int, default=0,
                        help="time each case as its kernels' GPU time over this many calls back to back")
    parser.add_argument("--close", action="store_true",
                        help="the trees may sum in another order: their results need only agree to rounding")
    parser.add_argument("--out", default="probe_ab.json")
    args = parser.parse_args()
    shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
    trees = {"old": load_tree(Path(args.old)), "new": (kernels, Dropout)}
    time_one = back_to_back(args.profile) if args.profile else (lambda fn: bench(fn, args.reps))
    rows = []
    for shape in shapes:
        timed = cases(trees, *shape, close=args.close)
        times = time_in_rounds(timed, args.rounds, time_one)
        print(f"{shape}: ms per round")
        for name, ms in times.items():
            row = {"shape": list(shape), "case": name, "ms": statistics.median(ms), "ms_rounds": ms}
            if name.startswith("new_"):
                row["new_over_old"] = ratio_over_rounds(ms, times["old_" + name[4:]])
            rows.append(row)
            ratio = f"  new/old {row['new_over_old']:.3f}" if "new_over_old" in row else ""
            print(f"  {name:>18} " + " ".join(f"{t * 1e3:7.1f}" for t in ms) + f"  median {row['ms'] * 1e3:7.1f} us"
                  + ratio)  # fmt: skip
    # Each tree tunes its own kernels: a different pick (tuning is by timing, which varies) would confound
    # the comparison, so the picks go into the record.
    picks = {tag: tree[0].configs.tuned_summary() for tag, tree in trees.items()}
    for name in sorted(set(picks["old"]) | set(picks["new"])):
        if picks["old"].get(name) != picks["new"].get(name):
            print(f"configs differ for {name}:\n  old {picks['old'].get(name)}\n  new {picks['new'].get(name)}")
    write_json(args.out, {"meta": run_meta(), "rows": rows, "configs": picks})


if __name__ == "__main__":
    main()
