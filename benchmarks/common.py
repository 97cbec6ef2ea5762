"""What the benchmarks share: the shapes they read, the facts of a run they record, the JSON they write, and how
they time a call.

Rounds. A GPU's speed drifts by several percent within minutes (clocks, temperature), as much as the differences
measured, and a case timed right after a slow one can read fast. So a benchmark times every case once per round,
over several rounds, each led by another case with the rest in a shuffled order (``round_order``), and a ratio is
the median over rounds of a case's time over its baseline's time in the same round (``ratio_over_rounds``): drift
that moves both sides of a round cancels.

Four ways to time one call, all in milliseconds:

- ``do_bench`` (Triton's): eager launches, L2 flushed before every call; what an uncaptured training loop sees.
- ``back_to_back_ms``: calls issued back to back between a pair of CUDA events, no flush (for CUDA-graph
  replays: the GPU time of a captured step). A flush's write-back runs into the timed call and adds the same
  tens of microseconds to both sides of a ratio, pulling it towards 1.
- ``kernel_us``: the GPU time of the kernels the calls launch, by kernel, from ``torch.profiler``, calls back to
  back, no flush. It leaves out the host and the gaps between launches; its rounds agree within a fraction of a percent,
  which is why the floors in docs/design.md are judged with it.
- ``host_ms``: the host (CPU) time to issue a call, calls back to back with the GPU running behind, a sync only
  between batches; what a host-bound loop (small shapes, tensor-parallel shards) runs at.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro", "amd", "radeon", "instinct"}


def require_cuda(prog: str, devices: int = 1) -> None:
    """Exit with a message (not a traceback) unless this machine has ``devices`` CUDA GPUs."""
    if not torch.cuda.is_available():
        sys.exit(f"{prog} needs a CUDA GPU, and torch {torch.__version__} sees none on this machine.")
    if torch.cuda.device_count() < devices:
        sys.exit(f"{prog} needs {devices} CUDA GPUs, this machine has {torch.cuda.device_count()}.")


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    """``"M,K,N,r;M,K,N,r"`` -> ``[(M, K, N, r), ...]``, every value a positive integer."""
    shapes = []
    for item in text.split(";"):
        values = item.split(",")
        if len(values) != 4 or not all(v.strip().isdigit() and int(v) > 0 for v in values):
            raise ValueError(f"expected shapes as 'M,K,N,r;M,K,N,r' of positive integers, got {item!r} in {text!r}")
        shapes.append(tuple(int(v) for v in values))
    return shapes


def parse_dtypes(text: str) -> list[torch.dtype]:
    """``"bfloat16,float32"`` -> ``[torch.bfloat16, torch.float32]``, every name a torch dtype."""
    names = text.split(",")
    if not all(isinstance(getattr(torch, n, None), torch.dtype) for n in names):
        raise ValueError(f"expected torch dtype names such as bfloat16,float32, got {names}")
    return [getattr(torch, n) for n in names]


def gpu_slug(name: str) -> str:
    """A short file-name slug of a device name: ``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``, ``"NVIDIA GeForce RTX
    4090"`` -> ``"rtx4090"``: the first word holding both letters and digits, else the first two words joined."""
    words = [w for w in re.findall(r"[a-z0-9]+", name.lower()) if w not in _VENDOR_WORDS]
    for word in words:
        if re.search(r"[a-z]", word) and re.search(r"[0-9]", word):
            return word
    return "".join(words[:2]) or "gpu"


def results_path(kind: str, suffix: str = "") -> Path:
    """``benchmarks/results/<kind>_<gpu><suffix>.json`` for this machine's first GPU."""
    return RESULTS / f"{kind}_{gpu_slug(torch.cuda.get_device_name())}{suffix}.json"


def _commit() -> str | None:
    """The checkout's commit (``-dirty`` with uncommitted changes), or None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=RESULTS.parent, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def run_meta(command: str, timing: str, **extra) -> dict:
    """The facts of this run: its command, timing method, date, GPU (None on a machine without CUDA), versions and
    commit, plus ``extra``."""
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "command": command, "timing": timing, "date": dt.date.today().isoformat(),
        "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(), "commit": _commit(), **extra,
    }  # fmt: skip


def module_command(module: str) -> str:
    """This process's command line as it was typed: ``python -m <module> <arguments>``."""
    return " ".join(["python", "-m", module, *sys.argv[1:]])


def write_json(path: str | Path, data: dict) -> None:
    """``data`` as indented JSON at ``path``, replaced atomically: a run cut short never leaves a torn file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def round_order(names: list[str], rnd: int) -> list[str]:
    """The cases of round ``rnd`` in timing order: led by ``names[rnd % len(names)]``, the rest shuffled by a
    generator seeded with ``rnd`` (the same order in every run and on every rank). A plain rotation would keep
    each case behind the same predecessor in every round."""
    lead = names[rnd % len(names)]
    rest = [name for name in names if name != lead]
    random.Random(rnd).shuffle(rest)
    return [lead, *rest]


def time_in_rounds(
    cases: dict[str, Callable[[], object]], rounds: int, time_one: Callable[[Callable[[], object]], float]
) -> dict[str, list[float]]:
    """``{name: [ms per round]}``: every case timed once per round by ``time_one(case)``, in ``round_order``."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for rnd in range(rounds):
        for name in round_order(list(cases), rnd):
            times[name].append(time_one(cases[name]))
    return times


def ratio_over_rounds(times: list[float], base: list[float]) -> float:
    """The median over rounds of a case's time over its baseline's time in the same round."""
    if len(times) != len(base) or not times:
        raise ValueError(f"expected one time per round on both sides, got {len(times)} and {len(base)}")
    return statistics.median(t / b for t, b in zip(times, base, strict=True))


def back_to_back_ms(
    fn: Callable[[], object], calls: int, batches: int,
    event: Callable[[], object] | None = None, sync: Callable[[], object] | None = None,
) -> float:  # fmt: skip
    """Median over ``batches`` of the ms per call of ``calls`` calls of ``fn`` issued back to back, one pair of CUDA
    events around each batch, no L2 flush. One untimed call first (clocks up, lazy work done). ``event`` / ``sync``
    default to ``torch.cuda.Event(enable_timing=True)`` / ``torch.cuda.synchronize``."""
    event = event or (lambda: torch.cuda.Event(enable_timing=True))
    sync = sync or torch.cuda.synchronize
    fn()
    sync()
    pairs = []
    for _ in range(batches):
        start, end = event(), event()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        pairs.append((start, end))
    sync()
    return statistics.median(start.elapsed_time(end) / calls for start, end in pairs)


def kernel_events_us(events: Iterable, calls: int) -> dict[str, float]:
    """GPU us per call of each kernel (by name) among ``torch.profiler`` ``events`` of ``calls`` calls, largest
    first; memsets are left out, as they were when the floors were measured."""
    cuda, per = torch.autograd.DeviceType.CUDA, {}
    for e in events:
        if e.device_type == cuda and not e.name.startswith("Memset"):
            per[e.name] = per.get(e.name, 0.0) + e.device_time / calls
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def profiled(fn: Callable[[], object], calls: int) -> list:
    """The ``torch.profiler`` CUDA events of ``calls`` calls of ``fn`` back to back, after one call outside the
    profile (tuning, compilation, allocation)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.events()


def kernel_us(fn: Callable[[], object], calls: int) -> dict[str, float]:
    """GPU us per call of each kernel that ``calls`` calls of ``fn`` launch, by name, largest first."""
    return kernel_events_us(profiled(fn, calls), calls)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Within: Python's garbage collector off (as it was after), so no collection lands inside a timed batch."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def host_ms(fn: Callable[[], object], calls: int, batches: int, sync: Callable[[], object] | None = None) -> float:
    """Median over ``batches`` of the host ms per call to issue ``calls`` calls of ``fn`` back to back (wall clock
    around the issuing loop only, garbage collector paused), the GPU running behind; ``sync`` (default
    ``torch.cuda.synchronize``) after each batch, outside the clock, so that the GPU's queue starts every batch
    empty and never fills. One untimed call first."""
    sync = sync or torch.cuda.synchronize
    fn()
    sync()
    per_call = []
    with gc_paused():
        for _ in range(batches):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call.append((time.perf_counter() - start) * 1e3 / calls)
            sync()
    return statistics.median(per_call)
