"""parallel_lora: LoRA adapters on Megatron-style tensor-parallel linear layers, with fused Triton kernels."""

from .config import LoRAConfig
from .functional import lora_linear
from .layers import LoRALinear, apply_lora
from .parallel import ColumnParallelLoRALinear, RowParallelLoRALinear, no_sync

__all__ = [
    "ColumnParallelLoRALinear",
    "LoRAConfig",
    "LoRALinear",
    "RowParallelLoRALinear",
    "apply_lora",
    "lora_linear",
    "no_sync",
]
__version__ = "0.1.0"
