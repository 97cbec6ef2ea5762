from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    """Leaves launch/'s tests (``launch/test_*.py``) out of the wheel: they need the checkout's tests/ helpers."""

    def find_package_modules(self, package, package_dir):
        return [m for m in super().find_package_modules(package, package_dir) if not m[1].startswith("test_")]


TRAIN = ["tqdm", "matplotlib", "pyyaml"]  # the main job's progress bar, loss plot, --config and config.yaml
HF = ["transformers>=4.56", "tokenizers"]  # parallel_lora.hf: Hugging Face checkpoints and their TP plans
TEST = ["pytest>=8", "pytest-xdist>=3", "numpy", "peft>=0.13"]  # -n 2: two test workers

setup(
    name="parallel_lora",
    version="0.1.0",
    description="LoRA adapters on Megatron-style tensor-parallel linear layers, with fused Triton kernels",
    license="Apache-2.0",
    packages=find_packages(include=["parallel_lora", "parallel_lora.*", "launch"]),
    # the toy model's training text; the C++ half of a replayed call, built on first use
    package_data={"launch": ["corpus.txt"], "parallel_lora.kernels": ["replay.cpp"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "triton>=3.2; platform_system == 'Linux'",
        "safetensors>=0.4",
        "ninja",  # torch.utils.cpp_extension builds kernels/replay.cpp with it
    ],
    cmdclass={"build_py": BuildPy},
    entry_points={"console_scripts": ["parallel-lora = launch.command:main"]},
    extras_require={
        "train": TRAIN,
        "hf": HF,
        "test": TEST,
        "dev": TEST + TRAIN + HF + ["ruff"],
    },
)
