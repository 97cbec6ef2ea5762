"""What users run around the library that several test files repeat."""

from __future__ import annotations

import torch.nn as nn


def reset_every_module(model: nn.Module) -> None:
    """The usual meta-device recipe (FSDP's tests, Lightning, after ``to_empty()``): ``reset_parameters()`` on
    every module that has it, in ``modules()`` order (a LoRA layer's own reset, then its factors', which must
    not draw B like a weight)."""
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
