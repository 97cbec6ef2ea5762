"""How every kernel is launched: the first call of a layout binds its kernel (``bind``), later calls run it."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton

from .host import interpreting, keep_at_most
from .program import NOTES
from .spec import KernelSpec
from .tuning import launch_tuned
from .workspace import descriptor_scratch, with_descriptor_scratch

if TYPE_CHECKING:
    from triton.runtime.jit import JITFunction


@dataclass(frozen=True)
class Bound:
    """A kernel bound to one signature at a fixed grid: ``run(tensors, runtime)`` launches it."""

    name: str
    run: Callable[[tuple, tuple], None]

    def launch(self, tensors: tuple, runtime: tuple) -> None:
        """Launch on new tensors of the bound layout and new runtime scalars."""
        self.run(tensors, runtime)


def bound_run(run: Callable, static: tuple, tail: tuple) -> Callable[[tuple, tuple], None]:
    """``run(*tensors, *static, *runtime, *tail)`` as a ``Bound.run``."""

    def go(tensors: tuple, runtime: tuple) -> None:
        run(*tensors, *static, *runtime, *tail)

    return go


def output(like: torch.Tensor, *shape: int) -> torch.Tensor:
    """A launch's fresh output, ``like.new_empty(shape)``; a recording program notes it."""
    out = like.new_empty(shape)
    notes = NOTES.notes
    if notes is not None:
        notes.outputs.append(out)
    return out


class Site:
    """One launch of the op for one operand layout: ``bound`` and the launcher's ``info``, filled at its first call,
    and ``buffers``, the workspaces of the last stream it ran on."""

    __slots__ = ("bound", "info", "buffers")

    def __init__(self):
        self.bound: Bound | None = None
        self.info: tuple = ()
        self.buffers: tuple | None = None


def launch(site: Site | None, tensors: tuple, runtime: tuple, describe: Callable, *how, info: tuple = ()) -> None:
    """Launch ``kernel(*tensors, *static, *runtime, *constexprs)``: a filled ``site``'s Bound, else ``bind`` what
    ``describe(*how) -> (spec, kernel, signature, build)`` names and keep it in ``site`` with ``info``."""
    bound = None if site is None else site.bound
    if bound is not None:
        bound.launch(tensors, runtime)
    else:
        spec, kernel, signature, build = describe(*how)
        bound = bind(spec, kernel, signature, tensors, runtime, build)
        if site is not None:  # info first: another thread never reads a filled site without it
            site.info, site.bound = info, bound
    notes = NOTES.notes
    if notes is not None:
        notes.launches.append((bound, tensors, runtime))


def site_buffers(site: Site | None, device: torch.device, make: Callable, *args) -> object:
    """The launch's workspaces ``make(*args)`` on ``device``'s current stream, kept in ``site`` for that stream."""
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    kept = None if site is None else site.buffers
    if kept is not None and kept[0] == stream:
        return kept[1]
    buffers = make(*args)
    if site is not None:
        site.buffers = (stream, buffers)  # one assignment: another thread reads a stream with its own buffers
    return buffers


def site_info(site: Site | None, compute: Callable[..., tuple], *args) -> tuple:
    """A launcher's layout-derived choices (workspace sizes): a filled ``site``'s ``info``, else ``compute(*args)``."""
    if site is not None and site.bound is not None:
        return site.info
    return compute(*args)


BOUND_KEPT = 1024
_BOUND: dict[tuple, Bound] = {}


# Triton 3.6's CudaLauncher (torch 2.11's Triton): ``run(gx, gy, gz, stream, function, *args)`` takes the scratch
# from Triton's allocators, then calls ``run.launch(gx, gy, gz, stream, function, cooperative, pdl, scratch, profile,
# *args)``.
C_LAUNCH_TRITON = "3.6."
C_LAUNCH_PARAMS = ("self", "gridX", "gridY", "gridZ", "stream", "function", "args")


def c_launch(launcher: object) -> Callable | None:
    """``launcher.launch``, the C entry under Triton 3.6's launcher, where its layout is that one and it asks no
    profile scratch; else None (Triton's own path)."""
    if not triton.__version__.startswith(C_LAUNCH_TRITON) or getattr(launcher, "profile_scratch_size", 1) != 0:
        return None
    try:
        params = tuple(inspect.signature(type(launcher).__call__).parameters)
    except (TypeError, ValueError):
        return None
    return getattr(launcher, "launch", None) if params == C_LAUNCH_PARAMS else None


class CEntry(NamedTuple):
    """A bound launch's C entry and every argument it passes but the stream, the tensors and the runtime."""

    entry: Callable
    device: int
    grid: tuple[int, int, int]
    function: object
    cooperative: bool
    pdl: bool
    scratch_size: int
    scratch_align: int
    packed: object
    static: tuple
    tail: tuple


def direct_launch(
    compiled: triton.compiler.CompiledKernel, g: tuple[int, int, int], descriptors: bool, static: tuple, tail: tuple
) -> Callable[[tuple, tuple], None] | None:
    """``Bound.run`` of ``compiled`` at grid ``g`` on the current stream, without ``compiled[g]``'s lookups (with the
    descriptor scratch from ``workspace``, and below Triton 3.6's Python launcher where ``c_launch`` finds it); None
    under launch hooks. Its runtime scalars are laid out as ``check_runtime`` asks."""
    knobs, packed = getattr(triton, "knobs", None), getattr(compiled, "packed_metadata", None)
    if knobs is None or packed is None:  # a Triton without this launcher contract: its own path
        return None
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    if any(h is not None and getattr(h, "calls", True) for h in hooks):  # a hook, or a non-empty HookChain
        return None
    compiled._init_handles()
    launcher, function = compiled.run, compiled.function
    stream_of, device = torch._C._cuda_getCurrentRawStream, torch.cuda.current_device()
    g0, g1, g2 = g
    entry = c_launch(launcher)
    if entry is None:

        def direct(*args):
            launcher(g0, g1, g2, stream_of(device), function, packed, None, None, None, *args)

        return bound_run(with_descriptor_scratch(direct, descriptors), static, tail)
    coop, pdl, align = launcher.launch_cooperative_grid, launcher.launch_pdl, launcher.global_scratch_align
    size = g0 * g1 * g2 * launcher.num_ctas * launcher.global_scratch_size
    kept = (None, None, None)  # the last stream, its descriptor scratch's address and the scratch
    data_ptr = torch.Tensor.data_ptr

    def direct_c(tensors: tuple, runtime: tuple) -> None:
        nonlocal kept
        stream, last = stream_of(device), kept  # one read: another thread may replace it
        if last[0] != stream:
            scratch = descriptor_scratch(size, align, stream) if size else None
            last = kept = (stream, None if scratch is None else scratch.data_ptr(), scratch)
        # Addresses, not tensors: the entry queries the driver about each tensor it is given (docs/kernels.md).
        entry(g0, g1, g2, stream, function, coop, pdl, last[1], None, packed, None, None, None,
              *map(data_ptr, tensors), *static, runtime[0], runtime[1], runtime[2].data_ptr(), *runtime[3:], *tail)

    # what a program replays of this launch (program.build)
    direct_c.parts = CEntry(entry, device, g, function, coop, pdl, size, align, packed, static, tail)
    return direct_c


def bound_key(spec: KernelSpec, kernel: JITFunction, signature: tuple, tensors: tuple) -> tuple:
    """The ``_BOUND`` key of a launch on the current device, with each pointer's 16-byte alignment."""
    return (spec.name, kernel.__name__, torch.cuda.current_device(), signature,
            tuple([t.data_ptr() % 16 == 0 for t in tensors]))


def check_runtime(runtime: tuple) -> None:
    """Refuse runtime scalars not laid out as every launcher passes them: ``(c, p, seed tensor, salt, *ints)``."""
    if len(runtime) < 4 or [isinstance(a, torch.Tensor) for a in runtime] != [i == 2 for i in range(len(runtime))]:
        kinds = ", ".join(type(a).__name__ for a in runtime)
        raise TypeError(f"a launch's runtime must be (c, p, seed tensor, salt, *ints) (host.seed_arg), got ({kinds})")


def bind(
    spec: KernelSpec, kernel: JITFunction, signature: tuple, tensors: tuple, runtime: tuple, build: Callable[[], tuple]
) -> Bound:
    """Launch ``kernel`` for ``signature`` and return the ``Bound`` that launches it again.

    ``build() -> (static, grid, consts)`` runs at a signature's first launch; equal signatures must build alike."""
    check_runtime(runtime)
    if interpreting():
        static, grid, consts = build()
        cfg = spec.interp

        def run(*args):
            kernel[grid](*args, **consts, **cfg)

        bound = Bound(spec.name, bound_run(run, static, ()))
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
    tune = with_descriptor_scratch(launch_tuned, descriptors)
    compiled, cfg = tune(spec, kernel, grid, args, consts)
    if not isinstance(compiled, triton.compiler.CompiledKernel):
        run = lambda *a: kernel[grid](*a, **consts, **cfg.all_kwargs())  # noqa: E731
        return Bound(spec.name, bound_run(with_descriptor_scratch(run, descriptors), static, ()))
    meta = {**consts, **cfg.kwargs}
    tail = tuple(meta[name] for name in kernel.arg_names[len(args) :])
    g = grid(meta) if callable(grid) else grid
    g = (g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1)
    run = direct_launch(compiled, g, descriptors, static, tail)
    if run is None:
        run = bound_run(with_descriptor_scratch(compiled[g], descriptors), static, tail)
    bound = Bound(spec.name, run)
    return keep_at_most(_BOUND, key, bound, BOUND_KEPT)
