"""``benchmarks.plot``: the PNG beside the JSON and the markdown table of docs/benchmarks.md."""

from __future__ import annotations

import json

import pytest

from benchmarks import plot

pytest.importorskip("matplotlib")


def layer_json(tmp_path):
    rows = []
    for shape in ([8192, 4096, 4096, 16], [8192, 4096, 14336, 16]):
        for impl, fwd, fwdbwd, held in (("base", 1.0, 1.0, 0.0), ("parallel_lora", 1.07, 1.12, 0.25),
                                        ("peft", 1.39, 1.43, 0.25)):  # fmt: skip
            rows.append({"shape": shape, "impl": impl, "dropout": 0.0, "adapter_dtype": "bfloat16",
                         "fwd_ratio": fwd, "fwdbwd_ratio": fwdbwd, "held_mib": held})  # fmt: skip
    rows.append({**rows[1], "dropout": 0.1})  # ours alone at dropout 0.1: the other columns read "-"
    meta = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11", "triton": "3.6", "date": "2026-12-05",
            "timing": "kernel time (torch.profiler), 20 calls back to back"}  # fmt: skip
    path = tmp_path / "layer_h100.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    return path


def test_plot_writes_the_png_beside_the_json_and_prints_the_table(tmp_path, capsys):
    path = layer_json(tmp_path)
    plot.main([str(path)])
    assert (tmp_path / "layer_h100.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| M,K,N,r | adapters | dropout | parallel_lora | peft | held MiB ours / PEFT |"
    assert lines[2] == "| 8192,4096,4096,16 | bfloat16 | 0.0 | **1.070 / 1.120** | 1.390 / 1.430 | 0.25 / 0.25 |"
    assert lines[-3] == "| 8192,4096,4096,16 | bfloat16 | 0.1 | **1.070 / 1.120** | - | 0.25 / - |"


def test_plot_refuses_a_file_that_is_not_a_layer_result(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"tests": []}))
    with pytest.raises(SystemExit, match="expected the layer benchmark's JSON"):
        plot.main([str(path)])
