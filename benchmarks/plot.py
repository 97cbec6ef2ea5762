"""Plot a layer benchmark's JSON beside it, and print its rows as the markdown table docs/benchmarks.md uses.

    python -m benchmarks.plot benchmarks/results/layer_h100.json      # writes benchmarks/results/layer_h100.png

The plot has one group of bars per shape (bf16 adapters, dropout 0): each implementation's forward and
forward+backward time over the cuBLAS base's, with the floors of docs/design.md marked on a kernel-time run. The
table has a line per shape, adapter dtype and dropout: every implementation's two ratios (ours in bold) and the
memory held between forward and backward by ours and by PEFT. Needs matplotlib, not a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.layer import FLOORS

PEERS = ("parallel_lora", "torch_eager", "addmm", "peft")


def plot(data: dict, png: Path) -> None:
    """Bars of ``fwd_ratio`` and ``fwdbwd_ratio`` per shape and implementation (bf16 adapters, dropout 0)."""
    try:
        import matplotlib
    except ImportError:
        sys.exit("benchmarks.plot needs matplotlib: pip install -e '.[train]'")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if r["impl"] != "base" and r["dropout"] == 0 and r["adapter_dtype"] == "bfloat16"]
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    kernel_time = data["meta"].get("timing", "").startswith("kernel time")
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    width = 0.8 / len(impls)
    for ax, key, title, floor in zip(axes, ("fwd_ratio", "fwdbwd_ratio"), ("forward", "forward + backward (W frozen)"),
                                     (0, 1), strict=True):  # fmt: skip
        for i, impl in enumerate(impls):
            ratio = {tuple(r["shape"]): r[key] for r in rows if r["impl"] == impl}
            ax.bar([j + i * width for j in range(len(shapes))], [ratio.get(s, float("nan")) for s in shapes], width,
                   label=impl)  # fmt: skip
        if kernel_time:
            for j, shape in enumerate(shapes):
                if shape in FLOORS:
                    ax.hlines(FLOORS[shape][floor], j - width / 2, j + 0.8 - width / 2, colors="red", linestyles="--",
                              label="floor" if j == 0 else None)  # fmt: skip
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
        ax.set_xticklabels([f"{k}->{n}\nr={r}\nM={m}" for m, k, n, r in shapes], fontsize=8)
        ax.set_title(title)
        ax.set_ylabel("time / cuBLAS base F.linear")
    axes[0].legend(fontsize=8)
    meta = data["meta"]
    fig.suptitle(f"{meta['gpu']}, bf16, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}\n"
                 f"{meta.get('timing', '')}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def table(data: dict) -> str:
    """One markdown line per shape, adapter dtype and dropout: each implementation's fwd / fwd+bwd ratio to the
    base, and the MiB held between forward and backward by ours and by PEFT."""
    groups: dict[tuple, dict] = {}
    for r in data["rows"]:
        groups.setdefault((tuple(r["shape"]), r["adapter_dtype"], r["dropout"]), {})[r["impl"]] = r
    present = [name for name in PEERS if any(name in group for group in groups.values())]
    lines = [
        "| M,K,N,r | adapters | dropout | " + " | ".join(present) + " | held MiB ours / PEFT |",
        "|---" * (4 + len(present)) + "|",
    ]
    for (shape, adapters, dropout), group in groups.items():
        cells = []
        for name in present:
            r = group.get(name)
            cell = "-" if r is None else f"{r['fwd_ratio']:.3f} / {r['fwdbwd_ratio']:.3f}"
            cells.append(f"**{cell}**" if name == "parallel_lora" and r is not None else cell)
        held = [f"{group[n]['held_mib']:g}" if n in group else "-" for n in ("parallel_lora", "peft")]
        lines.append(f"| {','.join(map(str, shape))} | {adapters} | {dropout} | {' | '.join(cells)} | "
                     f"{' / '.join(held)} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.plot", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("json", type=Path, help="a layer benchmark's JSON (benchmarks/results/layer_<gpu>.json)")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: the JSON's, ending .png)")
    args = parser.parse_args(argv)
    data = json.loads(args.json.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or "meta" not in data:
        sys.exit(f"{args.json}: expected the layer benchmark's JSON, {{'meta': ..., 'rows': [...]}}")
    png = args.out or args.json.with_suffix(".png")
    plot(data, png)
    print(table(data))
    print(f"\nwrote {png}")


if __name__ == "__main__":
    main()
