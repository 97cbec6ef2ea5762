"""Tests of ``parallel_lora.tp``."""
