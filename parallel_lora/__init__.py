"""parallel_lora: LoRA adapters on Megatron-style tensor-parallel linear layers, with fused Triton kernels."""

from ._checkpoint import (
    checkpoint_meta,
    is_collective_failure,
    latest_checkpoint,
    load_adapter,
    load_checkpoint,
    remove_stale_checkpoint_temporaries,
    save_adapter,
    save_checkpoint,
)
from ._dropout import P_RANGE, valid_p
from ._files import remove_stale_temporaries, replace_file
from ._log import rank
from ._merge import disable_adapter, merge_lora, unmerge_lora
from ._peft_format import ADAPTER_CONFIG, adapter_configs
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
    # The adapter: config, op, layers (tensor-parallel ones also in parallel_lora.tp).
    "LoRAConfig",
    "lora_linear",
    "LoRALinear",
    "apply_lora",
    "ColumnParallelLoRALinear",
    "RowParallelLoRALinear",
    "ColwiseParallelLoRA",
    "RowwiseParallelLoRA",
    "lora_plan",
    "no_sync",
    "merge_lora",
    "unmerge_lora",
    "disable_adapter",
    # Adapters and training checkpoints on disk.
    "save_adapter",
    "load_adapter",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    # What a training script on the library needs (launch/ uses them):
    "checkpoint_meta",
    "is_collective_failure",
    "remove_stale_checkpoint_temporaries",
    "remove_stale_temporaries",
    "replace_file",
    "rank",
    "ADAPTER_CONFIG",
    "adapter_configs",
    "P_RANGE",
    "valid_p",
]
__version__ = "0.1.0"
