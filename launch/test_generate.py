"""``launch/generate.py`` end to end (subprocesses) on a tiny random Llama checkpoint and a random adapter.

Reference: transformers' own greedy ``generate`` of the same checkpoint, with the adapter put on by PEFT (the
``adapter:`` line) and without it (the ``base:`` line). Under ``torchrun`` at tp = 2 the output must be the same.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallel_lora import LoRAConfig, apply_lora, save_adapter
from parallel_lora.layers import lora_modules
from tests import _hf

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The old fox"
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_and_adapter(tmp_path_factory) -> tuple[Path, Path]:
    """A checkpoint, and an adapter of two ranks and alphas (``apply_lora`` twice): its file has ``rank_pattern``
    and ``alpha_pattern`` entries, which generate.py must honour."""
    root = tmp_path_factory.mktemp("gen")
    model_dir = _hf.write_checkpoint(root / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    apply_lora(model, LoRAConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj")))
    apply_lora(model, LoRAConfig(r=2, alpha=6, target_modules=("down_proj",)))
    with torch.no_grad():
        for _, layer in lora_modules(model):
            layer.lora_B.weight.normal_(0.0, 0.5)  # a strong update, so the completions differ
    save_adapter(model, root / "adapter")
    assert json.loads((root / "adapter" / "adapter_config.json").read_text())["rank_pattern"]
    return model_dir, root / "adapter"


def _generate(*args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    script = [str(REPO / "launch" / "generate.py"), *args]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *launcher, *script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def _reference(model_dir: Path, adapter: Path) -> dict[str, str]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]

    def greedy(model) -> str:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    base_text = greedy(base)
    return {"adapter": greedy(peft.PeftModel.from_pretrained(base, adapter).eval()), "base": base_text}


def _printed(stdout: str) -> dict[str, str]:
    rows = dict(line.split(":", 1) for line in stdout.splitlines() if line.split(":", 1)[0] in ("adapter", "base"))
    return {k: v.strip() for k, v in rows.items()}


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2], ids=["one-process", "torchrun-tp2"])
def test_generate_prints_the_adapted_and_the_base_completion(model_and_adapter, nproc):
    model_dir, adapter = model_and_adapter
    proc = _generate("--model", str(model_dir), "--adapter", str(adapter), "--prompt", PROMPT,
                     "--max-new-tokens", str(NEW_TOKENS), "--compare", nproc=nproc)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert f"prompt:  {PROMPT}" in proc.stdout
    want = _reference(model_dir, adapter)
    assert want["adapter"] != want["base"], "the adapter must change the completion for this test to mean anything"
    assert _printed(proc.stdout) == want, proc.stdout
    assert "was trained on" not in proc.stderr, proc.stderr  # its own base, split or not: nothing to say


@pytest.mark.parametrize("strict", [False, True], ids=["warns", "strict-refuses"])
def test_generate_on_another_same_shaped_base_warns_once_or_refuses_under_strict(model_and_adapter, tmp_path, strict):
    model_dir, adapter = model_and_adapter
    other = _hf.write_checkpoint(tmp_path / "other", seed=1)
    proc = _generate("--model", str(other), "--adapter", str(adapter), "--prompt", PROMPT, "--max-new-tokens", "2",
                     *(["--strict"] if strict else []), nproc=2)
    ours = ("warning: load_adapter: ", "generate.py: error: --adapter: load_adapter: ")  # not torchrun's report of it
    lines = [line for line in proc.stderr.splitlines() if line.startswith(ours) and "was trained on" in line]
    assert len(lines) == 1 and f"trained on '{model_dir}' (llama with " in lines[0], proc.stderr
    if strict:
        assert proc.returncode != 0 and lines[0].startswith("generate.py: error: --adapter: load_adapter: ")
    else:
        assert proc.returncode == 0 and lines[0].startswith("warning: load_adapter: "), proc.stderr


@pytest.mark.slow
def test_generate_refuses_a_missing_model_or_adapter_with_a_message(model_and_adapter, tmp_path):
    model_dir, adapter = model_and_adapter
    proc = _generate("--model", str(tmp_path / "none"), "--adapter", str(adapter), "--prompt", PROMPT)
    assert proc.returncode != 0 and "does not exist" in proc.stderr, proc.stderr[-2000:]
    proc = _generate("--model", str(model_dir), "--adapter", str(tmp_path), "--prompt", PROMPT)
    assert proc.returncode != 0 and "no adapter_config.json there" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_generate_refuses_an_adapter_config_without_r_once_under_torchrun(model_and_adapter, tmp_path):
    model_dir, adapter = model_and_adapter
    broken = tmp_path / "adapter"
    shutil.copytree(adapter, broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    del config["r"]
    (broken / "adapter_config.json").write_text(json.dumps(config))
    proc = _generate("--model", str(model_dir), "--adapter", str(broken), "--prompt", PROMPT, nproc=2)
    assert proc.returncode != 0
    # One line from rank 0, before any process group or weight, instead of a KeyError traceback per rank (torchrun
    # adds its own summary of the failed job).
    message = "generate.py: error: --adapter: adapter_configs: "
    assert proc.stderr.count(message) == 1 and "r=None, lora_alpha=8: both are needed" in proc.stderr, proc.stderr
    assert "KeyError" not in proc.stderr and "apply_lora" not in proc.stderr, proc.stderr
