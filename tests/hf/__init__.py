"""Tests of ``parallel_lora.hf``."""
