"""Greedy completion of a prompt by a Hugging Face checkpoint with a trained LoRA adapter (and without it).

    python launch/generate.py --model DIR --adapter runs/train/adapter --prompt "The old fox" --compare
    torchrun --nproc-per-node 2 launch/generate.py --model DIR --adapter ... --prompt ...   # tensor-parallel

The base is loaded by ``parallel_lora.hf.from_pretrained`` (under torchrun, each rank reads only its shards and
the model splits by its own TP plan), the adapter by ``load_adapter`` (a file ``save_adapter`` or PEFT wrote);
``--compare`` also prints the base model's completion, with the adapter disabled, so you see what training changed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from data import load_tokenizer  # noqa: E402  (launch/ is sys.path[0] when this file runs)

from parallel_lora import LoRAConfig, disable_adapter, load_adapter  # noqa: E402
from parallel_lora.checkpoint import ADAPTER_CONFIG  # noqa: E402
from parallel_lora.hf import check_checkpoint, from_pretrained  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory (config, safetensors, tokenizer)")
    p.add_argument("--adapter", required=True,
                   help="adapter directory (adapter_model.safetensors + adapter_config.json)")
    p.add_argument("--prompt", required=True, help="text to complete")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate")
    p.add_argument("--compare", action="store_true", help="also print the base model's completion")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="base weights' dtype (default: bfloat16 on GPU, float32 on CPU)")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return args


def adapter_lora_config(adapter: Path) -> LoRAConfig:
    """The ``LoRAConfig`` an adapter directory was trained with: its rank, alpha and target module names."""
    path = adapter / ADAPTER_CONFIG
    if not path.is_file():
        raise SystemExit(f"--adapter {adapter}: no {ADAPTER_CONFIG} there (the directory train.py writes is "
                         "<output-dir>/adapter)")
    file_config = json.loads(path.read_text())
    return LoRAConfig(r=file_config["r"], alpha=file_config["lora_alpha"],
                      use_rslora=file_config.get("use_rslora", False),
                      target_modules=tuple(file_config["target_modules"]), lora_dtype=torch.float32)


def complete(model: torch.nn.Module, tokenizer, prompt: str, max_new_tokens: int, device: torch.device) -> str:
    """The greedy continuation of ``prompt`` (the new tokens only, decoded without special tokens)."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    mesh = None
    if distributed:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("tp",))
    tp = mesh.size() if mesh is not None else 1
    try:
        check_checkpoint(args.model, tp)  # seconds, before anything heavy
        tokenizer = load_tokenizer(args.model)
    except ValueError as e:
        raise SystemExit(f"--model: {e}") from e
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = from_pretrained(args.model, adapter_lora_config(Path(args.adapter)), mesh=mesh, dtype=dtype, device=device)
    load_adapter(model, args.adapter)

    completion = complete(model, tokenizer, args.prompt, args.max_new_tokens, device)
    rows = [("adapter", completion)]
    if args.compare:
        with disable_adapter(model):
            rows.append(("base", complete(model, tokenizer, args.prompt, args.max_new_tokens, device)))
    if not distributed or dist.get_rank() == 0:
        print(f"prompt:  {args.prompt}")
        for name, text in rows:
            print(f"{name + ':':<8} {text}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # As in train.py: leave without interpreter finalization, which can abort gloo's worker threads after a
    # complete run (pytorch/pytorch#179291). Everything is printed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
