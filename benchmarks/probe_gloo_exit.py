"""Probe: how often a two-rank gloo run dies at interpreter exit after all its work is done (CPU, no GPU).

    python benchmarks/probe_gloo_exit.py --runs 100 --hog --out benchmarks/results/<date>-gloo-exit.json

pytorch/pytorch#179291: on gloo the process groups, and their worker threads, outlive
``destroy_process_group()`` (DTensor keeps references to them). A worker still freeing a finished collective's
tensors when the interpreter shuts down takes the GIL; during finalization that ends the thread through a
noexcept frame, and the rank dies of SIGABRT after a complete run. ``launch/train.py`` leaves through
``os._exit(0)`` for that reason.

Three cases, interleaved run by run (each a ``torchrun --standalone --nproc-per-node 2``):

- ``exit``: train.py's teardown in small (DTensors gathered with ``full_tensor`` as ``save_adapter`` does, a
  barrier, ``destroy_process_group()``), then the interpreter's own exit;
- ``os_exit``: the same, then ``os._exit(0)``;
- ``train``: ``launch/train.py`` as shipped (preset tiny, 2 steps).

``--hog`` keeps one CPU core busy meanwhile: the aborts came under load (CI, session 17).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = ("exit", "os_exit", "train")


def worker(fast_exit: bool) -> None:
    """One rank: gather DTensors, barrier, destroy the process group, leave."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    tensors = [distribute_tensor(torch.randn(64, 16), mesh["tp"], [Shard(i % 2)]) for i in range(28)]
    [t.full_tensor() for t in tensors]
    dist.barrier()
    dist.destroy_process_group()
    if fast_exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def command(case: str, out_dir: Path) -> list[str]:
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    if case == "train":
        return [*run, str(REPO / "launch" / "train.py"), "--preset", "tiny", "--steps", "2", "--save-every", "100",
                "--batch-size", "4", "--seq-len", "64", "--output-dir", str(out_dir)]  # fmt: skip
    return [*run, str(Path(__file__).resolve()), "--worker", case]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100, help="runs of each case")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    parser.add_argument("--hog", action="store_true", help="keep one CPU core busy meanwhile")
    parser.add_argument("--out", default="probe_gloo_exit.json")
    parser.add_argument("--worker", choices=("exit", "os_exit"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker == "os_exit")
        return
    cases = args.cases.split(",")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out_dir = Path(tempfile.mkdtemp(prefix="probe_gloo_exit_"))  # train.py's metrics, checkpoints, adapter
    hog = subprocess.Popen(["sh", "-c", "while true; do :; done"]) if args.hog else None
    results = {case: {"runs": 0, "failed": [], "seconds": 0.0} for case in cases}
    try:
        for i in range(args.runs):
            for case in cases:
                t0 = time.perf_counter()
                proc = subprocess.run(command(case, out_dir), cwd=REPO, env=env, capture_output=True, text=True)
                row = results[case]
                row["runs"] += 1
                row["seconds"] += time.perf_counter() - t0
                if proc.returncode != 0:
                    signals = sorted({line.split("(")[-1].rstrip(")") for line in proc.stderr.splitlines()
                                      if "exitcode" in line and "(SIG" in line})  # fmt: skip
                    row["failed"].append({"run": i, "returncode": proc.returncode, "signals": signals})
            failed = ", ".join(f"{c} {len(results[c]['failed'])}" for c in cases)
            print(f"run {i + 1}/{args.runs}, failed so far: {failed}", flush=True)
    finally:
        if hog is not None:
            hog.kill()
        shutil.rmtree(out_dir, ignore_errors=True)
    print(f"{'case':>8} {'runs':>5} {'failed':>6} {'s/run':>6}")
    for case, row in results.items():
        print(f"{case:>8} {row['runs']:>5} {len(row['failed']):>6} {row['seconds'] / max(1, row['runs']):6.1f}")
    import torch

    meta = {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "hog": args.hog, "command": "python " + " ".join(sys.argv)}  # fmt: skip
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "cases": results}, indent=1))
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
