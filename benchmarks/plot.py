"""Plot a bench_lora.py JSON: fwd and fwd+bwd ratios to the cuBLAS base, one group of bars per shape
(dropout 0, bf16 adapters), and print the two markdown tables of ``docs/benchmarks.md``: ours against
the best other implementation of each row (bold where ours is the fastest), then every row.

    python benchmarks/plot.py benchmarks/results/2026-12-02-nvidia_h200.json docs/img/benchmarks.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(json_path: str, png_path: str) -> None:
    data = json.loads(Path(json_path).read_text())
    rows = [
        r for r in data["rows"] if r["impl"] != "base" and r["dropout"] == 0.0 and r["adapter_dtype"] == "bfloat16"
    ]
    shapes = sorted({tuple(r["shape"]) for r in rows}, key=lambda s: (s[0] != 8192, s[1], s[2], s[3]))
    impls = sorted({r["impl"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    width = 0.8 / len(impls)
    for ax, key, title in zip(axes, ("fwd_ratio", "fwdbwd_ratio"), ("forward", "forward + backward (W frozen)"),
                              strict=True):
        for i, impl in enumerate(impls):
            values = []
            for shape in shapes:
                match = [r[key] for r in rows if tuple(r["shape"]) == shape and r["impl"] == impl]
                values.append(match[0] if match else float("nan"))
            ax.bar([j + i * width for j in range(len(shapes))], values, width, label=impl)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
        ax.set_xticklabels([f"{k}->{n}\nr={r}\nM={m}" for m, k, n, r in shapes], fontsize=8)
        ax.set_title(title)
        ax.set_ylabel("time / cuBLAS base F.linear")
    axes[0].legend(fontsize=8)
    meta = data["meta"]
    mode = ", CUDA-graph replays (GPU time)" if any(r.get("graph") for r in data["rows"]) else ""
    fig.suptitle(f"{meta['gpu']}, bf16, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}{mode}")
    fig.tight_layout()
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)


def table(json_path: str) -> str:
    """Every row: shape, adapters, dropout, impl, times, ratios and memory held, ours in bold."""
    lines = [
        "| M,K,N,r | adapters | dropout | impl | fwd ms | fwd+bwd ms | fwd / base | fwd+bwd / base | held MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in json.loads(Path(json_path).read_text())["rows"]:
        impl = f"**{r['impl']}**" if r["impl"] == "parallel_lora" else r["impl"]
        lines.append(
            f"| {','.join(map(str, r['shape']))} | {r['adapter_dtype']} | {r['dropout']} | {impl} | "
            f"{r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | {r['fwd_ratio']:.3f} | {r['fwdbwd_ratio']:.3f} | "
            f"{r['held_mib']:.1f} |"
        )
    return "\n".join(lines)


def summary(json_path: str) -> str:
    """Per (shape, adapters, dropout): our ratios against the best other implementation's, held memory."""
    rows = json.loads(Path(json_path).read_text())["rows"]
    lines = [
        "| M,K,N,r | adapters | dropout | ours fwd | best other fwd | ours fwd+bwd | best other fwd+bwd "
        "| held MiB ours / PEFT |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cases = dict.fromkeys((tuple(r["shape"]), r["adapter_dtype"], r["dropout"]) for r in rows)
    for shape, adapters, dropout in cases:
        group = {r["impl"]: r for r in rows if (tuple(r["shape"]), r["adapter_dtype"], r["dropout"]) == (
            shape, adapters, dropout)}  # fmt: skip
        ours = group["parallel_lora"]
        others = [r for name, r in group.items() if name not in ("base", "parallel_lora")]
        cells = []
        for key in ("fwd_ratio", "fwdbwd_ratio"):
            best = min(others, key=lambda r, key=key: r[key])
            mark = "**" if ours[key] <= best[key] else ""
            cells += [f"{mark}{ours[key]:.3f}{mark}", f"{best[key]:.3f} ({best['impl']})"]
        peft = group.get("peft", {}).get("held_mib", float("nan"))
        lines.append(
            f"| {','.join(map(str, shape))} | {adapters} | {dropout} | {' | '.join(cells)} | "
            f"{ours['held_mib']:.1f} / {peft:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    plot(sys.argv[1], sys.argv[2])
    print(summary(sys.argv[1]))
    print()
    print(table(sys.argv[1]))
