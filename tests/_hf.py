"""Tiny random Hugging Face checkpoints for the tests, written offline with ``save_pretrained``.

Each has hidden size 64, 2 layers, 4 heads (2 key/value heads) and a tokenizer trained on the launcher's
generated corpus (the ``tokenizers`` library, nothing downloaded): word-level with 128 tokens, or for the Qwen
models byte-level BPE with 384, since transformers reads any Qwen checkpoint's tokenizer as ``Qwen2Tokenizer``, a
byte-level BPE built from the file's vocabulary and merges (a word-level file would be mis-read). The architectures
differ where loading can go wrong: Qwen2 has q/k/v biases and tied embeddings, Qwen3 per-head q/k norms (a
replicated plan entry) and an explicit ``head_dim``, Mistral a sliding window.
"""

from __future__ import annotations

from pathlib import Path

import torch

from launch.data import generate_corpus

VOCAB = 128  # every model's vocabulary has at least this many tokens
BPE_VOCAB = 384  # the Qwen models': the 256 bytes, 4 specials and merges
SPECIAL = {"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=2, eos_token_id=3)
ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def tiny_config(arch: str = "llama", **overrides):
    """The transformers config of a tiny ``arch`` model (``ARCHS``), with ``overrides``."""
    import transformers

    extra = {
        "llama": {},
        "mistral": {"sliding_window": 32},
        "qwen2": {"tie_word_embeddings": True, "vocab_size": BPE_VOCAB},
        "qwen3": {"head_dim": 16, "tie_word_embeddings": False, "vocab_size": BPE_VOCAB},
    }[arch]
    return transformers.AutoConfig.for_model(arch, **{**COMMON, **extra, **overrides})


def tokenizer_text() -> str:
    return generate_corpus(3000, seed=1)


def write_tokenizer(folder: str | Path, arch: str = "llama"):
    """``arch``'s fast tokenizer (4 specials first: pad 0, unk 1, bos 2, eos 3) in ``folder``: word-level of ``VOCAB``
    entries, or byte-level BPE of ``BPE_VOCAB`` for the Qwen models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    if arch.startswith("qwen"):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    else:
        tok = Tokenizer(models.WordLevel(unk_token=SPECIAL["unk_token"]))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordLevelTrainer(vocab_size=VOCAB, special_tokens=specials)
    tok.train_from_iterator(tokenizer_text().split("\n"), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL)
    fast.save_pretrained(str(folder))
    return fast


def write_checkpoint(
    folder: str | Path, arch: str = "llama", *, sharded: bool = False, tokenizer: bool = True, seed: int = 0,
    dtype: torch.dtype = torch.float32, **overrides,
) -> Path:
    """A random tiny ``arch`` checkpoint in ``folder``: ``model.safetensors``, or several shards and
    ``model.safetensors.index.json`` with ``sharded``; the tokenizer files unless ``tokenizer=False``."""
    import transformers

    folder = Path(folder)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms start at ones and biases at zeros: perturb them so a wrong load shows
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(folder), max_shard_size="100KB" if sharded else "10GB")
    if tokenizer:
        write_tokenizer(folder, arch)
    return folder
