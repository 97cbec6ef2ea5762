"""``launch/data.py``'s ``PackedData``: a user's .jsonl / .txt tokenized with a checkpoint's tokenizer and packed.

Reference: the tokenizer itself (``tests/_hf.py``'s word-level one), document by document: the packed stream must be
each document's ids followed by EOS, prompts masked with -100, cut into ``seq_len + 1`` windows. Conversations are
checked token by token against what ``launch/tiny_checkpoint.py``'s chat template writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launch import tiny_checkpoint
from launch.data import IGNORE_INDEX, PackedData, load_tokenizer
from tests import _hf

pytest.importorskip("transformers")

SENTENCES = [
    "The old fox ran over the hill.",
    "Anna found the small lamp and walked home slowly.",
    "When the winter came, the crow rowed to the river.",
    "Every spring the goat sold a coat near the mill.",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    _hf.write_tokenizer(folder)
    return load_tokenizer(folder)


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _ids(tokenizer, text: str, special: bool = True) -> list[int]:
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def test_packed_data_ends_each_document_with_eos_and_cuts_windows(tmp_path, tokenizer):
    data = PackedData(_jsonl(tmp_path / "d.jsonl", [{"text": s} for s in SENTENCES * 3]), tokenizer, seq_len=8,
                      eval_fraction=0.0)
    eos = tokenizer.eos_token_id
    want = [t for s in SENTENCES * 3 for t in [*_ids(tokenizer, s), eos]]
    assert data.tokens.tolist() == want and data.labels.tolist() == want
    assert data.train_starts.tolist() == list(range(0, len(want) - 8, 8))  # non-overlapping windows
    inputs, targets = data.batch(seed=0, step=1, micro_step=0, batch_size=5, seq_len=8)
    assert inputs.shape == targets.shape == (5, 8) and inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the next tokens


def test_prompt_tokens_carry_no_loss(tmp_path, tokenizer):
    rows = [{"prompt": "Where is my key?", "completion": "It is by the bridge."}] * 6
    data = PackedData(_jsonl(tmp_path / "pc.jsonl", rows), tokenizer, seq_len=6, eval_fraction=0.0)
    prompt, completion = _ids(tokenizer, rows[0]["prompt"]), _ids(tokenizer, rows[0]["completion"], special=False)
    doc_labels = [IGNORE_INDEX] * len(prompt) + completion + [tokenizer.eos_token_id]
    assert data.labels.tolist() == doc_labels * 6
    assert data.tokens.tolist() == (prompt + completion + [tokenizer.eos_token_id]) * 6
    inputs, targets = data.batch(seed=1, step=3, micro_step=0, batch_size=4, seq_len=6)
    for start in data.train_starts.tolist():
        window_targets = data.labels[start + 1 : start + 7]
        assert (window_targets != IGNORE_INDEX).any(), "a window with nothing to learn must be dropped"
    assert (targets == IGNORE_INDEX).any() and (targets != IGNORE_INDEX).any()
    loss = torch.nn.functional.cross_entropy(torch.randn(4 * 6, _hf.VOCAB), targets.flatten())
    assert torch.isfinite(loss)


def test_windows_of_prompt_only_are_dropped(tmp_path, tokenizer):
    long_prompt = " ".join(SENTENCES * 2)
    data = PackedData(_jsonl(tmp_path / "p.jsonl", [{"prompt": long_prompt, "completion": "Yes."}] * 3), tokenizer,
                      seq_len=4, eval_fraction=0.0)
    n = (len(data.tokens) - 1) // 4
    assert 0 < len(data.train_starts) < n


def test_txt_documents_are_separated_by_blank_lines(tmp_path, tokenizer):
    path = tmp_path / "d.txt"
    path.write_text("\n\n".join(SENTENCES) + "\n\n\n")
    data = PackedData(path, tokenizer, seq_len=4, eval_fraction=0.0)
    assert data.tokens.tolist() == [t for s in SENTENCES for t in [*_ids(tokenizer, s), tokenizer.eos_token_id]]


def test_eval_split_is_the_held_out_tail(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "d.jsonl", [{"text": s} for s in SENTENCES * 10])
    data = PackedData(path, tokenizer, seq_len=8, eval_fraction=0.1)
    n = (len(data.tokens) - 1) // 8
    n_eval = round(0.1 * n)
    assert data.eval_starts.tolist() == [8 * i for i in range(n - n_eval, n)]
    assert data.train_starts.tolist() == [8 * i for i in range(n - n_eval)]
    again = PackedData(path, tokenizer, seq_len=8, eval_fraction=0.1)
    assert torch.equal(again.eval_starts, data.eval_starts) and torch.equal(again.tokens, data.tokens)
    batches = data.eval_batches(batch_size=2)
    assert sum(len(x) for x, _ in batches) == n_eval and all(len(x) <= 2 for x, _ in batches)
    ranks = [data.eval_batches(batch_size=2, dp_rank=d, dp=2) for d in range(2)]
    rows = sorted(tuple(row.tolist()) for r in ranks for x, _ in r for row in x)
    assert rows == sorted(tuple(row.tolist()) for x, _ in batches for row in x)  # each window once over the ranks
    train_rows = {tuple(data.tokens[s : s + 8].tolist()) for s in data.train_starts.tolist()}
    for step in range(1, 20):
        for row in data.batch(seed=0, step=step, micro_step=0, batch_size=4, seq_len=8)[0]:
            assert tuple(row.tolist()) in train_rows, "a training batch drew an eval window"


def test_batches_are_a_pure_function_of_seed_step_and_micro_step(tmp_path, tokenizer):
    data = PackedData(_jsonl(tmp_path / "d.jsonl", [{"text": s} for s in SENTENCES * 10]), tokenizer, seq_len=8)

    def draw(**kw):
        args = {"seed": 0, "step": 4, "micro_step": 1, "batch_size": 4, "seq_len": 8} | kw
        return torch.cat(data.batch(**args))

    assert torch.equal(draw(), draw())
    assert not torch.equal(draw(), draw(step=5)) and not torch.equal(draw(), draw(micro_step=0))
    assert not torch.equal(draw(), draw(seed=1))
    # dp ranks split the global batch: dp = 2 with batch b trains on the rows of dp = 1 with batch 2b
    whole = data.batch(seed=0, step=4, micro_step=1, batch_size=8, seq_len=8)
    halves = [data.batch(seed=0, step=4, micro_step=1, batch_size=4, seq_len=8, dp_rank=d, dp=2) for d in range(2)]
    for i in range(2):
        assert torch.equal(torch.cat([h[i] for h in halves]), whole[i])


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.jsonl", "\n\n", "holds no documents"),
        ("empty.txt", "  \n\n \n", "holds no documents"),
        ("bad.jsonl", '{"text": "ok"}\n{"text": "broken"\n', r"bad.jsonl line 2: not valid JSON"),
        ("list.jsonl", '["text"]\n', "line 1: expected a JSON object, got list"),
        ("key.jsonl", '{"text": "a"}\n\n{"body": "b"}\n', r"line 3: missing key 'text'.*has \['body'\]"),
        ("half.jsonl", '{"prompt": "a"}\n', "line 1: missing key 'completion'"),
        ("type.jsonl", '{"text": 3}\n', "line 1: 'text' must be a string, got int"),
        ("data.csv", "text\nhello\n", "expected a .jsonl or .txt file, got '.csv'"),
        ("short.jsonl", '{"text": "The fox."}\n',
         r"holds 4 tokens, too few for two windows .*: lower --seq-len to at most 1, or pass --eval-fraction 0"),
        ("mixed.jsonl", '{"text": "a"}\n{"prompt": "b", "completion": "c"}\n',
         r'mixed.jsonl line 2: a \{"prompt", "completion"\} line in a file of \{"text"\} lines \(line 1\)'),
        ("roles.jsonl", '{"messages": [{"role": "user"}]}\n',
         r"messages\[0\] must be an object with 'role' and 'content'"),
    ],
)
def test_bad_data_files_are_refused_with_the_file_and_line(tmp_path, tokenizer, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        PackedData(path, tokenizer, seq_len=8)


def test_missing_file_and_wrong_seq_len_are_refused(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="does not exist"):
        PackedData(tmp_path / "nothing.jsonl", tokenizer, seq_len=8)
    data = PackedData(_jsonl(tmp_path / "d.jsonl", [{"text": s} for s in SENTENCES * 4]), tokenizer, seq_len=8)
    with pytest.raises(ValueError, match="packed into windows of seq_len=8"):
        data.batch(seed=0, step=1, micro_step=0, batch_size=2, seq_len=16)


def test_a_tokenizer_that_cannot_be_loaded_is_a_value_error_naming_the_folder(tmp_path):
    # transformers raises OSError for some unreadable folders and ValueError for others: both callers (train,
    # generate) turn a ValueError into one line.
    missing = tmp_path / "no-such-folder"
    with pytest.raises(ValueError, match=f"cannot load the tokenizer in {missing}"):
        load_tokenizer(missing)


def test_too_little_data_without_eval_names_seq_len_only(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"too few for one window .*: lower --seq-len to at most 3$"):
        PackedData(_jsonl(tmp_path / "d.jsonl", [{"text": "The fox."}]), tokenizer, seq_len=8, eval_fraction=0.0)


CHAT = [
    {"messages": [{"role": "user", "content": "Where is my key ?"},
                  {"role": "assistant", "content": "It is by the bridge ."}]},
    {"messages": [{"role": "system", "content": "Answer in one sentence ."},
                  {"role": "user", "content": "Where is my lamp ?"},
                  {"role": "assistant", "content": "It is by the market ."},
                  {"role": "user", "content": "Where is my boat ?"},
                  {"role": "assistant", "content": "It is by the river ."}]},
]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """The tokenizer of launch/tiny_checkpoint.py's tiny Llama (save_pretrained, a tokenizers word-level model)."""
    return load_tokenizer(tiny_checkpoint.write_checkpoint(tmp_path_factory.mktemp("chat") / "tiny-llama"))


def test_messages_carry_loss_on_assistant_turns_only_token_by_token(tmp_path, chat_tokenizer):
    data = PackedData(_jsonl(tmp_path / "chat.jsonl", CHAT * 2), chat_tokenizer, seq_len=8, eval_fraction=0.0)
    tokens = chat_tokenizer.convert_ids_to_tokens(data.tokens.tolist())
    trained = [t for t, label in zip(tokens, data.labels.tolist(), strict=True) if label != IGNORE_INDEX]
    first = ("<s> <|user|> Where is my key ? </s> <|assistant|> It is by the bridge . </s>").split()
    second = ("<s> <|system|> Answer in one sentence . </s> <|user|> Where is my lamp ? </s> <|assistant|> It is by "
              "the market . </s> <|user|> Where is my boat ? </s> <|assistant|> It is by the river . </s>").split()
    assert tokens == (first + second) * 2  # turns in order, conversations in file order, no EOS added after </s>
    mask = [False] * 9 + [True] * 7 + [False] * 16 + [True] * 7 + [False] * 8 + [True] * 7
    assert [label != IGNORE_INDEX for label in data.labels.tolist()] == mask * 2
    assert trained == "It is by the bridge . </s> It is by the market . </s> It is by the river . </s>".split() * 2
    ids = data.tokens[torch.tensor(mask * 2)]
    assert torch.equal(data.labels[torch.tensor(mask * 2)], ids)  # a trained label is its own token


def test_messages_need_a_chat_template_and_chat_template_file_gives_one(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "chat.jsonl", CHAT[:1] * 8)
    message = r'holds "messages" lines, .* has no chat template .*: pass --chat-template FILE'
    with pytest.raises(ValueError, match=message):
        PackedData(path, tokenizer, seq_len=8)
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {{ eos_token }} {% endfor %}"
                        "{% if add_generation_prompt %}assistant : {% endif %}")
    data = PackedData(path, load_tokenizer(tokenizer.name_or_path, template), seq_len=8, eval_fraction=0.0)
    context = _ids(tokenizer, "user : Where is my key ? </s> assistant : ", special=False)
    answer = _ids(tokenizer, "It is by the bridge . </s> ", special=False)
    assert data.tokens.tolist() == (context + answer) * 8
    assert data.labels.tolist() == ([IGNORE_INDEX] * len(context) + answer) * 8


def test_a_template_that_does_not_render_turns_as_prefixes_is_refused(tmp_path, chat_tokenizer):
    path = _jsonl(tmp_path / "chat.jsonl", CHAT * 4)
    template = tmp_path / "reversed.jinja"
    template.write_text("{% for m in messages | reverse %}{{ m['content'] }} {% endfor %}")
    with pytest.raises(ValueError, match="assistant turns cannot be told apart: pass --chat-template FILE"):
        PackedData(path, load_tokenizer(chat_tokenizer.name_or_path, template), seq_len=8)
