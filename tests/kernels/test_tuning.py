"""Config choice (``parallel_lora.kernels.tuning`` and each kernel's configs): pruning by shared memory and
size, the size buckets, the per-variant config cache, the interleaved timing rounds, and the cache file that
later processes read instead of tuning (``tune`` stubbed, a fake GPU name: runs on CPU).

Every kernel keeps a config that fits a ~100 KB shared-memory GPU at every rank and dtype.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing

import pytest
import torch
import triton

from parallel_lora.kernels import gemm, shrink, tuning
from parallel_lora.kernels.spec import KernelSpec

_SPECS = {
    "gemm": ("parallel_lora.kernels.gemm", {"M": 8192, "N_OUT": 4096, "K_RED": 4096}),
    "gemm_tma": ("parallel_lora.kernels.gemm_tma", {"M": 8192, "N_OUT": 4096, "K_RED": 4096}),
    "shrink": ("parallel_lora.kernels.shrink", {"M": 8192, "K": 4096}),
    "adapter_grads": ("parallel_lora.kernels.adapter_grads", {"M": 8192, "F_A": 4096, "F_B": 4096}),
    "dx_grads": ("parallel_lora.kernels.dx_grads", {"M": 8192, "N_OUT": 4096, "K_RED": 4096, "F_A": 4096, "F_B": 4096}),
    "shrink_gemm": ("parallel_lora.kernels.shrink_gemm", {"M": 8192, "N_OUT": 4096, "K_RED": 4096}),
    "shrink_db": ("parallel_lora.kernels.shrink_db", {"M": 8192, "N": 4096}),
}


def _consts(kernel, r_pad, monkeypatch) -> dict:
    """The rank-derived constexprs a launch of ``kernel`` passes at this rank on a GPU."""
    consts = {"R_PAD": r_pad, "BLOCK_R": min(r_pad, 64)}
    if kernel == "dx_grads":
        from parallel_lora.kernels import dx_grads

        monkeypatch.setattr(dx_grads, "interpreting", lambda: False)
        consts.update(zip(("RED_BLOCK_M", "RED_STAGES"), dx_grads.red_tiles(r_pad), strict=True))
    if kernel == "shrink":
        consts["DROP_PRE"] = True  # the larger estimate: the "pre"-masked x tile staged for the tensor cores
        consts["SPLIT_K"] = True  # and a split's partial staged for its store
    if kernel == "shrink_gemm":
        from parallel_lora.kernels import shrink_gemm

        consts["S_STAGES"] = shrink_gemm.S_STAGES
    if kernel == "shrink_db":
        from parallel_lora.kernels import shrink_db

        monkeypatch.setattr(shrink_db, "interpreting", lambda: False)
        consts["ROWS"] = shrink_db.db_rows()
    return consts


def _spec(kernel):
    module, sizes = _SPECS[kernel]
    return importlib.import_module(module).SPEC, sizes


@pytest.mark.parametrize("smem_limit", [101_376, 232_448], ids=["100KB", "H200"])
@pytest.mark.parametrize("r_pad", [16, 32, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernel", list(_SPECS))
def test_tuning_pruned_configs_fit_shared_memory(monkeypatch, kernel, dtype, r_pad, smem_limit):
    from parallel_lora.kernels import shrink_db

    if kernel in ("gemm_tma", "dx_grads", "shrink_gemm") and dtype == torch.float32:
        pytest.skip("the TMA GEMM takes 16-bit operands only (fp32 goes to the pointer kernel)")
    if kernel == "shrink_gemm" and r_pad > 64:
        pytest.skip("ranks above 64 keep the separate shrink (shrink_gemm.MAX_FUSED_R_PAD)")
    if kernel == "shrink_db" and (r_pad > shrink_db.MAX_DB_R_PAD or dtype == torch.float32):
        pytest.skip("shrink_db runs before the fused dx launch (16-bit), at ranks up to shrink_db.MAX_DB_R_PAD")
    spec, sizes = _spec(kernel)
    consts = _consts(kernel, r_pad, monkeypatch)
    nargs = {spec.dtype_arg: torch.empty(1, dtype=dtype), "R": r_pad, **sizes}
    kept = tuning.prune(spec, spec.configs(), nargs, smem_limit=smem_limit, **consts)
    assert kept
    elem = torch.empty(0, dtype=dtype).element_size()
    for c in kept:
        assert spec.smem(c.kwargs, c.num_stages, elem, {**nargs, **consts}) <= smem_limit, c


@pytest.mark.parametrize("kernel", list(_SPECS))
def test_tuning_small_problems_take_one_config_large_ones_tune(monkeypatch, kernel):
    spec, sizes = _spec(kernel)
    consts = _consts(kernel, 16, monkeypatch)
    large = {spec.dtype_arg: torch.empty(1, dtype=torch.bfloat16), "R": 16, **sizes}
    small = {**large, **{name: 64 for name in sizes}}
    assert len(tuning.prune(spec, spec.configs(), small, smem_limit=232_448, **consts)) == 1
    assert len(tuning.prune(spec, spec.configs(), large, smem_limit=232_448, **consts)) > 1


def test_shrink_of_a_short_sequence_tunes_and_splits_k(monkeypatch):
    # A bandwidth-bound shrink at 2048 tokens is timed, not handed the smallest config, and on 132 SMs its few row
    # blocks split K in four; from 8192 tokens (or K of one tile) nothing splits.
    spec, consts = shrink.SPEC, {"R_PAD": 16, "DROP_PRE": False, "SPLIT_K": True}
    nargs = {"x_ptr": torch.empty(1, dtype=torch.bfloat16), "M": 2048, "K": 2048, "R": 16}
    assert len(tuning.prune(spec, spec.configs(), nargs, smem_limit=232_448, **consts)) > 1
    monkeypatch.setattr(shrink, "interpreting", lambda: False)
    monkeypatch.setattr(shrink, "sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    assert shrink.k_splits(2048, 2048, gpu) == (4, 512)
    assert shrink.k_splits(2048, 8192, gpu) == (4, 2048)
    assert shrink.k_splits(1024, 600, gpu) == (3, 256)
    assert shrink.k_splits(8192, 4096, gpu) == (1, 4096)
    assert shrink.k_splits(2048, 256, gpu) == (1, 256)


def test_tuning_buckets_the_token_count_and_keeps_the_layer_sizes():
    # Autotuned configs and compiled kernels are shared by the Ms of one power-of-two bucket; K, N and r are
    # a layer's own and stay exact.
    spec, kernel = shrink.SPEC, shrink._lora_shrink_kernel

    def sizes(M, K, R):
        args = [0] * len(kernel.arg_names)
        for name, v in (("M", M), ("K", K), ("R", R)):
            args[kernel.arg_names.index(name)] = v
        return tuning.bucketed_sizes(spec, kernel, tuple(args))

    assert sizes(3000, 4096, 16) == sizes(2049, 4096, 16) == sizes(4096, 4096, 16) == (4096, 4096, 16)
    assert sizes(4097, 4096, 16) == (8192, 4096, 16)
    assert sizes(3000, 4095, 16) != sizes(3000, 4096, 16) and sizes(3000, 4096, 8) != sizes(3000, 4096, 16)
    with pytest.raises(ValueError, match="start with the token count M"):
        KernelSpec("x", spec.configs, ("K", "M"), spec.smem, spec.fits, spec.work, "x_ptr")


def test_tuning_each_constexpr_variant_has_its_own_config():
    # A dx GEMM with the "pre" mask (more registers) must not reuse the config tuned, and pruned for shared
    # memory, for the plain dx GEMM of the same sizes (Triton's autotuner keyed its cache on sizes and dtypes
    # only): the constexprs are part of the tuned config's key.
    spec, kernel = gemm.SPEC, gemm._lora_gemm_kernel
    args = [torch.empty(1, dtype=torch.bfloat16)] + [64] * (len(kernel.arg_names) - 1)
    plain = {"HAS_BIAS": False, "LORA_DROP": False, "BLOCK_R": 16}
    masked = {**plain, "LORA_DROP": True}
    key = tuning.best_key(spec, kernel, tuple(args), plain)
    assert tuning.best_key(spec, kernel, tuple(args), dict(plain)) == key
    assert tuning.best_key(spec, kernel, tuple(args), masked) != key
    half = [torch.empty(1, dtype=torch.float16)] + args[1:]
    assert tuning.best_key(spec, kernel, tuple(half), plain) != key


def test_tuning_inside_graph_capture_says_to_run_a_step_eagerly_first(monkeypatch):
    # Timing candidates needs synchronization, which a capture forbids: a clear error, not a CUDA one.
    spec, kernel = gemm.SPEC, gemm._lora_gemm_kernel
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    two = spec.configs()[:2]
    monkeypatch.setattr(tuning, "prune", lambda *args, **kwargs: two)
    args = (torch.empty(1, dtype=torch.bfloat16),) + (64,) * (len(kernel.arg_names) - 1)
    with pytest.raises(RuntimeError, match="cannot happen inside CUDA graph capture. Run one step eagerly"):
        tuning.tune(spec, kernel, (1,), args, {})
    monkeypatch.setattr(tuning, "prune", lambda *args, **kwargs: two[:1])
    assert tuning.tune(spec, kernel, (1,), args, {}) is two[0], "one candidate needs no timing"


def test_tuning_takes_the_lowest_median_over_rounds_led_by_each_candidate():
    # Candidate 1 is the fastest but for one slow round; candidate 2 is fast once (timed first on a cool GPU).
    samples = {0: [10.0] * 5, 1: [5.0, 5.0, 50.0, 5.0, 5.0], 2: [1.0, 9.0, 9.0, 9.0, 9.0]}
    order = []

    def time_one(i):
        order.append(i)
        return samples[i][sum(o == i for o in order) - 1]

    assert tuning.fastest(3, time_one, rounds=5) == 1
    assert [order[3 * k] for k in range(5)] == [0, 1, 2, 0, 1], "each round must start at another candidate"
    assert sorted(order) == [0] * 5 + [1] * 5 + [2] * 5
    assert tuning.fastest(2, lambda i: 1.0, rounds=3) == 0, "ties go to the first (listed) candidate"


# ------------------------------------------------------------------------------------------- the cache file


class _Kernel:
    """Stands for a JITFunction: its argument names and source hash, and a launch that records its config."""

    def __init__(self, arg_names):
        self.arg_names, self.__name__, self.cache_key, self.launched = arg_names, "_fake_kernel", "f00d" * 16, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append(kwargs) or "compiled"


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A GPU named "NVIDIA H100 80GB HBM3" (sm_90), the cache under ``tmp_path``, and a ``tune`` that records
    its calls and picks the third listed config; nothing tuned in memory yet."""
    _new_process(monkeypatch)
    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    tuned = []

    def tune(spec, kernel, grid, args, consts):
        tuned.append(spec.name)
        return spec.configs()[2]

    monkeypatch.setattr(tuning, "tune", tune)
    return tuned


def _new_process(monkeypatch) -> None:
    """What a new process starts with: nothing tuned in memory, no warning given yet."""
    monkeypatch.setattr(tuning, "_BEST", {})
    monkeypatch.setattr(tuning, "_WARNED", set())


def _launch(M=3000, K=4096, R=16, dtype=torch.bfloat16, **consts):
    """A shrink launch through ``launch_tuned``; its config."""
    kernel = _Kernel(shrink._lora_shrink_kernel.arg_names)
    args = [torch.empty(1, dtype=dtype)] + [0] * (len(kernel.arg_names) - 1)
    for name, v in (("M", M), ("K", K), ("R", R)):
        args[kernel.arg_names.index(name)] = v
    compiled, cfg = tuning.launch_tuned(shrink.SPEC, kernel, (1,), tuple(args), {"R_PAD": 16, **consts})
    assert compiled == "compiled" and kernel.launched[-1] == {"R_PAD": 16, **consts, **cfg.all_kwargs()}
    return cfg


def test_tuning_cache_file_gives_a_new_process_the_same_config_without_tuning(fake_gpu, monkeypatch, tmp_path):
    first = _launch()
    assert fake_gpu == ["shrink"]
    path = tuning.cache_file(0)
    assert path.parent == tmp_path / "tuning" and path.is_file()
    _new_process(monkeypatch)
    second = _launch(M=2049)  # another M of the same bucket
    assert fake_gpu == ["shrink"], "the second process tuned again"
    assert tuning.config_to_json(second) == tuning.config_to_json(first)
    _launch(M=4097)  # a new bucket tunes, and is kept beside the first
    assert fake_gpu == ["shrink"] * 2 and len(json.loads(path.read_text())["configs"]) == 2


def test_tuning_cache_file_deleted_tunes_again(fake_gpu, monkeypatch):
    _launch()
    tuning.cache_file(0).unlink()
    _new_process(monkeypatch)
    _launch()
    assert fake_gpu == ["shrink"] * 2 and tuning.cache_file(0).is_file()


# A file cut short, one of another layout, and an entry (for the launch's own key) without its fields.
_CORRUPT = {"not-json": "{not json", "no-entries": '{"format": 1, "configs": []}',
            "bad-entry": '{"format": 1, "configs": {"%s": {}}}'}  # fmt: skip


@pytest.mark.parametrize("garbage", list(_CORRUPT.values()), ids=list(_CORRUPT))
def test_tuning_cache_file_corrupt_warns_in_one_line_and_tunes_again(fake_gpu, monkeypatch, capsys, garbage):
    _launch()
    path, key = tuning.cache_file(0), next(iter(json.loads(tuning.cache_file(0).read_text())["configs"]))
    path.write_text(garbage.replace("%s", key))
    _new_process(monkeypatch)
    _launch()
    _launch(K=1024)
    assert fake_gpu == ["shrink"] * 3
    warnings = [line for line in capsys.readouterr().err.splitlines() if "tuning cache" in line]
    assert warnings == [f"parallel_lora: the tuning cache {path} is corrupt; tuning again and rewriting it"]
    assert len(json.loads(path.read_text())["configs"]) == 2, "the rewritten file holds both tuned launches"


def test_tuning_cache_file_is_per_gpu_and_triton_version_and_key_per_variant(fake_gpu, monkeypatch, tmp_path):
    h100 = tuning.cache_file(0)
    assert h100 == tmp_path / "tuning" / f"nvidia-h100-80gb-hbm3-sm90-triton{triton.__version__}.json"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (8, 0))
    assert tuning.cache_file(0) != h100
    monkeypatch.setattr(triton, "__version__", "0.0.1")
    assert tuning.cache_file(0).name.endswith("-sm80-triton0.0.1.json")
    spec, kernel = shrink.SPEC, _Kernel(shrink._lora_shrink_kernel.arg_names)
    args = [torch.empty(1, dtype=torch.bfloat16)] + [64] * (len(kernel.arg_names) - 1)
    key = tuning.cache_key(spec, kernel, tuple(args), {"DROP_PRE": False})
    assert tuning.cache_key(spec, kernel, tuple(args), {"DROP_PRE": True}) != key
    assert tuning.cache_key(spec, kernel, (torch.empty(1, dtype=torch.float16), *args[1:]), {"DROP_PRE": False}) != key
    kernel.cache_key = "beef" * 16  # the kernel's source changed
    assert tuning.cache_key(spec, kernel, tuple(args), {"DROP_PRE": False}) != key


def test_tuning_cache_config_round_trips_through_json():
    for cfg in (triton.Config({"BLOCK_M": 128, "BLOCK_N": 256}, num_warps=8, num_stages=3),
                triton.Config({"BLOCK_F": 32}, num_warps=4, num_stages=2, num_ctas=2, maxnreg=128)):  # fmt: skip
        back = tuning.config_from_json(json.loads(json.dumps(tuning.config_to_json(cfg))))
        assert back.all_kwargs() == cfg.all_kwargs() and back.maxnreg == cfg.maxnreg


def test_tuning_in_memory_configs_are_bounded_and_refilled_from_the_file(fake_gpu, monkeypatch):
    monkeypatch.setattr(tuning, "BEST_MAX", 2)
    for K in (1024, 2048, 4096):
        _launch(K=K)
    assert len(tuning._BEST) == 2 and fake_gpu == ["shrink"] * 3
    _launch(K=1024)  # the least recently used, dropped from memory: read back from the file
    assert fake_gpu == ["shrink"] * 3


def _store_keys(path, first: int) -> None:
    for i in range(first, first + 10):
        tuning.write_cache(path, f"key{i}", triton.Config({"BLOCK_M": i}, num_warps=4, num_stages=2))


def test_tuning_cache_writes_of_concurrent_processes_keep_every_entry(tmp_path):
    path = tmp_path / "cache.json"
    procs = [multiprocessing.get_context("fork").Process(target=_store_keys, args=(path, 10 * i)) for i in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    assert [proc.exitcode for proc in procs] == [0] * 4
    assert sorted(tuning.read_cache(path)) == sorted(f"key{i}" for i in range(40))
    assert not list(tmp_path.glob("*.tmp")), "a temporary file was left behind"


# ------------------------------------------------------------------------------- what GPU tests tune with


class _Refusing(_Kernel):
    """A fake kernel whose compiler refuses the configs in ``refused`` (by their kwargs)."""

    def __init__(self, arg_names, refused=()):
        super().__init__(arg_names)
        self.refused = refused

    def __getitem__(self, grid):
        from triton.runtime.errors import OutOfResources

        def launch(*args, **kwargs):
            if any(all(kwargs.get(k) == v for k, v in r.items()) for r in self.refused):
                raise OutOfResources(1, 0, "shared memory")
            self.launched.append(kwargs)

        return launch


def _gemm_args(kernel, dtype=torch.bfloat16, M=8192):
    args = [torch.empty(1, dtype=dtype)] + [16] * (len(kernel.arg_names) - 1)
    for name, v in (("M", M), ("N_OUT", 4096), ("K_RED", 4096)):
        args[kernel.arg_names.index(name)] = v
    return tuple(args)


def test_one_candidate_gives_gpu_tests_one_kept_config_per_kernel_variant_without_timing(monkeypatch):
    # What conftest tunes GPU tests with (tests/_tuning.py).
    from tests._tuning import one_candidate

    monkeypatch.setattr(tuning, "max_shared_mem", lambda device: 232_448)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    real = []
    tune = one_candidate(lambda *args: real.append(args) or "real")
    spec, kernel = gemm.SPEC, _Kernel(gemm._lora_gemm_kernel.arg_names)
    consts = {"HAS_BIAS": False, "LORA_DROP": False, "BLOCK_R": 16}
    kept = tuning.prune(spec, spec.configs(), dict(zip(kernel.arg_names, _gemm_args(kernel), strict=True)), **consts)
    assert len(kept) > 1
    pick = tune(spec, kernel, (1,), _gemm_args(kernel), consts)
    assert real == [] and len(kernel.launched) == 1, "one launch (its compile), no timing"
    assert tuning.config_to_json(pick) in [tuning.config_to_json(c) for c in kept]
    same = tune(spec, kernel, (1,), _gemm_args(kernel, M=4096), consts)
    assert tuning.config_to_json(same) == tuning.config_to_json(pick), "another size of the variant, another compile"
    picks = {str(tune(spec, kernel, (1,), _gemm_args(kernel, dtype), {**consts, "HAS_BIAS": bias, "LORA_DROP": drop}))
             for dtype in (torch.bfloat16, torch.float16, torch.float32) for bias in (False, True)
             for drop in (False, True)}  # fmt: skip
    assert len(picks) > 1, "every variant picked the same config"
    refusing = _Refusing(kernel.arg_names, refused=[pick.kwargs])
    assert tune(spec, refusing, (1,), _gemm_args(refusing), consts).kwargs != pick.kwargs
    small = {"M": 64, "N_OUT": 64, "K_RED": 64}
    args = tuple(small.get(name, a) for name, a in zip(kernel.arg_names, _gemm_args(kernel), strict=True))
    assert tune(spec, kernel, (1,), args, consts) == "real", "a single candidate is tune's own case"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert tune(spec, kernel, (1,), _gemm_args(kernel), consts) == "real", "capture: tune's own error"
