"""``KernelSpec``: what the launcher and the tuner know of one kernel (its own module, so neither imports the other
for it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import triton


def _no_descriptors(consts: dict) -> bool:
    return False


@dataclass(frozen=True)
class KernelSpec:
    """How to launch and tune one kernel: its configs, autotune key, smem estimate and shape filter."""

    name: str
    configs: Callable[[], list[triton.Config]]
    key: Sequence[str]  # autotune key, the token count "M" first
    smem: Callable[[dict, int, int, dict], int]  # (config kwargs, stages, elem size, sizes + constexprs)
    fits: Callable[[dict, dict], bool]
    work: Callable[[dict], int]  # multiply-adds of the launch, from its size arguments
    dtype_arg: str  # a tensor argument whose element size and device stand for all operands
    interp: Mapping[str, int] = field(default_factory=dict, compare=False)  # the interpreter's one config
    # From the call's constexprs: whether the kernel builds device-side TMA descriptors, whose memory Triton
    # asks its allocator for at every launch (``workspace.with_descriptor_scratch``).
    descriptors: Callable[[dict], bool] = _no_descriptors

    def __post_init__(self):
        if self.key[0] != "M":
            raise ValueError(f"{self.name}: the autotune key must start with the token count M, got {self.key}")
