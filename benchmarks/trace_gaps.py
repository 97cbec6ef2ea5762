"""The GPU timeline of a torch.profiler Chrome trace, one line per kernel, with the idle gap before each.

    python benchmarks/trace_gaps.py trace.json             # every GPU kernel / memset, in start order
    python benchmarks/trace_gaps.py trace.json --summary   # per repetition: busy, idle and wall microseconds

``host_profile.py --trace`` records ``do_bench``-style repetitions; a repetition starts at each L2-clearing
fill kernel (a memset or torch's ``fill``/``zero`` kernel of the 256 MB cache buffer). A repetition whose wall
time is mostly idle GPU is host-bound; its gaps say after which kernel the host was late.
"""

from __future__ import annotations

import argparse
import json


def gpu_events(trace: dict) -> list[dict]:
    """Kernel and memset events on the GPU, sorted by start (``ts``/``dur`` in microseconds)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset")]
    return sorted(events, key=lambda e: e["ts"])


def is_clear(event: dict) -> bool:
    name = event["name"].lower()
    return event.get("cat") == "gpu_memset" or "fill" in name or "zero" in name


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--summary", action="store_true")
    args = parser.parse_args()
    with open(args.trace) as f:
        events = gpu_events(json.load(f))
    reps: list[list[dict]] = []
    end = None
    for e in events:
        if is_clear(e) or not reps:
            reps.append([])
        gap = 0.0 if end is None else e["ts"] - end
        end = e["ts"] + e["dur"]
        reps[-1].append({"name": e["name"], "ts": e["ts"], "dur": e["dur"], "gap": gap})
        if not args.summary:
            print(f"{gap:9.1f} idle | {e['dur']:8.1f} us | {e['name'][:90]}")
    if args.summary:
        print(f"{'rep':>4} | {'kernels':>7} | {'busy us':>8} | {'idle us':>8} | {'wall us':>8} (after the clear)")
        for i, rep in enumerate(reps):
            body = rep[1:] if is_clear(rep[0]) else rep
            if not body:
                continue
            busy = sum(k["dur"] for k in body)
            idle = sum(k["gap"] for k in body)
            wall = body[-1]["ts"] + body[-1]["dur"] - (rep[0]["ts"] + rep[0]["dur"])
            print(f"{i:4d} | {len(body):7d} | {busy:8.1f} | {idle:8.1f} | {wall:8.1f}")


if __name__ == "__main__":
    main()
