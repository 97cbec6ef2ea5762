"""Probe: the backward's G launch with dB's partials (``kernels/shrink_db.py``) against the plain G launch, over its
rows per program and programs per SM, in back-to-back GPU time (needs CUDA).

    python benchmarks/probe_shrink_db.py --shapes "8192,4096,4096,16;2048,4096,4096,16" --out probe_shrink_db.json

Cases per shape, timed in interleaved rounds by ``kernel_breakdown.back_to_back`` (``probe_gemm.rows_in_rounds``,
which adds each case's ratio to cuBLAS's ``dy @ W`` of the same round): ``cublas_dx``, ``old_G`` (``shrink``),
``old_dx_grads`` (the fused dx launch reducing dA and dB), ``old_backward`` (the two), and for each variant
``ROWSxPER_SM`` ``db_*`` (``shrink_db`` alone) and ``backward_*`` (``shrink_db``, then the fused dx launch summing
its partials). A variant patches ``shrink_db.db_rows`` and ``shrink_db.PROGRAMS_PER_SM`` for its calls; each
variant's dB is checked against fp32 torch first. Experiments, not library code.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_breakdown import problem  # noqa: E402  (benchmarks/ is this script's directory)
from probe_gemm import rows_in_rounds  # noqa: E402
from report import parse_shapes, run_meta, write_json  # noqa: E402

from parallel_lora.kernels import shrink_db  # noqa: E402
from parallel_lora.kernels.dx_grads import lora_dx_and_grads  # noqa: E402
from parallel_lora.kernels.shrink import lora_shrink  # noqa: E402

VARIANTS = ((256, 1), (256, 2), (128, 1), (128, 2), (64, 2))


@contextmanager
def variant(rows: int, per_sm: int):
    saved = shrink_db.db_rows, shrink_db.PROGRAMS_PER_SM
    shrink_db.db_rows, shrink_db.PROGRAMS_PER_SM = (lambda: rows), per_sm
    try:
        yield
    finally:
        shrink_db.db_rows, shrink_db.PROGRAMS_PER_SM = saved


def cases(M: int, K: int, N: int, r: int, variants=VARIANTS) -> dict:
    x, W, A, B, dy = problem(M, K, N, r)
    s = 2.0
    S, G = lora_shrink(x, A.t(), s), lora_shrink(dy, B, s)
    ref_db = dy.float().t() @ S.float()
    out = {
        "cublas_dx": lambda: dy @ W,
        "old_G": lambda: lora_shrink(dy, B, s),
        "old_dx_grads": lambda: lora_dx_and_grads(dy, W, False, G, A, x, S),
        "old_backward": lambda: lora_dx_and_grads(dy, W, False, lora_shrink(dy, B, s), A, x, S),
    }
    for rows, per_sm in variants:

        def db(rows=rows, per_sm=per_sm):
            with variant(rows, per_sm):
                return shrink_db.lora_shrink_db(dy, B, S, s)

        def backward(rows=rows, per_sm=per_sm):
            with variant(rows, per_sm):
                g, parts, blocks = shrink_db.lora_shrink_db(dy, B, S, s)
                return lora_dx_and_grads(dy, W, False, g, A, x, None, db_partials=parts, db_parts=blocks)

        err = ((backward()[2].float() - ref_db).abs().max() / ref_db.abs().max()).item()
        if not err < 1e-2:
            raise RuntimeError(f"dB of variant {rows}x{per_sm} at {M},{K},{N},{r}: rel err {err:.3g}")
        out[f"db_{rows}x{per_sm}"] = db
        out[f"backward_{rows}x{per_sm}"] = backward
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8192,4096,4096,16;8192,4096,14336,16;2048,4096,4096,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="calls back to back per timing")
    parser.add_argument(
        "--variants",
        default=",".join(f"{r}x{s}" for r, s in VARIANTS),
        help="ROWSxPER_SM,... (rows per program x programs per SM)",
    )
    parser.add_argument("--out", default="probe_shrink_db.json")
    args = parser.parse_args()
    variants = [tuple(int(v) for v in item.split("x")) for item in args.variants.split(",")]
    rows = []
    for shape in parse_shapes(args.shapes):
        rows += rows_in_rounds(shape, cases(*shape, variants), args.rounds, 0, profile=args.calls)
    write_json(args.out, {"meta": run_meta(), "rows": rows})


if __name__ == "__main__":
    main()
