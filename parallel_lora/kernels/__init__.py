"""Fused Triton kernels for the LoRA op (one device / one TP shard; no DTensor, no autograd here).

``forward`` / ``backward`` mirror ``parallel_lora.eager`` (the oracle; ``backward_unchecked`` is ``backward``
without its argument checks, for the autograd Function); ``dropout_keep_mask`` materializes
the keep-mask the kernels regenerate from the seed, for tests. The kernels also run in Triton's CPU
interpreter when ``TRITON_INTERPRET=1`` is set before this package is imported.
"""

from . import dx_grads, gemm, gemm_tma, rank_reduce, shrink, shrink_db, shrink_gemm
from .dropout_mask import dropout_keep_mask
from .lora import backward, backward_unchecked, forward

# Every module whose kernels launch through ``configs.launch`` (each imports it by name): what the benchmarks
# and tests patch to stub or record launches.
LAUNCH_MODULES = (gemm, gemm_tma, shrink, shrink_db, rank_reduce, dx_grads, shrink_gemm)

__all__ = ["LAUNCH_MODULES", "backward", "backward_unchecked", "dropout_keep_mask", "forward"]
