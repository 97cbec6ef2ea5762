from setuptools import find_packages, setup

TRAIN = ["tqdm", "matplotlib", "pyyaml"]  # the main job's progress bar, loss plot, --config and config.yaml
HF = ["transformers>=4.56", "tokenizers"]  # parallel_lora.hf: Hugging Face checkpoints and their TP plans
TEST = ["pytest>=8", "numpy", "peft>=0.13"]

setup(
    name="parallel_lora",
    version="0.1.0",
    description="LoRA adapters on Megatron-style tensor-parallel linear layers, with fused Triton kernels",
    license="Apache-2.0",
    packages=find_packages(include=["parallel_lora", "parallel_lora.*", "launch"]),
    package_data={"launch": ["corpus.txt"]},  # the toy model's training text
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "triton>=3.2; platform_system == 'Linux'",
        "safetensors>=0.4",
    ],
    entry_points={"console_scripts": ["parallel-lora = launch.command:main"]},
    extras_require={
        "train": TRAIN,
        "hf": HF,
        "test": TEST,
        "dev": TEST + TRAIN + HF + ["ruff"],
    },
)
