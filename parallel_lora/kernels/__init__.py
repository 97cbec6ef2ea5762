"""The LoRA op's fused Triton kernels: ``forward`` and ``backward`` (``dispatch``, imported at first use)."""

__all__ = ["backward", "forward"]


def __getattr__(name: str):
    if name in __all__:
        from . import dispatch

        return getattr(dispatch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
