"""Tensor-parallel LoRA: column/row-parallel layers on a 1-D DeviceMesh and their ``ParallelStyle``s."""

from .layers import ColumnParallelLoRALinear, RowParallelLoRALinear, no_sync
from .styles import ColwiseParallelLoRA, RowwiseParallelLoRA, lora_plan

__all__ = [
    "ColumnParallelLoRALinear",
    "ColwiseParallelLoRA",
    "RowParallelLoRALinear",
    "RowwiseParallelLoRA",
    "lora_plan",
    "no_sync",
]
