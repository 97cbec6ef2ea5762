"""The benchmarks users run, each as a module from the repository root (they need a CUDA GPU):

    python -m benchmarks.layer                          # one LoRA layer against cuBLAS and its peers
    python -m benchmarks.host                           # the host cost of one call, beside its GPU time
    torchrun --nproc-per-node 2 -m benchmarks.tp        # a tensor-parallel LoRA MLP against the frozen pair
    python -m benchmarks.plot benchmarks/results/layer_h100.json

Each prints a table and writes JSON to ``benchmarks/results/``; ``benchmarks.common`` holds what they share.
"""
