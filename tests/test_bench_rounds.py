"""The benchmark scripts' timing order (``benchmarks/rounds.py``): how rounds interleave the cases."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rounds import ratio_over_rounds, round_order, time_in_rounds  # noqa: E402

NAMES = ["cublas", "ours", "peft", "addmm", "slow_fallback"]


def test_every_round_times_every_case_once_and_each_round_is_led_by_another():
    for rnd in range(12):
        order = round_order(NAMES, rnd)
        assert sorted(order) == sorted(NAMES)
        assert order[0] == NAMES[rnd % len(NAMES)]


def test_no_case_follows_the_same_case_in_every_round():
    # A case timed after a slow one reads fast on the H200: over a few rounds every case must have had more
    # than one predecessor, or such a bias would sit on it in every round (a rotation did exactly that).
    rounds = [round_order(NAMES, rnd) for rnd in range(5)]
    for name in NAMES:
        before = {order[order.index(name) - 1] for order in rounds if order.index(name) > 0}
        assert len(before) > 1, (name, before)


def test_the_order_is_the_same_in_every_run():
    # Multi-rank scripts need every rank to issue the same calls in the same order.
    assert [round_order(NAMES, rnd) for rnd in range(4)] == [round_order(list(NAMES), rnd) for rnd in range(4)]


def test_ratio_is_the_median_of_per_round_ratios():
    # Round by round: a base that drifts between rounds does not move the ratio.
    assert ratio_over_rounds([2.0, 3.0, 10.0], [1.0, 1.0, 1.0]) == 3.0
    assert ratio_over_rounds([1.1, 2.2, 3.3], [1.0, 2.0, 3.0]) == pytest.approx(1.1)


def test_time_in_rounds_times_each_case_once_per_round_in_round_order():
    calls = []
    cases = {name: (lambda n=name: n) for name in NAMES}
    times = time_in_rounds(cases, 3, lambda case: calls.append(case()) or float(len(calls)))
    assert calls == [name for rnd in range(3) for name in round_order(NAMES, rnd)]
    assert all(len(ts) == 3 for ts in times.values())
    assert times[calls[0]][0] == 1.0  # the first call of round 0 is its leader's first time
