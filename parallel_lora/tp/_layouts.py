"""Tensor-parallel layouts as data (layout "L1": one LoRA factor mirrors the base, the other is replicated).

Read by the layers, the parallel styles, the checkpoint code and ``docs/tensor_parallel.md``.

| kind   | W ``[out, in]`` | bias      | A ``[r, in]`` | B ``[out, r]`` | replicated factor |
|--------|-----------------|-----------|---------------|----------------|-------------------|
| column | Shard(0)        | Shard(0)  | Replicate     | Shard(0)       | A                 |
| row    | Shard(1)        | Replicate | Shard(1)      | Replicate      | B                 |
"""

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
    # Column: each rank owns out/tp output features. B mirrors W's row split; A sees the full input.
    "column": Layout(weight=Shard(0), bias=Shard(0), lora_A=Replicate(), lora_B=Shard(0)),
    # Row: each rank owns in/tp input features. A mirrors W's column split; B maps the summed r-vector out.
    "row": Layout(weight=Shard(1), bias=Replicate(), lora_A=Shard(1), lora_B=Replicate()),
}
