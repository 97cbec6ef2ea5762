"""``benchmarks.common``: rounds and ratios, shapes, GPU slugs, the JSON write and the kernel-time sum."""

from __future__ import annotations

import gc
import json
import time
from types import SimpleNamespace

import pytest
import torch

from benchmarks.common import (
    back_to_back_ms,
    gc_paused,
    gpu_slug,
    host_ms,
    kernel_events_us,
    parse_shapes,
    ratio_over_rounds,
    round_order,
    time_in_rounds,
    write_json,
)

NAMES = ["cublas", "ours", "peft", "addmm", "slow_fallback"]


def test_round_order_times_every_case_once_led_by_another_each_round():
    for rnd in range(12):
        order = round_order(NAMES, rnd)
        assert sorted(order) == sorted(NAMES)
        assert order[0] == NAMES[rnd % len(NAMES)]


def test_round_order_gives_every_case_more_than_one_predecessor():
    # A case timed after a slow one can read fast: a rotation would put that bias on the same case every round.
    rounds = [round_order(NAMES, rnd) for rnd in range(5)]
    for name in NAMES:
        before = {order[order.index(name) - 1] for order in rounds if order.index(name) > 0}
        assert len(before) > 1, (name, before)


def test_round_order_is_the_same_in_every_run():
    # Multi-rank benchmarks need every rank to issue the same calls in the same order.
    assert [round_order(NAMES, rnd) for rnd in range(4)] == [round_order(list(NAMES), rnd) for rnd in range(4)]


def test_ratio_over_rounds_is_the_median_of_same_round_ratios():
    # Round by round: a base that drifts between rounds does not move the ratio.
    assert ratio_over_rounds([2.0, 3.0, 10.0], [1.0, 1.0, 1.0]) == 3.0
    assert ratio_over_rounds([1.1, 2.2, 3.3], [1.0, 2.0, 3.0]) == pytest.approx(1.1)
    with pytest.raises(ValueError, match="one time per round"):
        ratio_over_rounds([1.0, 2.0], [1.0])


def test_time_in_rounds_times_each_case_once_per_round_in_round_order():
    calls = []
    cases = {name: (lambda n=name: n) for name in NAMES}
    times = time_in_rounds(cases, 3, lambda case: calls.append(case()) or float(len(calls)))
    assert calls == [name for rnd in range(3) for name in round_order(NAMES, rnd)]
    assert all(len(ts) == 3 for ts in times.values())
    assert times[calls[0]][0] == 1.0  # the first call of round 0 is its leader's first time


def test_back_to_back_ms_is_the_median_per_call_over_batches_after_one_untimed_call():
    clock = {"ms": 0.0, "calls": 0}
    cost = [5.0, 1.0, 1.0, 2.0, 2.0, 9.0, 9.0]  # the untimed first call, then three batches of two

    class Event:  # stands in for torch.cuda.Event: records the fake clock
        def record(self):
            self.at = clock["ms"]

        def elapsed_time(self, end):
            return end.at - self.at

    def fn():
        clock["ms"] += cost[clock["calls"]]
        clock["calls"] += 1

    ms = back_to_back_ms(fn, calls=2, batches=3, event=Event, sync=lambda: None)
    assert clock["calls"] == 1 + 2 * 3
    assert ms == 2.0  # batches of 1.0, 2.0 and 9.0 ms per call; the slow first call is not timed


def test_host_ms_clocks_only_the_issuing_loop_and_syncs_between_batches(monkeypatch):
    clock = {"s": 0.0}
    log = []
    cost = iter([9.0, 1e-3, 1e-3, 2e-3, 2e-3, 5e-3, 5e-3])  # the untimed first call, then three batches of two

    def fn():
        clock["s"] += next(cost)
        log.append("call")

    def sync():
        clock["s"] += 100.0  # waiting for the GPU: outside the clock
        log.append("sync")

    monkeypatch.setattr(time, "perf_counter", lambda: clock["s"])
    ms = host_ms(fn, calls=2, batches=3, sync=sync)
    assert ms == pytest.approx(2.0)  # batches of 1, 2 and 5 ms per call
    assert log == ["call", "sync"] + ["call", "call", "sync"] * 3


def test_gc_paused_restores_the_collector_as_it_was():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_kernel_events_sum_gpu_kernels_per_call_by_name_without_memsets_or_host_ops():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, device_type, us):
        return SimpleNamespace(name=name, device_type=device_type, device_time=us)

    events = [
        event("nvjet_gemm", cuda, 300.0), event("_lora_shrink_kernel", cuda, 40.0),
        event("Memset (Device)", cuda, 7.0), event("aten::mm", cpu, 999.0),
    ] * 2  # fmt: skip
    assert sum(kernel_events_us(events, calls=2).values()) / 1e3 == pytest.approx(0.34)  # ms per call
    assert kernel_events_us(events, calls=2) == {"nvjet_gemm": 300.0, "_lora_shrink_kernel": 40.0}
    assert list(kernel_events_us(events[::-1], calls=2)) == ["nvjet_gemm", "_lora_shrink_kernel"]  # largest first


def test_parse_shapes_reads_the_documented_form_and_rejects_others():
    assert parse_shapes("8192,4096,4096,16;2048,4096,14336,64") == [(8192, 4096, 4096, 16), (2048, 4096, 14336, 64)]
    for bad in ("8192,4096,4096", "8192,4096,4096,0", "a,b,c,d", "8192,4096,4096,16;"):
        with pytest.raises(ValueError, match="M,K,N,r"):
            parse_shapes(bad)


@pytest.mark.parametrize(
    ("name", "slug"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("AMD Instinct MI300X", "mi300x"),
    ],
)
def test_gpu_slug_is_the_model_name(name, slug):
    assert gpu_slug(name) == slug


def test_write_json_replaces_the_file_whole(tmp_path):
    path = tmp_path / "results" / "layer_h100.json"
    write_json(path, {"rows": [1]})
    write_json(path, {"rows": [1, 2]})
    assert json.loads(path.read_text()) == {"rows": [1, 2]}
    assert [p.name for p in path.parent.iterdir()] == ["layer_h100.json"]  # no temporary file left behind
