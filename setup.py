from setuptools import find_packages, setup

setup(
    name="parallel_lora",
    version="0.1.0",
    description="LoRA adapters on Megatron-style tensor-parallel linear layers, with fused Triton kernels",
    packages=find_packages(include=["parallel_lora", "parallel_lora.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "triton>=3.2; platform_system == 'Linux'",
        "safetensors>=0.4",
    ],
    extras_require={
        "test": ["pytest>=8", "numpy", "peft>=0.13", "tqdm", "matplotlib"],
        "dev": ["pytest>=8", "numpy", "ruff", "matplotlib", "tqdm"],
    },
)
