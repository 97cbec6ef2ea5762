"""DESIGN section 6's targets read from kernel time: the op's forward and backward against cuBLAS's two GEMMs.

    python benchmarks/targets.py benchmarks/results/2026-12-05-probe-ab-flat-dx-h100.json \\
        benchmarks/results/2026-12-05-probe-ab-flat-dx-mlp-h100.json

To measure the tree at hand alone, compare it with itself (its package is loaded twice; read ``--tree new``):

    python benchmarks/probe_ab.py --old . --profile 20 --rounds 5 --out ab.json \\
        --shapes "8192,4096,4096,16;8192,4096,4096,64;8192,4096,14336,16;8192,14336,4096,16"

Reads ``probe_ab.py --profile N`` JSON (each case's kernels' GPU time over N calls back to back, no L2 flush;
rounds within ~0.3% of each other) and prints, per shape, the forward and fwd+bwd ratios of one tree
(``--tree``, default ``new``) to cuBLAS's ``y`` and ``dx`` GEMMs, and what "pre" dropout 0.1 adds to the op's
fwd+bwd, each the median over rounds of that round's ratio, beside its target. Kernel time leaves out the gaps
between launches (a CUDA graph's are ~1 us each; ours has 3, the base 2). ``--out`` writes the table as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import write_json  # noqa: E402  (benchmarks/ is this script's directory)
from rounds import ratio_over_rounds  # noqa: E402

# (M, K, N, r) -> (forward, fwd+bwd) targets; dropout 0.1 should cost what dropout 0 costs.
TARGETS = {
    (8192, 4096, 4096, 16): (1.05, 1.06),
    (8192, 4096, 14336, 16): (1.04, 1.04),
    (8192, 14336, 4096, 16): (1.04, 1.04),
    (8192, 4096, 4096, 64): (1.08, 1.10),
}
DROPOUT_SLACK = 0.01  # "costs the same": within 1%, three times the rounds' spread


def round_ratio(cases: dict, num: list[str], den: list[str]) -> float:
    """Median over rounds of ``sum(num cases) / sum(den cases)`` in the same round."""
    per_round = [[sum(ms) for ms in zip(*(cases[c] for c in names), strict=True)] for names in (num, den)]
    return ratio_over_rounds(*per_round)


def target_rows(data: dict, tree: str = "new") -> list[dict]:
    """One row per shape of ``data`` (a ``probe_ab`` result) that DESIGN sets a target for."""
    by_shape: dict[tuple, dict] = {}
    for row in data["rows"]:
        by_shape.setdefault(tuple(row["shape"]), {})[row["case"]] = row["ms_rounds"]
    rows = []
    for shape, cases in by_shape.items():
        if shape not in TARGETS:
            continue
        fwd, bwd, fwd_d, bwd_d = (f"{tree}_{c}" for c in ("forward", "backward", "forward_drop", "backward_drop"))
        base = ["cublas_y", "cublas_dx"]
        fwd_target, fwdbwd_target = TARGETS[shape]
        row = {
            "shape": list(shape),
            "fwd_ratio": round_ratio(cases, [fwd], ["cublas_y"]), "fwd_target": fwd_target,
            "fwdbwd_ratio": round_ratio(cases, [fwd, bwd], base), "fwdbwd_target": fwdbwd_target,
            "dropout_cost": round_ratio(cases, [fwd_d, bwd_d], [fwd, bwd]) - 1,
        }  # fmt: skip
        row["met"] = {
            "fwd": row["fwd_ratio"] <= fwd_target,
            "fwdbwd": row["fwdbwd_ratio"] <= fwdbwd_target,
            "dropout": row["dropout_cost"] <= DROPOUT_SLACK,
        }
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="probe_ab.py --profile JSON files")
    parser.add_argument("--tree", default="new", help="which tree's cases to read (probe_ab's 'new' or 'old')")
    parser.add_argument("--out", default="", help="write the table as JSON here")
    args = parser.parse_args()
    rows, sources = [], []
    for path in args.results:
        data = json.loads(Path(path).read_text())
        rows += target_rows(data, args.tree)
        sources.append({"file": path, **data.get("meta", {})})

    def mark(ok: bool) -> str:
        return "met" if ok else "NOT met"

    print(f"{'M,K,N,r':>20} {'fwd':>6} {'target':>6} {'':>7} {'fwd+bwd':>7} {'target':>6} {'':>7} {'dropout':>8}")
    for row in rows:
        met = row["met"]
        print(
            f"{','.join(map(str, row['shape'])):>20} {row['fwd_ratio']:6.3f} {row['fwd_target']:6.2f} "
            f"{mark(met['fwd']):>7} {row['fwdbwd_ratio']:7.3f} {row['fwdbwd_target']:6.2f} {mark(met['fwdbwd']):>7} "
            f"{100 * row['dropout_cost']:+7.1f}% {mark(met['dropout'])}"
        )
    if args.out:
        write_json(args.out, {"meta": {"sources": sources, "tree": args.tree}, "rows": rows})


if __name__ == "__main__":
    main()
