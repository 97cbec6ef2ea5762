"""Interleaved timing rounds for the benchmark scripts.

On the H200 machines here a kernel's time depends on when it runs: a cool GPU ran 10-20% faster than one
under load a minute later, and a kernel timed right after a slow, low-power one ran faster than elsewhere
(benchmarks/NOTES.md, session 9). So the scripts time every case once per round, each round led by another
case, and compare a case with its baseline round by round.
"""

from __future__ import annotations

import statistics


def round_order(names: list[str], rnd: int) -> list[str]:
    """The cases of round ``rnd`` in the order to time them: ``names`` rotated to start at its ``rnd``-th."""
    shift = rnd % len(names)
    return names[shift:] + names[:shift]


def ratio_over_rounds(times: list[float], base: list[float]) -> float:
    """The median over rounds of a case's time over its baseline's time in the same round."""
    return statistics.median(t / b for t, b in zip(times, base, strict=True))
