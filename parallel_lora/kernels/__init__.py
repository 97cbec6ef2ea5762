"""Fused Triton kernels for the LoRA op (one device / one TP shard; no DTensor, no autograd here).

``forward`` / ``backward`` (``dispatch``) mirror ``parallel_lora._eager`` (the oracle); importing this package
imports no Triton, which comes with ``dispatch`` at the first fused call. Set ``TRITON_INTERPRET=1`` before that
to run the kernels in Triton's CPU interpreter. ``docs/kernels.md`` walks through the launches.
"""

__all__ = ["backward", "forward"]


def __getattr__(name: str):
    if name in __all__:
        from . import dispatch

        return getattr(dispatch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
