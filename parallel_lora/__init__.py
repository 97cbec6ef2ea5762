"""parallel_lora: LoRA adapters on Megatron-style tensor-parallel linear layers, with fused Triton kernels."""

from ._checkpoint import latest_checkpoint, load_adapter, load_checkpoint, save_adapter, save_checkpoint
from ._merge import disable_adapter, merge_lora, unmerge_lora
from .config import LoRAConfig
from .functional import lora_linear
from .layers import LoRALinear, apply_lora
from .tp import (
    ColumnParallelLoRALinear,
    ColwiseParallelLoRA,
    RowParallelLoRALinear,
    RowwiseParallelLoRA,
    lora_plan,
    no_sync,
)

__all__ = [
    "ColumnParallelLoRALinear",
    "ColwiseParallelLoRA",
    "LoRAConfig",
    "LoRALinear",
    "RowParallelLoRALinear",
    "RowwiseParallelLoRA",
    "apply_lora",
    "disable_adapter",
    "latest_checkpoint",
    "load_adapter",
    "load_checkpoint",
    "lora_linear",
    "lora_plan",
    "merge_lora",
    "no_sync",
    "save_adapter",
    "save_checkpoint",
    "unmerge_lora",
]
__version__ = "0.1.0"
