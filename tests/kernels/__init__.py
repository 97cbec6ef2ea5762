"""Tests of ``parallel_lora.kernels``."""
