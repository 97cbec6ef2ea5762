"""A small Llama-style decoder for the training launcher (``launch/train.py``).

    tokens [b, s] -> embed_tokens -> N x Block -> norm -> lm_head -> logits [b, s, vocab]
    Block:  h = x + attn(attn_norm(x));  out = h + mlp(mlp_norm(h))
    attn:   q_proj, k_proj, v_proj -> RoPE -> causal SDPA -> o_proj
    mlp:    down_proj(silu(gate_proj(x)) * up_proj(x))      (SwiGLU)

The attention and MLP read their widths off their inputs, so the same code runs unsharded and after
tensor-parallel sharding: a column-parallel ``q_proj`` returns ``[b, s, n_heads/tp * head_dim]`` and the
attention simply sees ``n_heads/tp`` local heads. Under sequence parallelism a block receives
``[b, s/tp, dim]``; ``q_proj``/``k_proj``/``v_proj`` gather the sequence themselves, so attention and RoPE
always see the full sequence, and ``o_proj``/``down_proj`` reduce-scatter back to ``[b, s/tp, dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class ModelConfig:
    """Shape of the decoder. Raises ``ValueError`` naming the field when the shape is inconsistent."""

    vocab_size: int = 256
    """Number of token ids (the launcher sets it from the tokenizer)."""

    dim: int = 128
    """Width of the residual stream."""

    n_layers: int = 4
    """Number of decoder blocks."""

    n_heads: int = 4
    """Attention heads; ``head_dim = dim / n_heads``. Must be divisible by the tensor-parallel size."""

    hidden_dim: int = 384
    """Width of the SwiGLU MLP (``gate_proj``/``up_proj`` outputs). Must be divisible by the TP size."""

    max_seq_len: int = 1024
    """Length of the precomputed RoPE tables."""

    rope_theta: float = 10000.0
    """RoPE base frequency."""

    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"ModelConfig.dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig: head_dim = dim / n_heads = {self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# Named presets, gpt-fast style. Parameter counts (frozen base + nothing else) are for the 43-character corpus.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=192),  # ~0.1 M params: tests
    "small": ModelConfig(dim=128, n_layers=4, n_heads=8, hidden_dim=384),  # ~0.9 M: the default run
    "base": ModelConfig(dim=256, n_layers=6, n_heads=8, hidden_dim=768),  # ~5.1 M
}


def config_for(preset: str, **overrides: int | float) -> ModelConfig:
    """The preset's config with ``overrides`` (e.g. ``vocab_size``) applied."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[preset], **overrides)


def check_tp(config: ModelConfig, tp: int) -> None:
    """Raise ``ValueError`` unless heads and MLP width split evenly over ``tp`` ranks."""
    if config.n_heads % tp != 0:
        raise ValueError(f"n_heads={config.n_heads} must be divisible by the tensor-parallel size tp={tp}")
    if config.hidden_dim % tp != 0:
        raise ValueError(f"hidden_dim={config.hidden_dim} must be divisible by the tensor-parallel size tp={tp}")


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` of shape ``[seq_len, head_dim]`` (each frequency repeated for the two halves)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, heads, s, head_dim]`` by position (the rotate-half form Llama uses)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.k_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.v_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.o_proj = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [b, s_in, dim] (s_in = s/tp under SP) -> q, k, v [b, s, local_heads * head_dim], full sequence.
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, s, width = q.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [b, s, local_heads * head_dim] -> [b, local_heads, s, hd]
            return t.view(b, s, width // self.head_dim, self.head_dim).transpose(1, 2)

        q, k, v = heads(q), heads(k), heads(v)
        q, k = apply_rope(q, cos[:s], sin[:s]), apply_rope(k, cos[:s], sin[:s])
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, width))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.up_proj = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.down_proj = nn.Linear(config.hidden_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # RMSNorm is per token, so under SP it runs on the local sequence shard unchanged.
        h = x + self.attn(self.attn_norm(x), cos, sin)
        return h + self.mlp(self.mlp_norm(h))


class Transformer(nn.Module):
    """``tokens [b, s]`` (int64) -> ``logits [b, s, vocab_size]``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rope_tables(config.max_seq_len, config.head_dim, config.rope_theta)
        self.register_buffer("rope_cos", cos.to(self.lm_head.weight.device), persistent=False)
        self.register_buffer("rope_sin", sin.to(self.lm_head.weight.device), persistent=False)
        # Keep only each block's input for backward and rerun the block there (torch.utils.checkpoint).
        self.activation_checkpointing = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len={self.config.max_seq_len}")
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer, h, self.rope_cos, self.rope_sin, use_reentrant=False)
            else:
                h = layer(h, self.rope_cos, self.rope_sin)
        return self.lm_head(self.norm(h))
