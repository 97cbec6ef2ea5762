"""The main job: ``parallel-lora train`` / ``generate`` (``launch.command``), or ``torchrun launch/train.py``."""
