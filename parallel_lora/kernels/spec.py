"""``KernelSpec``: what the launcher and the tuner know of one kernel."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import triton


def adapter_bytes(tile: int, stages: int, elem: int, sizes: dict, arg: str) -> int:
    """Shared memory of an adapter's ``tile`` elements in ``stages`` buffers: read in the adapter's own dtype
    (``sizes[arg]``, e.g. fp32 over 16-bit activations) plus one buffer of its tile converted to ``elem`` bytes."""
    t = sizes.get(arg)
    own = t.element_size() if hasattr(t, "element_size") else elem
    return tile * (stages * own + (elem if own != elem else 0))


def _no_descriptors(consts: dict) -> bool:
    return False


@dataclass(frozen=True)
class KernelSpec:
    """How to launch and tune one kernel: ``smem(config kwargs, stages, element size, sizes and constexprs)`` in
    bytes, ``work(sizes)`` in multiply-adds, ``descriptors(constexprs)``: whether it builds TMA descriptors."""

    name: str
    configs: Callable[[], list[triton.Config]]
    key: Sequence[str]
    smem: Callable[[dict, int, int, dict], int]
    fits: Callable[[dict, dict], bool]
    work: Callable[[dict], int]
    dtype_arg: str
    interp: Mapping[str, int] = field(default_factory=dict, compare=False)
    descriptors: Callable[[dict], bool] = _no_descriptors

    def __post_init__(self):
        if self.key[0] != "M":
            raise ValueError(f"{self.name}: the autotune key must start with the token count M, got {self.key}")
