"""Test set-up for the benchmarks' own tests: without a GPU, Triton runs in its CPU interpreter."""

import os

import torch

# Must happen before any @triton.jit function is defined, i.e. before parallel_lora's kernels are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
