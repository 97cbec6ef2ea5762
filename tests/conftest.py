"""Test set-up: Triton runs in its CPU interpreter when there is no GPU; every test is seeded."""

import os

import torch

# Must happen before any @triton.jit function is defined, i.e. before parallel_lora.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    yield
