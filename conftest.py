"""Test set-up of every test folder (tests/, launch/, tools/, benchmarks/): Triton runs in its CPU interpreter when
there is no GPU; every test is seeded; tuned configs go to a cache folder of the session's own; GPU tests launch one
config per kernel variant instead of tuning (those marked ``full_tuning`` time every candidate)."""

import os

import torch

# Must happen before any @triton.jit function is defined, i.e. before parallel_lora.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True, scope="session")
def _session_tuning_cache(tmp_path_factory):
    # Tests neither reuse the configs a user's runs tuned (a test that pins tuning would not tune) nor leave theirs
    # in the user's cache. Processes the tests start inherit the variable.
    before = os.environ.get("PARALLEL_LORA_CACHE_DIR")
    os.environ["PARALLEL_LORA_CACHE_DIR"] = str(tmp_path_factory.mktemp("parallel_lora_cache"))
    yield
    if before is None:
        del os.environ["PARALLEL_LORA_CACHE_DIR"]
    else:
        os.environ["PARALLEL_LORA_CACHE_DIR"] = before


@pytest.fixture(autouse=True)
def _gpu_tests_tune_one_candidate(request, monkeypatch):
    # Tuning a launch compiles and times every candidate config (seconds each), which no correctness check needs:
    # GPU tests launch one config per kernel variant, unless they pin tuning itself (``full_tuning``).
    if not torch.cuda.is_available() or request.node.get_closest_marker("gpu") is None:
        return
    if request.node.get_closest_marker("full_tuning") is not None:
        return
    from parallel_lora.kernels import tuning
    from tests._tuning import one_candidate

    monkeypatch.setattr(tuning, "tune", one_candidate(tuning.tune))
