"""Fused Triton kernels for the LoRA op (one device / one TP shard; no DTensor, no autograd here).

``forward`` / ``backward`` mirror ``parallel_lora.eager`` (the oracle) and check their operands at a layout's
first call; ``dropout_keep_mask`` materializes the keep-mask the kernels regenerate from the seed, for tests.
The kernels also run in Triton's CPU interpreter when ``TRITON_INTERPRET=1`` is set before this package is
imported. ``docs/kernels.md`` walks through the launches.
"""

from .dispatch import backward, forward
from .dropout_mask import dropout_keep_mask

__all__ = ["backward", "dropout_keep_mask", "forward"]
