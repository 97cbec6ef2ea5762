"""LoRA configuration: one validated dataclass shared by every layer, style and checkpoint."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ._dropout import check_dropout
from .functional import BACKENDS

INIT_A_CHOICES = ("kaiming", "xavier", "gaussian")


@dataclass(frozen=True)
class LoRAConfig:
    """Hyper-parameters of a LoRA adapter: ``ValueError`` naming a field out of range; frozen once built.

    Change one with ``dataclasses.replace(config, r=16)``, which validates again.
    """

    r: int = 8
    """Rank of the update ``B @ A``; ``A`` is ``[r, in]`` and ``B`` is ``[out, r]``. Any ``r >= 1``."""

    alpha: float = 16
    """Scaling numerator: the update is multiplied by ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA)."""

    dropout: float = 0.0
    """Dropout probability on the LoRA branch only, in ``[0, 1 - 2**-16)`` (the mask's 16-bit uniforms)."""

    dropout_position: str = "pre"
    """``"pre"``: dropout on ``x`` before ``A`` (PEFT's convention). ``"post"``: on ``x A^T`` (the ``[M, r]``
    activation) before ``B``."""

    init_A: str = "kaiming"
    """Initialisation of ``A`` from its global shape: ``kaiming`` (PEFT's ``kaiming_uniform_(a=sqrt(5))``),
    ``xavier`` (xavier-uniform) or ``gaussian`` (normal, std ``1/r``). ``B`` always starts at zero."""

    use_rslora: bool = False
    """Rank-stabilised scaling ``alpha / sqrt(r)``."""

    lora_dtype: torch.dtype | None = None
    """Storage dtype of the adapters (e.g. ``torch.float32`` master adapters over a bf16 base);
    ``None`` keeps the base weight's dtype."""

    backend: str = "auto"
    """``"triton"`` (fused kernels), ``"torch"`` (eager, works everywhere) or ``"auto"``
    (Triton on CUDA tensors, torch otherwise)."""

    target_modules: tuple[str, ...] | str = field(default=("q_proj", "k_proj", "v_proj", "o_proj"))
    """Which ``nn.Linear``s ``apply_lora`` adapts: names (matched against the full dotted path or any dotted
    suffix of it, e.g. the last component), shell-style globs (``"layers.*.mlp.*"``), or ``"all-linear"``
    (every one but the output projection: ``get_output_embeddings()`` where the model has it, else ``lm_head``)."""

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"LoRAConfig.r must be an integer >= 1, got {self.r!r}")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
            raise ValueError(f"LoRAConfig.alpha must be a number > 0, got {self.alpha!r}")
        try:
            check_dropout(self.dropout, self.dropout_position, name="dropout")
        except ValueError as e:
            raise ValueError(f"LoRAConfig.{e}") from None
        if self.init_A not in INIT_A_CHOICES:
            raise ValueError(f"LoRAConfig.init_A must be one of {INIT_A_CHOICES}, got {self.init_A!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"LoRAConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.lora_dtype is not None and (
            not isinstance(self.lora_dtype, torch.dtype) or not self.lora_dtype.is_floating_point
        ):
            raise ValueError(f"LoRAConfig.lora_dtype must be a floating torch.dtype or None, got {self.lora_dtype!r}")
        if isinstance(self.target_modules, str):
            if not self.target_modules:
                raise ValueError(f"LoRAConfig.target_modules must not be empty, got {self.target_modules!r}")
        else:
            modules = tuple(self.target_modules)
            if not modules or not all(isinstance(m, str) and m for m in modules):
                raise ValueError(
                    f"LoRAConfig.target_modules must be 'all-linear' or a non-empty sequence of names/globs, "
                    f"got {self.target_modules!r}"
                )
            object.__setattr__(self, "target_modules", modules)  # normalized once, before anyone reads it

    @property
    def scale(self) -> float:
        """The factor ``s`` on the LoRA branch: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r
