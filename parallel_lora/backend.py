"""Which implementation runs the LoRA op: the fused Triton kernels or the eager torch oracle.

No Triton import here: ``"auto"`` resolves to ``"torch"`` wherever Triton is missing or the tensors are not on a
GPU, and the kernels import this module, never the reverse.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "torch")


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    Triton fixes the mode of each ``@triton.jit`` when it is defined, so set it before importing
    ``parallel_lora.kernels``; read at every call (the kernels ask only at a launch layout's first call).
    """
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"auto"`` -> ``"triton"`` on CUDA (when Triton imports), ``"torch"`` otherwise; checks the others."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    if backend == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(
            f"backend='triton' needs CUDA tensors, got tensors on {device}; use backend='torch' (or 'auto'), "
            "or set TRITON_INTERPRET=1 before importing parallel_lora to run the kernels in Triton's interpreter"
        )
    return backend
