"""Temporaries of ``parallel_lora._files`` and ``save_checkpoint``: each carries its writer's ``<pid>@<host>``, and the
writers remove those of the path they replace once that writer is gone, never a live writer's or another name.

Reference: a process that has exited (a finished ``sleep``) stands for a writer killed mid-write."""

import os
import subprocess
import sys
import time

import torch

from parallel_lora import latest_checkpoint, save_adapter, save_checkpoint
from parallel_lora._files import HOST, remove_stale_temporaries, replace_file, writer_gone
from tests._adapters import adapted, base_model


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temporaries_name_their_writer(tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: seen.append(os.path.basename(a)) or real_replace(a, b))
    replace_file(tmp_path / "metrics.jsonl", b"{}\n")
    assert seen[0].startswith(".metrics.jsonl.new-") and seen[0].endswith(f"-{os.getpid()}@{HOST}"), seen


def test_a_dead_writer_is_gone_and_a_live_one_or_another_hosts_is_not():
    assert writer_gone(f"{_dead_pid()}@{HOST}")
    assert not writer_gone(f"{os.getppid()}@{HOST}")
    assert not writer_gone(f"{_dead_pid()}@another-host")
    # A live pid whose process started after the temporary was last written is another process: its pid was reused.
    assert writer_gone(f"{os.getpid()}@{HOST}", since=time.time() - 10 * 365 * 86400)
    assert not writer_gone(f"{os.getpid()}@{HOST}", since=time.time())


def test_save_adapter_removes_the_stale_temporaries_of_its_path_only(tmp_path):
    out = tmp_path / "adapter"
    dead, live = f"{_dead_pid()}@{HOST}", f"{os.getppid()}@{HOST}"
    stale = [tmp_path / f".adapter.new-0000000a-{dead}", tmp_path / ".adapter.new-1b98858e"]  # the second: untagged
    kept = [tmp_path / f".adapter.new-0000000b-{live}", tmp_path / f".adapter.new-0000000c-{_dead_pid()}@elsewhere",
            tmp_path / f".other.new-0000000d-{dead}", tmp_path / "notes.txt"]
    for p in stale + kept:
        p.mkdir() if p.suffix != ".txt" else p.write_text("mine")
        if p.is_dir():
            (p / "adapter_model.safetensors").write_bytes(b"partial")
    save_adapter(adapted(base_model()), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["adapter", *(p.name for p in kept)])


def test_an_old_directory_is_kept_while_it_holds_the_only_adapter(tmp_path):
    # A crash between the two renames of the fallback swap leaves the previous adapter at .<name>.old-*, and no <name>.
    old = tmp_path / f".adapter.old-0000000a-{_dead_pid()}@{HOST}"
    old.mkdir()
    assert remove_stale_temporaries(tmp_path / "adapter") == []
    (tmp_path / "adapter").mkdir()
    assert remove_stale_temporaries(tmp_path / "adapter") == [old] and not old.exists()


def test_save_checkpoint_removes_its_steps_stale_temporaries_only(tmp_path):
    model = adapted(base_model())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    dead, live = f"{_dead_pid()}@{HOST}", f"{os.getppid()}@{HOST}"
    stale = ["step_00000002.tmp", f"step_00000002.tmp-{dead}"]
    kept = [f"step_00000002.tmp-{live}", f"step_00000003.tmp-{dead}", "step_00000002.bak"]
    for name in stale + kept:
        (tmp_path / name).mkdir()
    save_checkpoint(tmp_path, model, opt, step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["step_00000002", *kept])
    assert latest_checkpoint(tmp_path).name == "step_00000002"
