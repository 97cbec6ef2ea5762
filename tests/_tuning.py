"""``one_candidate``: what GPU tests tune with (``conftest``): one config per launch, no timing."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import triton


def one_candidate(real_tune: Callable[..., triton.Config]) -> Callable[..., triton.Config]:
    """A stand-in for ``tuning.tune``: one of the configs ``prune`` keeps, picked without timing by a hash of the
    kernel variant (its name, dtypes and constexprs), so every size of a variant compiles the same config and the
    variants spread over the list. One candidate, or a CUDA-graph capture, goes to ``real_tune``."""
    from triton.runtime.errors import OutOfResources

    from parallel_lora.kernels import tuning

    def tune(spec, kernel, grid, args, consts) -> triton.Config:
        listed = spec.configs()
        kept = tuning.prune(spec, listed, dict(zip(kernel.arg_names, args, strict=False)), **consts)
        if len(kept) == 1 or torch.cuda.is_current_stream_capturing():
            return real_tune(spec, kernel, grid, args, consts)
        dtypes = [str(a.dtype) for a in args if isinstance(a, torch.Tensor)]
        start = zlib.crc32(repr((spec.name, kernel.__name__, dtypes, sorted(consts.items()))).encode())
        for cfg in [listed[(start + i) % len(listed)] for i in range(len(listed))]:
            if not any(cfg is c for c in kept):
                continue
            try:  # as ``tune`` does: a config the compiler refuses is skipped
                kernel[grid](*args, **consts, **cfg.all_kwargs())
            except OutOfResources:
                continue
            return cfg
        raise RuntimeError(f"{spec.name}: no config of {kept} compiles for this launch")

    return tune
