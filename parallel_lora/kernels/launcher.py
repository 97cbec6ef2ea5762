"""How every kernel is launched: written once, here.

Triton's own launch path binds and specializes every argument at each call, which costs more host time than
the small kernels here run for. So a launch is bound once and then called directly:

    launch(site, tensors, runtime, describe, *how)     the one entry of every launcher
      site filled   -> site.bound.launch(tensors, runtime)              (the hit path: nothing else)
      site empty    -> spec, kernel, signature, build = describe(*how)
                       bind(spec, kernel, signature, tensors, runtime, build)
                         signature bound before -> its Bound launches
                         new signature          -> build(), the tuned config (``tuning``), Triton's launch path,
                                                   then bind its compiled kernel at the grid
                       fill the site

A ``Site`` is one launch of the op (``dispatch``) for one operand layout; a signature is a launcher's summary of
what its launch depends on but addresses and runtime scalars. Tests stub or record launches through ``bind``.
Under the interpreter nothing is compiled: a Bound calls the kernel through Triton with ``KernelSpec.interp``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton

from .host import interpreting, keep_at_most
from .spec import KernelSpec
from .tuning import launch_tuned
from .workspace import with_descriptor_scratch

if TYPE_CHECKING:
    from triton.runtime.jit import JITFunction


@dataclass(frozen=True)
class Bound:
    """A kernel bound to one launch signature: its compiled kernel called at a fixed grid, the size and stride
    arguments, and the constexpr tail (the call's constexprs and the tuned config). Under the interpreter,
    ``run`` calls the kernel through Triton with the one interpreter config (no tail)."""

    name: str  # the KernelSpec's name
    run: Callable  # the compiled kernel's runner at this grid
    static: tuple  # the sizes and strides, between the tensors and the runtime scalars
    tail: tuple  # constexpr values, in the kernel's argument order after the runtime scalars

    def launch(self, tensors: tuple, runtime: tuple) -> None:
        """Launch on new tensors of the bound layout (only their addresses are read) and runtime scalars."""
        self.run(*tensors, *self.static, *runtime, *self.tail)


class Site:
    """One launch of the op (``dispatch``) for one operand layout: filled at the layout's first call (``bound``,
    plus the launcher's own layout-derived choices in ``info``); later calls launch ``bound`` directly, skipping
    its signature, its checks and the ``_BOUND`` lookup."""

    __slots__ = ("bound", "info")

    def __init__(self):
        self.bound: Bound | None = None
        self.info: tuple = ()


def launch(site: Site | None, tensors: tuple, runtime: tuple, describe: Callable, *how, info: tuple = ()) -> None:
    """Launch ``kernel(*tensors, *static, *runtime, *constexprs)`` for one layout.

    ``tensors`` are the pointer arguments (first in the kernel's signature), ``runtime`` the scalars it never
    specializes on (floats and ``do_not_specialize`` ints: dropout p and seed, scale, offsets; last). A filled
    ``site`` launches its Bound. Otherwise ``describe(*how) -> (spec, kernel, signature, build)`` says what to
    launch (``bind``), and ``site`` keeps the Bound with ``info``, the launcher's choices that it needs before
    this call (workspace sizes).
    """
    if site is not None:
        bound = site.bound
        if bound is not None:
            bound.launch(tensors, runtime)
            return
    spec, kernel, signature, build = describe(*how)
    bound = bind(spec, kernel, signature, tensors, runtime, build)
    if site is not None:  # info first: another thread never reads a filled site without it
        site.info, site.bound = info, bound


def site_info(site: Site | None, compute: Callable[..., tuple], *args) -> tuple:
    """A launcher's layout-derived choices (workspace sizes): ``site.info`` once ``site`` is filled, else
    ``compute(*args)``, which ``launch`` then keeps in the site (its ``info``)."""
    if site is not None and site.bound is not None:
        return site.info
    return compute(*args)


# (spec, kernel, device, signature, tensors' 16-byte alignment) -> Bound. One entry per exact shape: a new token
# count costs one launch through Triton's path (its binary is shared by the Ms Triton specializes alike; its
# config by the bucket). Two threads binding one signature at once store equal entries.
# At most ``BOUND_KEPT`` signatures are kept.
BOUND_KEPT = 1024
_BOUND: dict[tuple, Bound] = {}


def direct_launch(compiled: triton.compiler.CompiledKernel, g: tuple[int, int, int]) -> Callable | None:
    """``compiled`` launched at grid ``g`` on the current stream through its launcher alone, skipping the per-call
    device, stream and hook lookups of ``compiled[g]``; None where launch hooks are set (a profiler's)."""
    knobs = getattr(triton, "knobs", None)
    hooks = [getattr(knobs.runtime, h, None) for h in ("launch_enter_hook", "launch_exit_hook")] if knobs else [1]
    packed = getattr(compiled, "packed_metadata", None)
    if packed is None or any(h is not None and getattr(h, "calls", True) for h in hooks):
        return None
    compiled._init_handles()
    launcher, function = compiled.run, compiled.function
    stream_of, device = torch._C._cuda_getCurrentRawStream, torch.cuda.current_device()
    g0, g1, g2 = g

    def direct(*args):
        launcher(g0, g1, g2, stream_of(device), function, packed, None, None, None, *args)

    return direct


def bound_key(spec: KernelSpec, kernel: JITFunction, signature: tuple, tensors: tuple) -> tuple:
    """The ``_BOUND`` key of a launch on the current device."""
    # Triton specializes pointer arguments on 16-byte alignment: a misaligned view needs its own binary.
    return (spec.name, kernel.__name__, torch.cuda.current_device(), signature,
            tuple([t.data_ptr() % 16 == 0 for t in tensors]))  # fmt: skip


def bind(
    spec: KernelSpec, kernel: JITFunction, signature: tuple, tensors: tuple, runtime: tuple, build: Callable[[], tuple]
) -> Bound:
    """Launch ``kernel`` for ``signature`` and return the ``Bound`` that launches it again.

    ``signature`` is the launcher's cheap summary of everything but addresses and runtime scalars (sizes,
    strides, dtypes, constexpr flags): two calls with equal signatures must get equal ``build()`` results.
    ``build() -> (static, grid, consts)`` gives the size and stride arguments, the grid (a function of the
    config) and the call's constexprs; it runs at a signature's first launch only. On GPU that launch tunes
    (per size bucket: ``tuning.launch_tuned``) and binds the compiled kernel; later ones call it directly.
    """
    if interpreting():
        static, grid, consts = build()
        cfg = spec.interp

        def run(*args):
            kernel[grid](*args, **consts, **cfg)

        bound = Bound(spec.name, run, static, ())
        bound.launch(tensors, runtime)
        return bound
    key = bound_key(spec, kernel, signature, tensors)
    bound = _BOUND.get(key)
    if bound is not None:
        bound.launch(tensors, runtime)
        return bound
    static, grid, consts = build()
    descriptors = spec.descriptors(consts)
    args = (*tensors, *static, *runtime)
    tune = with_descriptor_scratch(launch_tuned) if descriptors else launch_tuned
    compiled, cfg = tune(spec, kernel, grid, args, consts)
    if not isinstance(compiled, triton.compiler.CompiledKernel):
        # A Triton that hands back no compiled kernel: later calls of this Bound go through its own path.
        run = lambda *a: kernel[grid](*a, **consts, **cfg.all_kwargs())  # noqa: E731
        return Bound(spec.name, with_descriptor_scratch(run) if descriptors else run, static, ())
    meta = {**consts, **cfg.kwargs}
    tail = tuple(meta[name] for name in kernel.arg_names[len(args) :])
    g = grid(meta) if callable(grid) else grid
    g = (g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1)
    run = direct_launch(compiled, g) or compiled[g]
    bound = Bound(spec.name, with_descriptor_scratch(run) if descriptors else run, static, tail)
    return keep_at_most(_BOUND, key, bound, BOUND_KEPT)  # an evicted Bound lives on in the Sites that hold it
