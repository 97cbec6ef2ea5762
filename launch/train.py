"""Fine-tune LoRA adapters of a tensor-parallel (x data-parallel) model: the built-in toy Llama on the shipped
corpus, or your Hugging Face checkpoint on your data.

    torchrun --nproc-per-node 2 launch/train.py                     # tp=2, CPU/gloo or GPU/nccl
    torchrun --nproc-per-node 4 launch/train.py --dp 2              # a (dp=2, tp=2) mesh
    torchrun --nproc-per-node 2 launch/train.py --sequence-parallel
    torchrun --nproc-per-node 2 launch/train.py --resume            # continue from the latest checkpoint
    torchrun --nproc-per-node 2 launch/train.py --model DIR --data FILE.jsonl   # your checkpoint, your data
    python launch/train.py --preset tiny                            # a world of one, without torchrun

Top to bottom: args (``cli.py``: every flag checked before anything starts), mesh, model (the toy: same seed on
every rank, ``apply_lora``, the TP plan dict applied to every block; ``--model``: ``parallel_lora.hf.from_pretrained``,
each rank reading its shards, split by the model's own plan), the AdamW loop (grad accumulation under ``no_sync``,
dp all-reduce, clipping, eval, checkpoints), teardown (adapter in PEFT format, loss plot). Writes under
``--output-dir``: ``metrics.jsonl``, ``checkpoints/step_<N>/``, ``adapter/``, ``loss.png``; it never removes
an earlier run there unless told to (``--overwrite``). ``faults.py`` bounds every wait by ``--timeout`` and turns
each failure into one line. See docs/launcher.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module
from tqdm import tqdm

if not __package__:  # run as a file (torchrun launch/train.py): import this checkout's packages, not launch/'s files
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from launch import faults, leftovers  # noqa: E402
from launch.cli import RUN_KEYS, RUN_OUTPUTS, parse_args, resume_warnings, saved_run, write_settings  # noqa: E402
from launch.data import IGNORE_INDEX, Corpus, PackedData, load_tokenizer  # noqa: E402
from launch.model import Transformer, config_for  # noqa: E402
from parallel_lora import (  # noqa: E402
    ColwiseParallelLoRA,
    LoRAConfig,
    RowwiseParallelLoRA,
    apply_lora,
    latest_checkpoint,
    load_checkpoint,
    no_sync,
    replace_file,
    save_adapter,
    save_checkpoint,
)
from parallel_lora.hf import from_pretrained, text_config  # noqa: E402  (transformers is imported when a model is built)

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Data-parallel replicas' generator seeds lie this far apart (odd, the 64-bit golden ratio: no two replicas meet).
REPLICA_STRIDE = 0x9E3779B97F4A7C15


def replica_seed(seed: int, dp_rank: int) -> int:
    """The generator seed of data-parallel replica ``dp_rank`` after the model is built: the TP ranks of a replica
    share it (their dropout masks must agree) and replicas differ (their masks must not agree), whatever offsets the
    layers add (single-device ``LoRALinear``s, at tp = 1, add none)."""
    return (seed + dp_rank * REPLICA_STRIDE) % 2**64


def rng_source(saved: dict, rank: int, dp_rank: int) -> int | None:
    """The rank whose RNG states this rank restores on ``--resume`` from a checkpoint of the run ``saved`` (its
    ``extra``): the first rank of the same replica in the saving run's ``(dp, tp)`` layout, whose TP ranks all saved
    one state; ``None`` for a replica the saving run did not have, which is seeded afresh. A checkpoint without its
    layout gives each rank its own."""
    if "tp" not in saved or "dp" not in saved:
        return rank
    return dp_rank * saved["tp"] if dp_rank < saved["dp"] else None


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to ``--lr``, then cosine decay to ``lr / 10``: a pure function of the step (nothing to
    checkpoint)."""
    if step <= args.warmup:
        return args.lr * step / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def toy_model(args: argparse.Namespace, tp_mesh: DeviceMesh, device: torch.device) -> tuple[nn.Module, Corpus, str]:
    """The built-in decoder on ``launch/corpus.txt``: the same "pretrained" base on every rank (same seed), adapters
    on every projection, then the Megatron-style plan (heads and MLP width split over tp). Returns the model, the
    data and a line describing them."""
    corpus = Corpus()
    config = config_for(args.preset, vocab_size=corpus.tokenizer.vocab_size)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = Transformer(config)
    lora_config = LoRAConfig(r=args.rank, alpha=args.alpha, dropout=args.dropout, target_modules=TARGET_MODULES)
    apply_lora(model, lora_config)  # its summary prints on rank 0 (the parallel_lora logger)
    model.activation_checkpointing = args.activation_checkpointing

    sp = args.sequence_parallel
    plan = {
        "attn.q_proj": ColwiseParallelLoRA(sequence_parallel=sp),
        "attn.k_proj": ColwiseParallelLoRA(sequence_parallel=sp),
        "attn.v_proj": ColwiseParallelLoRA(sequence_parallel=sp),
        "attn.o_proj": RowwiseParallelLoRA(sequence_parallel=sp),
        "mlp.gate_proj": ColwiseParallelLoRA(sequence_parallel=sp),
        "mlp.up_proj": ColwiseParallelLoRA(sequence_parallel=sp),
        "mlp.down_proj": RowwiseParallelLoRA(sequence_parallel=sp),
    }
    for block in model.layers:
        parallelize_module(block, tp_mesh, plan)
    if sp:
        # Blocks take and return [b, s/tp, dim]: split the (frozen, replicated) embedding output along the
        # sequence, and gather before the final norm; lm_head and the loss then run replicated on every rank
        # (the gather's backward just keeps this rank's slice of the replicated gradient).
        sp_plan = {
            "embed_tokens": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
            "norm": PrepareModuleInput(
                input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True
            ),
        }
        parallelize_module(model, tp_mesh, sp_plan)
    about = f"preset {args.preset}: {config.n_layers} layers, dim {config.dim}, {config.n_heads} heads"
    return model, corpus, about


def hf_model(args: argparse.Namespace, mesh: DeviceMesh, device: torch.device) -> tuple[nn.Module, PackedData, str]:
    """``--model DIR`` on ``--data FILE``: the file tokenized by the checkpoint's tokenizer and packed (checked
    before any weight is read), then ``from_pretrained``: a bf16 base built on the meta device, fp32 adapters on the
    seven projections, split by the model's own plan over ``mesh["tp"]``, each rank reading only its shards."""
    try:
        tokenizer = load_tokenizer(args.model, args.chat_template)
    except ValueError as e:
        faults.refuse(f"--model: {e}")
    try:
        data = PackedData(args.data, tokenizer, args.seq_len, eval_fraction=args.eval_fraction)
    except ValueError as e:
        faults.refuse(f"--data: {e}")
    lora_config = LoRAConfig(r=args.rank, alpha=args.alpha, dropout=args.dropout, target_modules=TARGET_MODULES,
                             lora_dtype=torch.float32)
    try:
        model = from_pretrained(args.checked_model, lora_config, mesh=mesh, device=device, seed=args.seed,
                                verbose=True)  # the library logger speaks on rank 0 only
    except ValueError as e:  # tensors the checkpoint lacks, or of other shapes than its config.json gives
        faults.refuse(f"--model: {e}")
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    text = text_config(model.config)
    about = (f"model {args.model} ({type(model).__name__}): {text.num_hidden_layers} layers, hidden "
             f"{text.hidden_size}, {text.num_attention_heads} heads / {text.num_key_value_heads} kv heads, bf16 base, "
             f"fp32 adapters; data {args.data}: {len(data.train_starts)} train / {len(data.eval_starts)} eval "
             f"windows of {args.seq_len} tokens")
    return model, data, about


def forward(model: nn.Module, inputs: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    """Logits ``[b, s, vocab]`` of ``inputs`` ``[b, s]`` int64 (in the base's dtype, or bf16 under ``--autocast``)."""
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=args.autocast):
        # Targets come shifted, with -100 on the prompt: the loss is ours, so no labels= for transformers.
        return model(inputs, use_cache=False).logits if args.model else model(inputs)


def summed_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed (fp32) over the targets that are not ``IGNORE_INDEX``."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def evaluate(model: nn.Module, data: PackedData, args: argparse.Namespace, dp_mesh: DeviceMesh,
             device: torch.device) -> float:
    """Mean loss per target over every held-out window: each dp rank sums its share, one all-reduce adds them."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [summed loss, targets]
    with torch.no_grad():
        for inputs, targets in data.eval_batches(args.batch_size, dp_mesh.get_local_rank(), args.dp):
            inputs, targets = inputs.to(device), targets.to(device)
            total[0] += summed_loss(forward(model, inputs, args), targets).double()
            total[1] += (targets != IGNORE_INDEX).sum()
    if args.dp > 1:
        dist.all_reduce(total, group=dp_mesh.get_group())
    model.train()
    return (total[0] / total[1]).item()


def average_over_dp(params: list[torch.Tensor], group: dist.ProcessGroup, dp: int) -> None:
    """Average the adapter gradients over data-parallel ranks: one all-reduce of a flat buffer of the
    local shards (every dp rank holds the same TP shards, so the local tensors line up)."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dp
    for g, chunk in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(chunk.view_as(g))


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def keep_metrics_until(path: Path, step: int) -> None:
    """Keep the lines of ``metrics.jsonl`` up to ``step`` (the resumed one), so it holds one line per step."""
    kept = [r for r in read_metrics(path) if r["step"] <= step]
    replace_file(path, "".join(json.dumps(r) + "\n" for r in kept).encode())  # a crash keeps the old history


def plot_loss(rows: list[dict], png: Path, title: str, unit: str) -> bool:
    """Draw the training (and eval) loss curves to ``png``; without matplotlib (the ``[train]`` extra), warn and
    draw nothing."""
    try:
        import matplotlib
    except ImportError:
        print(f"warning: matplotlib is not installed, so {png} was not drawn (pip install -e '.[train]')",
              file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1.5, label="train")
    evals = [r for r in rows if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", lw=1.5, ms=3, label="eval")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (nats / {unit})")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, description=__doc__)  # exits with code 2, one message, on a bad flag
    out = Path(args.output_dir)
    ckpt_root, metrics_path = out / "checkpoints", out / "metrics.jsonl"

    # -- mesh: (dp, tp); the tp slice drives the LoRA layers, the dp slice averages their gradients ------------
    device = faults.local_device()
    dp, tp = args.dp, args.tp
    mesh = faults.init_distributed(device.type, dp, tp, args.timeout, ckpt_root)
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    rank, dp_rank = dist.get_rank(), dp_mesh.get_local_rank()

    # -- model and data: the toy decoder and corpus, or --model DIR on --data FILE ----------------------------
    faults.at("model set-up")
    if args.model:
        model, data, about = hf_model(args, mesh, device)
    else:
        model, data, about = toy_model(args, tp_mesh, device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay, fused=True)
    torch.manual_seed(replica_seed(args.seed, dp_rank))  # the dropout seeds are drawn from this generator

    # -- resume, start fresh, or replace the earlier run (cli.py refused anything else) ----------------------
    faults.at("checkpoint load")
    run_info = {k: getattr(args, k) for k in RUN_KEYS}
    start_step = 0
    latest = latest_checkpoint(ckpt_root) if args.resume else None
    if latest is not None:
        saved = saved_run(latest)
        source = rng_source(saved, rank, dp_rank)
        try:
            meta = load_checkpoint(latest, model, optimizer, rng_from=source)
        except ValueError as e:  # the checkpoint's adapters do not fit this model
            faults.refuse(f"--resume: {e}")
        start_step = faults.RUN.step = meta["step"]
        if source is None:  # a replica the saving run did not have: a state of its own, alike on its TP ranks
            torch.manual_seed(replica_seed(args.seed + start_step, dp_rank))
        if rank == 0:
            for line in resume_warnings(out, args, saved):  # per setting changed since the run in --output-dir
                print(line)
    if rank == 0:
        if swept := leftovers.sweep(out):  # temporaries of writes an earlier, killed run left (their writer is gone)
            print(swept)
        if args.overwrite:
            for name in RUN_OUTPUTS:  # the earlier run's outputs only: anything else in the directory stays
                path = out / name
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
            print(f"overwrite: removed the earlier run's {', '.join(RUN_OUTPUTS)} from {out}")
        out.mkdir(parents=True, exist_ok=True)
        write_settings(out, args)  # <output-dir>/config.yaml: this run's resolved flags
        if args.resume:
            print(f"resuming from {latest} at step {start_step}" if latest else
                  f"resume: no checkpoint in {ckpt_root}, starting at step 0")
        keep_metrics_until(metrics_path, start_step)
        print(f"mesh dp={dp} x tp={tp} on {device.type}, sequence_parallel={args.sequence_parallel}, "
              f"autocast={args.autocast}; {about}; batch {args.batch_size}x{args.seq_len} x accum {args.grad_accum} "
              f"x dp {dp}", flush=True)
    dist.barrier()

    # -- loop -----------------------------------------------------------------------------------------------
    metrics = open(metrics_path, "a") if rank == 0 else None
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * dp
    eval_every = args.eval_every if args.model and len(data.eval_starts) else 0
    eval_loss = None
    model.train()  # from_pretrained returns the model in eval mode
    with tqdm(total=args.steps, initial=start_step, desc="train", unit="step", disable=rank != 0) as bar:
        for step in range(start_step + 1, args.steps + 1):
            faults.at("forward/backward", step)
            t0 = time.perf_counter()
            lr = lr_at(step, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batches = [data.batch(seed=args.seed, step=step, micro_step=micro, batch_size=args.batch_size,
                                  seq_len=args.seq_len, dp_rank=dp_rank, dp=dp) for micro in range(args.grad_accum)]
            # The step's loss is the mean over every target of the global batch (prompt tokens carry none): each
            # rank scales its summed loss by dp / (global target count), and the dp all-reduce averages.
            n_targets = sum(int((t != IGNORE_INDEX).sum()) for _, t in batches)
            if dp > 1:  # the targets are counted on the host: only dp > 1 needs the device (and a sync)
                count = torch.tensor(n_targets, device=device)
                dist.all_reduce(count, group=dp_mesh.get_group())
                n_targets = int(count.item())
            scale = dp / n_targets
            loss_sum = torch.zeros((), device=device)
            for micro, (inputs, targets) in enumerate(batches):
                inputs, targets = inputs.to(device), targets.to(device)
                # Defer the TP reductions of the replicated adapter grads to the last micro-step's backward.
                last = micro == args.grad_accum - 1
                with contextlib.nullcontext() if last else no_sync(model):
                    loss = summed_loss(forward(model, inputs, args), targets) * scale
                    loss.backward()
                loss_sum += loss.detach()
            if step == args.fail_at_step and rank == args.fail_rank:
                print(f"[rank {rank}] injected failure at step {step}", flush=True)
                os._exit(1)
            if dp > 1:
                faults.at("gradient all-reduce over dp", step)
                average_over_dp(trainable, dp_mesh.get_group(), dp)
                dist.all_reduce(loss_sum, group=dp_mesh.get_group())
                loss_sum /= dp
            faults.at("gradient clipping", step)  # the norm of DTensor grads is reduced over tp
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_value = loss_sum.item()
            grad_norm = float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)
            tokens_per_s = tokens_per_step / (time.perf_counter() - t0)
            row = {"step": step, "loss": loss_value, "tokens_per_s": tokens_per_s, "lr": lr, "grad_norm": grad_norm}
            if eval_every and (step % eval_every == 0 or step == args.steps):
                faults.at("eval", step)
                row["eval_loss"] = eval_loss = evaluate(model, data, args, dp_mesh, device)
            if metrics is not None:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
            postfix = {"loss": f"{loss_value:.4f}", "tok_s": f"{tokens_per_s:,.0f}"}
            bar.set_postfix(postfix if eval_loss is None else {**postfix, "eval": f"{eval_loss:.4f}"})
            bar.update()
            if step % args.save_every == 0 or step == args.steps:
                faults.at("checkpoint save", step)
                save_checkpoint(ckpt_root, model, optimizer, step, extra={**run_info, "tp": tp})

    # -- teardown: the adapter (PEFT format), the loss curve ---------------------------------------------------
    faults.at("adapter save")
    save_adapter(model, out / "adapter", base_model_name_or_path=args.model)  # the toy model's: None
    if rank == 0:
        metrics.close()
        rows = read_metrics(metrics_path)
        if rows:
            what = f"'{Path(args.model).name}'" if args.model else f"'{args.preset}'"
            title = f"LoRA r={args.rank} on {what}, dp={dp} x tp={tp}, sp={args.sequence_parallel}"
            plotted = plot_loss(rows, out / "loss.png", title, "token" if args.model else "char")
            evals = [r for r in rows if "eval_loss" in r]
            eval_note = f"; eval loss {evals[-1]['eval_loss']:.4f} (step {evals[-1]['step']})" if evals else ""
            print(f"loss {rows[0]['loss']:.4f} (step {rows[0]['step']}) -> {rows[-1]['loss']:.4f} "
                  f"(step {rows[-1]['step']}){eval_note}; wrote {out}/metrics.jsonl, adapter/, "
                  f"{'loss.png, ' if plotted else ''}checkpoints/")
    dist.destroy_process_group()


if __name__ == "__main__":
    # faults.run_main leaves through os._exit: without interpreter finalization. On gloo the process groups
    # outlive destroy_process_group() (DTensor keeps references to them) and so do their worker threads. A worker
    # still releasing a finished collective's tensors takes the GIL; during finalization that ends the thread
    # through a noexcept frame, and the rank dies of SIGABRT after a complete run (pytorch/pytorch#179291).
    # Everything is written and closed by then.
    faults.run_main(main)
