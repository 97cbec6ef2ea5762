"""Dropout seeds seen from outside the layers: record every draw, or hand the layers given seeds instead."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn as nn

import parallel_lora._dropout


@contextlib.contextmanager
def recording_seeds() -> Iterator[list[tuple[bool, torch.Tensor | int]]]:
    """Yields a list that collects every seed drawn at run time (not while tracing), in order, with whether the draw
    ran in a backward pass (a checkpoint's rerun or recompute). Enter it before compiling: Dynamo guards on the
    draw function."""
    seeds, draw = [], parallel_lora._dropout.draw_seed

    def recording(like: torch.Tensor, offset: int = 0) -> torch.Tensor | int:
        seed = draw(like, offset)
        if not torch.compiler.is_compiling():
            kept = seed.clone() if isinstance(seed, torch.Tensor) else seed
            seeds.append((torch._C._current_graph_task_id() != -1, kept))
        return seed

    parallel_lora._dropout.draw_seed = recording
    try:
        yield seeds
    finally:
        parallel_lora._dropout.draw_seed = draw


@contextlib.contextmanager
def given_seeds(layers: Iterable[nn.Module], seeds: list[torch.Tensor | int]) -> Iterator[None]:
    """The layers' eager forwards take ``seeds`` (ints or ``[1]`` int64 on the device), in call order, instead of
    drawing."""
    layers, given = list(layers), iter(seeds)
    for m in layers:
        m._dropout_stream.next_seed = lambda x: next(given)
    try:
        yield
    finally:
        for m in layers:
            del m._dropout_stream.next_seed
