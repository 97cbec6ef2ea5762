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
    "checkpoint_meta",  # a checkpoint's step and extras, read without loading it
    "is_collective_failure",  # tell a failed collective from a bug, to exit with the right code
    "remove_stale_checkpoint_temporaries",  # clean the checkpoint writes a killed run left
    "remove_stale_temporaries",  # clean the atomic-file temporaries a killed run left
    "replace_file",  # write a file atomically, as the library writes its own
    "rank",  # this process's rank, before the process group exists too
    "ADAPTER_CONFIG",  # the file that marks an adapter directory
    "adapter_configs",  # the LoRAConfigs that rebuild a saved adapter
    "P_RANGE",  # LoRAConfig.dropout's range, for a command line's message
    "valid_p",  # LoRAConfig.dropout's check, for a command line's flag
]
__version__ = "0.1.0"
