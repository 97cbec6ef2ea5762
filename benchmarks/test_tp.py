"""``benchmarks.tp``: its rows, and the whole flow of one shape at world size 1 on the CPU (gloo, Triton's
interpreter, a stand-in clock)."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from benchmarks import tp

KEYS = {"world_size", "impl", "step_ms", "ratio_to_frozen"}


def test_tp_rows_take_each_step_to_the_frozen_step_of_the_same_round():
    times = {
        "frozen/fwd": [1.0, 2.0, 1.0], "frozen/step": [2.0, 4.0, 2.0],
        "parallel_lora/fwd": [1.1, 2.2, 1.1], "parallel_lora/step": [2.1, 4.2, 3.0],
    }  # fmt: skip
    frozen, lora = tp.tp_rows((8192, 4096, 14336, 16), 2, times)
    assert KEYS <= set(frozen) and KEYS <= set(lora)
    assert (frozen["impl"], frozen["ratio_to_frozen"], frozen["world_size"]) == ("frozen", 1.0, 2)
    assert lora["ratio_to_frozen"] == pytest.approx(1.05)  # rounds 1.05, 1.05, 1.5: a slow round does not move it
    assert lora["step_ms"] == pytest.approx(3.0) and lora["fwd_ratio_to_frozen"] == pytest.approx(1.1)


def test_tp_times_the_lora_pair_the_frozen_pair_and_the_plain_pair_at_world_size_one(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    monkeypatch.setattr(tp, "DEVICE", "cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        calls = []
        rows = tp.measure((32, 64, 128, 8), init_device_mesh("cpu", (1,)), lambda f: calls.append(f()) or 1.0, 2)
    finally:
        dist.destroy_process_group()
    assert [row["impl"] for row in rows] == ["frozen", "parallel_lora", "lora_linear"]
    assert len(calls) == 2 * 2 * 3  # forward and step of each pair, twice
    assert all(KEYS <= set(row) and row["ratio_to_frozen"] == 1.0 for row in rows)
