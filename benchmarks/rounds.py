"""Interleaved timing rounds for the benchmark scripts.

On the H200 machines here a kernel's time depends on when it runs: a cool GPU ran 10-20% faster than one
under load a minute later, and a kernel timed right after a slow, low-power one ran faster than elsewhere
(benchmarks/NOTES.md, session 9). So the scripts time every case once per round, each round led by another
case and the rest in another order, and compare a case with its baseline round by round. ``interleaved_samples``
takes that to single calls, with the same number of calls of every case (what multi-rank scripts need: every
rank must issue the same collectives). Calls timed next to other cases' calls are not timed as in a block of
their own: on the H200 a cuBLAS GEMM ran 5-10% faster interleaved than in its own blocks (NOTES.md, session 12).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable


def round_order(names: list[str], rnd: int) -> list[str]:
    """The cases of round ``rnd`` in the order to time them: led by ``names[rnd % len(names)]``, the others in
    an order shuffled by ``rnd`` (seeded: the same for every run). A plain rotation kept every case behind the
    same predecessor in every round, and a case timed after a slow, low-power one reads fast: that made one
    GEMM config look up to 12% faster than the library's in a config sweep, and no faster with the slow case
    left out (benchmarks/NOTES.md, sessions 9 and 13)."""
    lead = names[rnd % len(names)]
    rest = [name for name in names if name != lead]
    random.Random(rnd).shuffle(rest)
    return [lead, *rest]


def time_in_rounds(
    cases: dict[str, Callable[[], object]], rounds: int, time_one: Callable[[Callable], float]
) -> dict[str, list[float]]:
    """``{name: [ms per round]}``: every case timed once per round by ``time_one(case)``, in ``round_order``."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for rnd in range(rounds):
        for name in round_order(list(cases), rnd):
            times[name].append(time_one(cases[name]))
    return times


def ratio_over_rounds(times: list[float], base: list[float]) -> float:
    """The median over rounds of a case's time over its baseline's time in the same round."""
    return statistics.median(t / b for t, b in zip(times, base, strict=True))


def interleaved_samples(cases: dict[str, Callable[[], object]], samples: int) -> dict[str, list[float]]:
    """Milliseconds (CUDA events) of ``samples`` calls of every case, taken in turn: sample ``i`` of each case
    runs next to sample ``i`` of the others, in ``round_order(names, i)``, each call after the same L2 flush as
    ``triton.testing.do_bench`` (a 256 MB fill). Compare a case with its baseline sample by sample
    (``ratio_over_rounds``). The cases are called once each first (tuning, compilation, allocator)."""
    import torch

    names = list(cases)
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    for case in cases.values():
        case()
    torch.cuda.synchronize()
    events: dict[str, list] = {name: [] for name in names}
    for i in range(samples):
        for name in round_order(names, i):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            cases[name]()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: [start.elapsed_time(end) for start, end in pairs] for name, pairs in events.items()}


def back_to_back_ms(
    fn: Callable[[], object], calls: int, batches: int, event: Callable[[], object] | None = None,
    sync: Callable[[], object] | None = None,
) -> float:
    """Median over ``batches`` of the ms per call of ``calls`` calls of ``fn`` issued back to back, one pair of
    CUDA events around each batch, with no L2 flush between calls. ``do_bench`` flushes before every call, and
    the flush's write-back ran into the timed call: ~50 us on each, and varying (NOTES.md, sessions 15 and 27),
    which pulls every ratio towards 1 and blurs it. A step of a real model runs its layers back to back too.
    ``event`` / ``sync`` default to ``torch.cuda.Event(enable_timing=True)`` / ``torch.cuda.synchronize``."""
    if event is None or sync is None:
        import torch

        event = event or (lambda: torch.cuda.Event(enable_timing=True))
        sync = sync or torch.cuda.synchronize
    fn()  # the clocks up, and any lazy work done, before the first batch
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
