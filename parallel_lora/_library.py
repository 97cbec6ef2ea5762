"""The ``parallel_lora::`` ops defined on the dispatcher; docs/kernels.md says why not ``torch.library.custom_op``."""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIB = torch.library.Library("parallel_lora", "FRAGMENT")


def define(name: str, schema: str, impl: Callable, fake: Callable, tags: tuple = ()) -> None:
    """``parallel_lora::name``: one ``CompositeExplicitAutograd`` kernel and a fake one, pt2-compliant; once per
    process (a second copy of the package, as ``benchmarks.layer --old`` imports, reuses the first's)."""
    try:
        getattr(torch.ops.parallel_lora, name)
        return
    except AttributeError:
        pass
    _LIB.define(name + schema, tags=(*tags, torch.Tag.pt2_compliant_tag))
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"parallel_lora::{name}", fake, lib=_LIB)
