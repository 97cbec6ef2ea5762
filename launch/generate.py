"""Greedy completion of a prompt by a Hugging Face checkpoint with a trained LoRA adapter (and without it).

    python launch/generate.py --model DIR --adapter runs/train/adapter --prompt "The old fox" --compare
    torchrun --nproc-per-node 2 launch/generate.py --model DIR --adapter ... --prompt ...   # tensor-parallel

The adapter's configs come from its own files (``peft_format.adapter_configs``: per-module ranks and alphas
included), the base is loaded by ``parallel_lora.hf.from_pretrained`` (under torchrun, each rank reads only its
shards and the model splits by its own TP plan), the adapter by ``load_adapter`` (a file ``save_adapter`` or PEFT
wrote); ``--compare`` also prints the base model's completion, with the adapter disabled, so you see what training
changed. The flags, the checkpoint and the adapter are checked before anything starts (one message, from rank 0,
exit code 2); a collective that fails or waits past ``--timeout`` ends the job with one line per rank
(``faults.py``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

if not __package__:  # run as a file (torchrun launch/generate.py): import this checkout's packages, not launch/'s files
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from launch import faults  # noqa: E402
from launch.cli import RankZeroParser, add_launch_flags, launch_problem, world_size  # noqa: E402
from launch.data import load_tokenizer  # noqa: E402
from parallel_lora import ADAPTER_CONFIG, LoRAConfig, adapter_configs, disable_adapter, load_adapter  # noqa: E402
from parallel_lora.hf import CheckedCheckpoint, check_checkpoint, from_pretrained  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(
    argv: list[str] | None = None, launching: bool = False
) -> tuple[argparse.Namespace, CheckedCheckpoint, list[LoRAConfig]]:
    """The checked arguments, the checkpoint (``check_checkpoint``'s, for ``from_pretrained``) and the adapter's
    ``LoRAConfig``s. Exits with code 2, one message from rank 0, on a bad flag, a checkpoint that cannot load at this
    TP size or an adapter it cannot rebuild. ``launching``: ``parallel-lora`` checks them before it starts processes."""
    p = RankZeroParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory (config, safetensors, tokenizer)")
    p.add_argument("--adapter", required=True,
                   help="adapter directory (adapter_model.safetensors + adapter_config.json)")
    p.add_argument("--prompt", required=True, help="text to complete")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate")
    p.add_argument("--compare", action="store_true", help="also print the base model's completion")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="base weights' dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--strict", action="store_true",
                   help="refuse an adapter trained on another base (by default: one warning line)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective may wait for the other ranks before the job stops (default 300)")
    add_launch_flags(p)
    args = p.parse_args(argv)
    problem = launch_problem(args, launching)
    if problem:
        p.error(problem)
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        p.error(f"--timeout must be a finite number > 0 (seconds), got {args.timeout}")
    try:
        checkpoint = check_checkpoint(args.model, world_size(args))
    except ValueError as e:
        p.error(f"--model: {e}")
    adapter = Path(args.adapter)
    if not (adapter / ADAPTER_CONFIG).is_file():
        p.error(f"--adapter {adapter}: no {ADAPTER_CONFIG} there (the directory training writes is "
                "<output-dir>/adapter)")
    try:
        configs = adapter_configs(adapter, lora_dtype=torch.float32)
    except ValueError as e:
        p.error(f"--adapter: {e}")
    return args, checkpoint, configs


def complete(model: torch.nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int, device: torch.device) -> str:
    """The greedy continuation of ``prompt`` by ``model`` with the Hugging Face ``tokenizer`` (the new tokens only,
    decoded without special tokens)."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    args, checkpoint, configs = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = faults.local_device()
    # Under torchrun: a (dp=1, tp=world) mesh whose groups wait at most --timeout (init_device_mesh's wait 30 min).
    mesh = faults.init_distributed(device.type, 1, world, args.timeout, None) if world > 1 else None
    try:
        tokenizer = load_tokenizer(args.model)
    except ValueError as e:
        faults.refuse(f"--model: {e}")
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    faults.at("model load")
    model = from_pretrained(checkpoint, configs, mesh=mesh, dtype=dtype, device=device)
    try:
        load_adapter(model, args.adapter, strict=args.strict)  # another base: a warning, or refused under --strict
    except ValueError as e:
        faults.refuse(f"--adapter: {e}")

    faults.at("generation")
    rows = [("adapter", complete(model, tokenizer, args.prompt, args.max_new_tokens, device))]
    if args.compare:
        with disable_adapter(model):
            rows.append(("base", complete(model, tokenizer, args.prompt, args.max_new_tokens, device)))
    if mesh is None or dist.get_rank() == 0:
        print(f"prompt:  {args.prompt}")
        for name, text in rows:
            print(f"{name + ':':<8} {text}")
    if mesh is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    # run_main leaves through os._exit, as train.py does: interpreter finalization can abort gloo's worker threads
    # after a complete run (pytorch/pytorch#179291). Everything is printed by then.
    faults.run_main(main)
