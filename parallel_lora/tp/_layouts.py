"""Tensor-parallel placements of W, bias, A and B per layer kind: the table of docs/design.md, section 3."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Placement, Replicate, Shard


@dataclass(frozen=True)
class Layout:
    weight: Placement
    bias: Placement
    lora_A: Placement
    lora_B: Placement

    @property
    def replicated_factor(self) -> str:
        return "lora_A" if isinstance(self.lora_A, Replicate) else "lora_B"


LAYOUTS: dict[str, Layout] = {
    "column": Layout(weight=Shard(0), bias=Shard(0), lora_A=Replicate(), lora_B=Shard(0)),
    "row": Layout(weight=Shard(1), bias=Replicate(), lora_A=Shard(1), lora_B=Replicate()),
}
