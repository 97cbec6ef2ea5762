"""parallel_lora: LoRA adapters on Megatron-style tensor-parallel linear layers, with fused Triton kernels."""

from .checkpoint import latest_checkpoint, load_adapter, load_checkpoint, save_adapter, save_checkpoint
from .config import LoRAConfig
from .functional import lora_linear
from .layers import LoRALinear, apply_lora
from .merge import disable_adapter, merge_lora, unmerge_lora
from .parallel import ColumnParallelLoRALinear, RowParallelLoRALinear, no_sync
from .styles import ColwiseParallelLoRA, RowwiseParallelLoRA, lora_plan

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
