"""A plan's launches recorded at one call and replayed at the next: fresh outputs, then each kernel's C entry called
with addresses; docs/kernels.md, "Replaying a call"."""

from __future__ import annotations

import threading
from collections.abc import Callable
from operator import itemgetter
from typing import NamedTuple

import torch

from . import replay
from .host import ZERO_SEEDS, keep_at_most
from .workspace import descriptor_scratch, holding


class Notes:
    """What one recorded call did: its fresh outputs (``launcher.output``) and its launches, in order."""

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []
        self.launches: list[tuple] = []


class _Recording(threading.local):
    notes: Notes | None = None  # the ``Notes`` of the call this thread records, if any


NOTES = _Recording()


class Program(NamedTuple):
    """One call's launches on one stream: ``run`` allocates ``allocs`` and calls each entry with ``pool`` picks."""

    seed_kind: type
    allocs: tuple[tuple[int, tuple[int, ...]], ...]  # (operand of the output's dtype and device, shape)
    consts: tuple
    launches: tuple[tuple[Callable, itemgetter], ...]
    outputs: tuple[int | None, ...]
    kept: tuple[torch.Tensor, ...]  # the workspaces whose addresses ``consts`` holds

    def run(self, operands: tuple, seed: torch.Tensor | int | None) -> tuple:
        """The recorded call's outputs for new operands (None where the recording had None) and a new seed."""
        fresh = [operands[i].new_empty(shape) for i, shape in self.allocs]
        addresses = [t.data_ptr() for t in operands if t is not None]
        seeds = () if seed is None else (seed,) if seed.__class__ is int else (seed.data_ptr(),)
        pool = (*self.consts, *addresses, *[t.data_ptr() for t in fresh], *seeds)
        for entry, pick in self.launches:
            entry(*pick(pool))
        return tuple(None if i is None else fresh[i] for i in self.outputs)


class Unrecordable(Exception):
    """A recorded call that a program cannot replay (a launch without a C entry, an address it cannot place)."""


def build(notes: Notes, operands: tuple, seed: torch.Tensor | int | None, outputs: tuple, stream: int) -> Program:
    """The program of a recorded call; raises ``Unrecordable`` where replaying it could differ from calling it."""
    launches, fresh = notes.launches, notes.outputs
    if not launches or any(getattr(getattr(bound, "run", None), "parts", None) is None for bound, _, _ in launches):
        raise Unrecordable("no launch, or a launch without Triton's C entry")  # e.g. the interpreter's
    ops = [t for t in operands if t is not None]
    if any(t.numel() == 0 for t in (*ops, *fresh)):
        raise Unrecordable("an empty tensor")
    where = {t.data_ptr(): ("op", i) for i, t in enumerate(ops)}
    where.update({t.data_ptr(): ("fresh", i) for i, t in enumerate(fresh)})
    if len(where) < len(ops) + len(fresh):
        raise Unrecordable("two operands or outputs at one address")
    consts, kept, used = [], [], set()

    def const(value) -> tuple:
        consts.append(value)
        return ("const", len(consts) - 1)

    def place(t: torch.Tensor) -> tuple:
        slot = where.get(t.data_ptr())
        if slot is not None:
            used.add(slot)
            return slot
        buf = holding(t.data_ptr())
        if buf is None:
            raise Unrecordable("a tensor that is neither an operand, a fresh output nor a workspace")
        kept.append(buf)
        return const(t.data_ptr())

    device = ops[0].device
    index = device.index if device.type == "cuda" else -1
    picks = []
    for bound, tensors, runtime in launches:
        parts = bound.run.parts  # a launcher.CEntry
        if device.type == "cuda" and parts.device != index:
            raise Unrecordable("a launch bound on another device")
        scratch = None
        if parts.scratch_size:
            kept.append(descriptor_scratch(parts.scratch_size, parts.scratch_align, stream))
            scratch = kept[-1].data_ptr()
        args = [const(a) for a in (*parts.grid, stream, parts.function, parts.cooperative, parts.pdl, scratch, None,
                                   parts.packed, None, None, None)]  # fmt: skip
        args += [place(t) for t in tensors]
        args += [const(a) for a in (*parts.static, runtime[0], runtime[1])]
        args += _seed_slots(runtime[2], runtime[3], seed, device, place, const)
        args += [const(a) for a in (*runtime[4:], *parts.tail)]
        picks.append((parts.entry, args))
    outs = []
    for t in outputs:
        slot = None if t is None else where.get(t.data_ptr())
        if t is not None and (slot is None or slot[0] != "fresh"):
            raise Unrecordable("an output that is not a fresh output")
        outs.append(None if t is None else slot[1])
    if any(("fresh", i) not in used for i in range(len(fresh))):
        raise Unrecordable("a fresh output that no launch wrote")  # e.g. zeroed on the host
    like = {(t.dtype, t.device): i for i, t in reversed(list(enumerate(operands))) if t is not None}
    if any((t.dtype, t.device) not in like for t in fresh):
        raise Unrecordable("a fresh output of a dtype no operand has")
    base = {"const": 0, "op": len(consts), "fresh": len(consts) + len(ops), "seed": len(consts) + len(ops) + len(fresh)}
    return Program(
        type(seed), tuple((like[t.dtype, t.device], tuple(t.shape)) for t in fresh), tuple(consts),
        tuple((entry, itemgetter(*[base[kind] + i for kind, i in args])) for entry, args in picks),
        tuple(outs), tuple(kept),
    )  # fmt: skip


def _seed_slots(seed_arg: torch.Tensor, salt: int, seed, device, place: Callable, const: Callable) -> list[tuple]:
    """A launch's ``(seed pointer, salt)`` slots: the call's seed where it passed it (``host.seed_arg``), else as
    recorded (a launch without a mask reads neither)."""
    if isinstance(seed, torch.Tensor) and seed_arg is seed:
        return [("seed", 0), const(salt)]
    if isinstance(seed, int) and seed_arg is ZERO_SEEDS.get(device):
        if salt != seed:
            raise Unrecordable("a launch with an int seed other than the call's")
        return [const(seed_arg.data_ptr()), ("seed", 0)]
    return [place(seed_arg), const(salt)]


class Programs:
    """An entry's programs, one per stream (False where its call could not be recorded): ``call()`` once to record,
    then the program in its place."""

    __slots__ = ("by_stream",)
    KEPT = 4

    def __init__(self) -> None:
        self.by_stream: dict[int, Program | bool] = {}

    def run(self, call: Callable[[], tuple], operands: tuple, seed: torch.Tensor | int | None) -> tuple:
        """``call()``'s outputs: replayed where this stream has a program of this seed kind, else ``call()``."""
        index = operands[0].get_device()
        stream = torch._C._cuda_getCurrentRawStream(index) if index >= 0 else 0
        program = self.by_stream.get(stream)
        if program:
            if seed.__class__ is program.seed_kind:
                return program.run(operands, seed)
            return call()
        if program is False or index >= 0 and torch.cuda.is_current_stream_capturing():
            return call()
        notes = NOTES.notes = Notes()
        try:
            out = call()
        finally:
            NOTES.notes = None
        try:
            program = build(notes, operands, seed, out, stream)
            replay.module()  # its C++ half replays from here on (kernels/replay.cpp), built at the first record
        except Unrecordable:
            program = False
        keep_at_most(self.by_stream, stream, program, self.KEPT)
        return out
