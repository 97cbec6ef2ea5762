"""A tiny random Llama checkpoint whose tokenizer has a chat template, and a chat ``.jsonl`` to fine-tune it on, made
offline with transformers and tokenizers only (nothing is downloaded): the main job end to end in seconds on a CPU.

    python -m launch.tiny_checkpoint runs/tiny-llama    # writes the checkpoint and runs/tiny-llama/chat.jsonl

The tokenizer is word-level, trained on the launcher's corpus and the chat lines; the model has hidden size 64, 2
layers, 4 heads (2 key/value heads). The answers follow from the questions, so a few steps of adapters learn them.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from launch.data import generate_corpus

SPECIAL = {"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
ROLES = ["<|system|>", "<|user|>", "<|assistant|>"]
# Each turn is "<|role|> content </s>"; the generation prompt is "<|assistant|>".
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {{ eos_token }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
THINGS = ["lamp", "key", "bell", "boat", "coat", "book", "cart", "basket", "letter", "loaf"]
PLACES = ["market", "forest", "garden", "hill", "meadow", "bridge", "harbour", "river", "village"]


def chat_lines(n: int = 200, seed: int = 0) -> list[dict]:
    """``n`` conversations ``{"messages": [...]}``: one or two questions, each answered from the thing asked for."""
    rng = random.Random(seed)

    def turn() -> list[dict[str, str]]:
        i = rng.randrange(len(THINGS))
        return [{"role": "user", "content": f"Where is my {THINGS[i]} ?"},
                {"role": "assistant", "content": f"It is by the {PLACES[i % len(PLACES)]} ."}]

    rows = []
    for k in range(n):
        system = [{"role": "system", "content": "Answer in one sentence ."}] if k % 4 == 0 else []
        rows.append({"messages": system + turn() + (turn() if k % 3 == 0 else [])})
    return rows


def write_tokenizer(folder: str | Path, texts: list[str]):
    """A word-level fast tokenizer trained on ``texts``, with the specials, the role tokens and ``CHAT_TEMPLATE``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=SPECIAL["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(vocab_size=256, special_tokens=[*SPECIAL.values(),
                                                                                              *ROLES]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, additional_special_tokens=ROLES, **SPECIAL)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


def write_checkpoint(folder: str | Path, seed: int = 0) -> Path:
    """The checkpoint (``model.safetensors``, ``config.json``, tokenizer files) in ``folder`` and its
    ``chat.jsonl``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    rows = chat_lines()
    texts = generate_corpus(3000, seed=1).split("\n") + [m["content"] for r in rows for m in r["messages"]]
    tokenizer = write_tokenizer(folder, texts)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    (folder / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="where to write the checkpoint (and chat.jsonl)")
    folder = write_checkpoint(parser.parse_args().folder)
    print(f"wrote {folder} (a tiny Llama with a chat template) and {folder / 'chat.jsonl'}")
