"""The fused op on a CUDA GPU at real shapes (``gpu``-marked; skipped without CUDA).

Reference: ``parallel_lora._eager`` in fp64 (``tests/_kernels.py``), repeated runs bit for bit, and what Triton
compiled against the shared-memory estimates.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
import triton

from parallel_lora import kernels
from parallel_lora._dropout import Dropout, keep_mask, seed_tensor
from parallel_lora.kernels import adapter_grads, dispatch, dx_grads, launcher, shrink_db, shrink_gemm, tuning, workspace
from parallel_lora.kernels.spec import KernelSpec
from tests._kernels import (
    DROPOUTS,
    DTYPES,
    GPU_TOL,
    SCALE,
    assert_matches,
    check_against_eager,
    count_launches,
    dropout_keep_mask,
    gpu,
    make_inputs,
    needs_cuda,
    patch_bind,
    reference,
    skip_without_tma,
)


@gpu
@needs_cuda
@pytest.mark.parametrize("position", ["pre", "post", None])
@pytest.mark.parametrize("N", [4096, 14336], ids=["attn", "mlp_up"])
def test_gpu_bf16_llama_shape_matches_fp64(position, N):
    # mlp_up: 144 adapter-gradient column tiles, whose M reductions the fused backward splits into
    # dx_grads.ITEM_ROWS chunks (the program target alone would not split them).
    torch.manual_seed(0)
    inputs = make_inputs(8192, 4096, N, 16, torch.bfloat16, device="cuda")
    seed = seed_tensor(2**45 + 17, "cuda")
    drop = None if position is None else Dropout(p=0.1, seed=seed, position=position, k_offset=4096)
    check_against_eager(*inputs, SCALE, drop, tol=GPU_TOL[torch.bfloat16])


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape",
    [
        (1, 4096, 4096, 16),
        (1000, 1001, 999, 5),  # unaligned rows: the pointer GEMM
        (1000, 1024, 1016, 5),  # aligned rows with M / N tails: the TMA GEMM on Hopper
        (333, 257, 129, 256),
        (333, 264, 136, 256),  # TMA with four rank chunks in the epilogue
        (77, 33, 65, 1),
    ],
)
def test_gpu_odd_shapes_match_fp64(dtype, shape):
    torch.manual_seed(0)
    inputs = make_inputs(*shape, dtype, device="cuda")
    check_against_eager(
        *inputs, SCALE, Dropout(p=0.1, seed=seed_tensor(5, "cuda"), position="pre", k_offset=3), tol=GPU_TOL[dtype]
    )
    post = Dropout(p=0.1, seed=seed_tensor(5, "cuda"), position="post")
    check_against_eager(*inputs, SCALE, post, tol=GPU_TOL[dtype])


@gpu
@needs_cuda
@pytest.mark.parametrize("drop", ["none", "post"])
@pytest.mark.parametrize("r", [5, 16, 20])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_backward_with_db_partials_matches_fp64_and_repeats_exactly(monkeypatch, dtype, r, drop):
    # From 8192 tokens the Hopper backward takes dB's partial sums from G's launch (shrink_db). A last row block
    # part-filled (8229 rows), a column split ending off the 128 alignment (N = 520), rank tails (r = 5 in a 16-wide
    # rank tile, r = 20 in a 32-wide one).
    skip_without_tma()
    torch.manual_seed(0)
    inputs = make_inputs(8229, 1024, 520, r, dtype, device="cuda")
    dispatch.clear_sites()
    check_against_eager(*inputs, SCALE, DROPOUTS[drop], tol=GPU_TOL[dtype])
    x, weight, b, lora_A, lora_B, dy = inputs
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, DROPOUTS[drop])
    launched = count_launches(monkeypatch)  # sees bound launches only: the layout's first call went before
    runs = [kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, DROPOUTS[drop]) for _ in range(2)]
    assert launched == ["shrink_db", "dx_grads"] * 2
    assert all(torch.equal(a, c) for a, c in zip(*runs, strict=True))


@gpu
@needs_cuda
@pytest.mark.parametrize("drop", [None, "pre", "post"])
def test_gpu_fp32_adapters_give_their_bf16_casts_results(drop):
    # fp32 masters read by the kernels (fused launches, TMA GEMM, pointer rank term) round each tile as a cast would:
    # the results are those of adapters cast beforehand, up to the summation order of configs tuned apart, and dA,
    # dB come back in fp32. Each layout tunes on its own, so equality is not bitwise.
    torch.manual_seed(0)
    x, weight, b, lora_A, lora_B, dy = make_inputs(2048, 1024, 1536, 16, torch.bfloat16, device="cuda")
    A32 = lora_A.float() + 1e-3 * torch.randn_like(lora_A, dtype=torch.float32)
    B32 = lora_B.float() + 1e-3 * torch.randn_like(lora_B, dtype=torch.float32)
    dropout = None if drop is None else Dropout(p=0.1, seed=seed_tensor(3, "cuda"), position=drop, k_offset=5)
    cast = (A32.bfloat16(), B32.bfloat16())
    y, s_lora = kernels.forward(x, weight, b, A32, B32, SCALE, dropout)
    y_ref, s_ref = kernels.forward(x, weight, b, *cast, SCALE, dropout)
    dx, dA, dB = kernels.backward(dy, x, weight, A32, B32, s_lora, SCALE, dropout)
    dx_ref, dA_ref, dB_ref = kernels.backward(dy, x, weight, *cast, s_ref, SCALE, dropout)
    assert dA.dtype == dB.dtype == torch.float32 and dx.dtype == y.dtype == torch.bfloat16
    for name, got, ref in (("y", y, y_ref), ("S", s_lora, s_ref), ("dx", dx, dx_ref), ("dA", dA, dA_ref),
                           ("dB", dB, dB_ref)):  # fmt: skip
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 1e-2, f"{name}: relative error {err:.2e} against the cast adapters' result"


@gpu
@needs_cuda
def test_gpu_backward_is_bitwise_deterministic_and_masks_match():
    torch.manual_seed(0)
    x, weight, b, lora_A, lora_B, dy = make_inputs(4096, 1024, 2048, 16, torch.bfloat16, device="cuda")
    drop = Dropout(p=0.1, seed=seed_tensor(11, "cuda"), position="pre", k_offset=1024)
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, drop)
    first = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, drop)
    second = kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, drop)
    for a, c in zip(first, second, strict=True):
        assert torch.equal(a, c)
    assert torch.equal(dropout_keep_mask(drop, 512, 1024, "cuda"), keep_mask(drop, 512, 1024, "cuda"))


@gpu
@needs_cuda
def test_gpu_direct_launch_reuses_the_compiled_kernel_and_respects_alignment():
    # The second call of a signature skips Triton's launch path (launch() calls the bound compiled kernel); a
    # misaligned view of the same data must get its own entry and still be right.
    torch.manual_seed(0)
    x, weight, b, lora_A, lora_B, dy = make_inputs(520, 256, 264, 16, torch.bfloat16, device="cuda")
    storage = torch.randn(520 * 256 + 1, device="cuda").to(torch.bfloat16)
    x_off = storage[1:].view(520, 256)  # 2 bytes past a 16-byte boundary: no TMA, no alignment hint
    x_off.copy_(x)
    launcher._BOUND.clear()
    dispatch.clear_sites()  # the op's launch sites hold bound kernels too
    for operand in (x, x, x_off, x_off, x):
        check_against_eager(operand, weight, b, lora_A, lora_B, dy, SCALE, None, tol=GPU_TOL[torch.bfloat16])
    keys = list(launcher._BOUND)
    assert any(not all(key[4]) for key in keys), keys
    n = len(keys)
    check_against_eager(x_off, weight, b, lora_A, lora_B, dy, SCALE, None, tol=GPU_TOL[torch.bfloat16])
    assert len(launcher._BOUND) == n  # seen before: nothing new compiled or bound


@gpu
@needs_cuda
def test_gpu_bound_launches_skip_tritons_wrapper_unless_a_launch_hook_is_set(monkeypatch):
    x, weight, b, lora_A, lora_B, dy = make_inputs(256, 128, 192, 16, torch.bfloat16, device="cuda")
    made, seen = [], []
    real = launcher.direct_launch
    monkeypatch.setattr(launcher, "direct_launch", lambda *a: made.append(real(*a)) or made[-1])
    for hooked in (False, True):
        if hooked:  # a profiler's hook must see every launch: Triton's own path then
            monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: seen.append(a))
        launcher._BOUND.clear()
        dispatch.clear_sites()
        made.clear()
        for _ in range(2):  # the first call binds, the second launches the bound kernels
            check_against_eager(x, weight, b, lora_A, lora_B, dy, SCALE, None, tol=GPU_TOL[torch.bfloat16])
        assert made and all((m is None) == hooked for m in made), made
    assert seen


@gpu
@needs_cuda
def test_gpu_tma_workspace_is_shared_per_stream_and_right_on_two_streams():
    # The descriptor workspace is one buffer per (device, stream); kernels on two streams at once must not
    # share one. Both streams run the op on different data concurrently and both must match the reference.
    torch.manual_seed(0)
    shapes = [(2048, 1024, 1024, 16), (1024, 2048, 512, 8)]
    inputs = [make_inputs(*shape, torch.bfloat16, device="cuda") for shape in shapes]
    refs = [reference(*i, SCALE, None)[0] for i in inputs]
    mags = [reference(*i, SCALE, None, absolute=True)[0] for i in inputs]
    streams = [torch.cuda.Stream() for _ in shapes]
    outs = [None, None]
    torch.cuda.synchronize()
    for _ in range(3):
        for j, (stream, i) in enumerate(zip(streams, inputs, strict=True)):
            with torch.cuda.stream(stream):
                outs[j] = kernels.forward(*i[:5], SCALE, None)[0]
        torch.cuda.synchronize()
        for out, ref, mag in zip(outs, refs, mags, strict=True):
            assert_matches("y", out, ref, mag, torch.bfloat16, GPU_TOL[torch.bfloat16])
    keys = {key for key in workspace.DESCRIPTORS if key[1] in {s.cuda_stream for s in streams}}
    assert len(keys) == 2, workspace.DESCRIPTORS.keys()


@gpu
@needs_cuda
def test_gpu_adapter_grads_with_many_splits_are_exact_and_reproducible_on_two_streams():
    # Dozens of splits per column tile: the last program to arrive sums every partial. Reading one before it
    # landed, or a counter another stream bumped, would show as a wrong or a run-to-run different result. At
    # these token counts dB comes from shrink_db's per-row-block partials, per-stream workspaces too.
    torch.manual_seed(0)
    shapes = [(65536, 256, 256, 16), (8192, 1024, 512, 8)]
    for M, K, N, _ in shapes:
        assert adapter_grads.split_rows(M, K + N, torch.device("cuda"))[0] >= 16
    inputs = [make_inputs(*shape, torch.bfloat16, device="cuda") for shape in shapes]
    s_loras = [kernels.forward(*i[:5], SCALE, None)[1] for i in inputs]
    refs = [reference(*i, SCALE, None) for i in inputs]
    mags = [reference(*i, SCALE, None, absolute=True) for i in inputs]
    streams = [torch.cuda.Stream() for _ in shapes]
    runs = []
    torch.cuda.synchronize()
    for _ in range(5):
        outs = [None, None]
        for j, (stream, (x, weight, _, lora_A, lora_B, dy)) in enumerate(zip(streams, inputs, strict=True)):
            with torch.cuda.stream(stream):
                outs[j] = kernels.backward(dy, x, weight, lora_A, lora_B, s_loras[j], SCALE, None)[1:]
        torch.cuda.synchronize()
        runs.append(outs)
    for j in range(len(shapes)):
        for name, out, ref, mag in zip(("dA", "dB"), runs[0][j], refs[j][3:], mags[j][3:], strict=True):
            assert_matches(name, out, ref, mag, torch.bfloat16, GPU_TOL[torch.bfloat16])
        for later in runs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(runs[0][j], later[j], strict=True))
    for count in (*workspace.COUNTERS.values(), *workspace.G_COUNTERS.values()):
        assert not count.any(), "arrival counters were left non-zero"
    assert len([key for key in workspace.DB_PARTIALS if key[1] in {s.cuda_stream for s in streams}]) == 2


@gpu
@needs_cuda
def test_gpu_new_token_count_in_a_tuned_bucket_reuses_its_config_without_tuning(monkeypatch, tmp_path):
    # Variable-length batches: after the first M of a power-of-two bucket has tuned, other Ms of the bucket
    # launch with its configs (compiling at most a new specialization), never through the tuner again.
    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path))  # an empty cache file: the first M must tune
    tuner_calls = []
    real_tune = tuning.tune

    def spy(spec, *args, **kwargs):
        tuner_calls.append(spec.name)
        return real_tune(spec, *args, **kwargs)

    monkeypatch.setattr(tuning, "tune", spy)
    torch.manual_seed(0)
    K, N, r = 1024, 768, 16
    drop = Dropout(p=0.1, seed=seed_tensor(3, "cuda"), position="pre")
    check_against_eager(*make_inputs(3000, K, N, r, torch.bfloat16, device="cuda"), SCALE, drop,
                        tol=GPU_TOL[torch.bfloat16])  # fmt: skip
    assert tuner_calls, "the first M of the bucket did not go through the tuner"
    tuner_calls.clear()
    for M in (3001, 2049, 4096, 3000):
        inputs = make_inputs(M, K, N, r, torch.bfloat16, device="cuda")
        check_against_eager(*inputs, SCALE, drop, tol=GPU_TOL[torch.bfloat16])
    assert tuner_calls == []
    check_against_eager(*make_inputs(4097, K, N, r, torch.bfloat16, device="cuda"), SCALE, drop,
                        tol=GPU_TOL[torch.bfloat16])  # fmt: skip
    assert tuner_calls, "a new bucket must tune"


@gpu
@needs_cuda
@pytest.mark.full_tuning
def test_gpu_tuning_skips_the_slow_fallback_and_leaves_the_fused_launches_consistent(monkeypatch, tmp_path):
    # ``tune`` runs every candidate many times in CUDA graphs on a side stream: the fused launches' queues and
    # flags must come out of it consistent (the op is right afterwards, twice), and it must not pick the 64x64
    # fallback tile, ~4x slower at this size.
    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(tuning, "_BEST", {})
    monkeypatch.setattr(launcher, "_BOUND", {})
    picks = []
    real_tune = tuning.tune

    def recording(spec, *args):
        cfg = real_tune(spec, *args)
        picks.append((spec.name, cfg))
        return cfg

    monkeypatch.setattr(tuning, "tune", recording)
    torch.manual_seed(0)
    inputs = make_inputs(3072, 1536, 2560, 16, torch.bfloat16, device="cuda")  # a shape no other test tunes
    for _ in range(2):
        check_against_eager(*inputs, SCALE, None, tol=GPU_TOL[torch.bfloat16])
    tuned = dict(picks)
    assert {"shrink_gemm", "dx_grads"} <= set(tuned), f"the fused launches were not tuned: {sorted(tuned)}"
    for name in ("shrink_gemm", "dx_grads"):
        assert tuned[name].kwargs["BLOCK_M"] >= 128, f"{name} picked {tuned[name]}"
    for count in workspace.COUNTERS.values():
        assert not count.any(), "arrival counters were left non-zero"


def _compile_every_config(checked: list):
    """A stand-in for ``launcher.bind`` that compiles the launch with every config its shared-memory estimate
    keeps on this GPU and checks the estimate bounds what the compiler allocated (appending each to ``checked``).
    Each launch runs with Triton's allocator set to the descriptor workspace, as ``bind``'s own launches do."""
    from triton.runtime.errors import OutOfResources

    limit = tuning.max_shared_mem(torch.cuda.current_device())

    def compile_each(spec, kernel, signature, tensors, runtime, build):
        static, grid, consts = build()
        args = (*tensors, *static, *runtime)
        nargs = dict(zip(kernel.arg_names, args, strict=False))
        elem = nargs[spec.dtype_arg].element_size()
        for cfg in spec.configs():
            need = spec.smem(cfg.kwargs, cfg.num_stages, elem, {**nargs, **consts})
            if need > limit:
                continue  # pruned before any launch
            launch = functools.partial(kernel[grid], *args, **consts, **cfg.all_kwargs())
            try:
                compiled = workspace.with_descriptor_scratch(launch)()
            except OutOfResources as err:
                pytest.fail(f"{cfg} estimated {need} B but did not fit: {err}")
            assert compiled.metadata.shared <= need, (cfg, compiled.metadata.shared, need)
            checked.append(cfg)

    return compile_each


def test_smem_check_launches_with_an_allocator_and_gives_the_callers_back(monkeypatch):
    # Device-side TMA descriptors ask Triton's allocator for memory at every launch, and only the library's own
    # launches set one: the smem checks below launch kernels themselves, so they must set it, then restore it.
    from triton.runtime._allocation import _NULL_ALLOCATOR, _allocator

    seen = []

    class Kernel:
        arg_names = ["x_ptr", "M"]

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(_allocator.get())
                return types.SimpleNamespace(metadata=types.SimpleNamespace(shared=0))

            return launch

    configs = [triton.Config({"BLOCK_M": 16}, num_warps=4, num_stages=2)]
    spec = KernelSpec("fake", lambda: configs, ("M",), lambda *a: 0, lambda *a: True, lambda n: 1, "x_ptr")
    monkeypatch.setattr(tuning, "max_shared_mem", lambda device: 1 << 20)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    callers = _allocator.get()
    checked = []
    _compile_every_config(checked)(spec, Kernel(), (), (torch.empty(1),), (), lambda: ((8,), (1,), {}))
    assert checked == configs and len(seen) == 1
    assert seen[0] not in (callers, _NULL_ALLOCATOR), "launched without an allocator of its own"
    assert _allocator.get() is callers, "the caller's allocator was not restored"


@gpu
@needs_cuda
@pytest.mark.parametrize("r", [16, 256])
def test_gpu_adapter_grads_smem_estimate_bounds_every_compiled_config(monkeypatch, r):
    # The fused adapter-gradient kernel holds two reduction loops (x's tiles, dy's tiles); the pruning
    # estimate must still bound what the compiler allocates, or a ~100 KB GPU could be handed a config
    # that does not fit.
    checked = []
    compile_each = _compile_every_config(checked)
    patch_bind(monkeypatch, compile_each)
    torch.manual_seed(0)
    M, K, N = 4096, 1024, 512
    x, dy = (torch.randn(M, n, device="cuda", dtype=torch.bfloat16) for n in (K, N))
    g, s_lora = (torch.randn(M, r, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seed = torch.tensor([1], device="cuda")  # the call's seed, read in device memory
    adapter_grads.lora_adapter_grads(x, g, dy, s_lora, p=0.1, seed=seed, drop_x=True)
    assert checked


@gpu
@needs_cuda
def test_gpu_fused_launches_with_no_spare_program_match_fp64_and_repeat_exactly():
    # M = 128 * SMs with N = 4096 makes the tile count a multiple of the SM count for every config (128x256,
    # 128x128, 64x64): no spare program. The forward's tiles then claim and compute S themselves while the row
    # block's other tiles wait, and the backward's GEMM programs work the whole reduction queue after their tiles.
    torch.manual_seed(0)
    sms = tuning.sm_count(torch.cuda.current_device())
    inputs = make_inputs(128 * sms, 1024, 4096, 16, torch.bfloat16, device="cuda")
    drop = Dropout(p=0.1, seed=seed_tensor(7, "cuda"), position="pre")
    check_against_eager(*inputs, SCALE, drop, tol=GPU_TOL[torch.bfloat16])
    x, weight, b, lora_A, lora_B, dy = inputs
    runs = []
    for _ in range(2):
        y, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, drop)
        runs.append((y, s_lora, *kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, drop)))
    assert all(torch.equal(a, c) for a, c in zip(*runs, strict=True))


@gpu
@needs_cuda
@pytest.mark.parametrize("r", [16, 32, 64, 256, "16-fp32", "64-fp32"])
@pytest.mark.parametrize("op", ["dx_grads", "dx_grads_db_sums", "shrink_gemm", "shrink_db"])
def test_gpu_fused_launch_smem_estimate_bounds_every_compiled_config(monkeypatch, op, r):
    # The fused launches hold the GEMM's pipelined loop and the loops of the work on its spare SMs (two
    # reductions, dA and the sums of dB's partials, or the producers' shrink); their buffers share shared memory
    # (the estimate takes the larger), which only holds if the compiler reuses them. shrink_db's two dots stage
    # dB's partial on its way out.
    r, adapters = (int(r[:-5]), torch.float32) if isinstance(r, str) else (r, torch.bfloat16)  # fp32: wider tiles
    if op == "shrink_gemm" and (r > 64 or (r > 16 and adapters == torch.float32)):
        pytest.skip("ranks above 64, and fp32 adapters above 16, keep the separate shrink")
    if op in ("shrink_db", "dx_grads_db_sums") and r > shrink_db.MAX_DB_R_PAD:
        pytest.skip("ranks above MAX_DB_R_PAD reduce dB from dy")

    checked = []
    compile_each = _compile_every_config(checked)
    patch_bind(monkeypatch, compile_each)
    torch.manual_seed(0)
    M, K, N = 4096, 1024, 512
    x, weight, b, lora_A, lora_B, dy = make_inputs(M, K, N, r, torch.bfloat16, device="cuda")
    lora_A, lora_B = lora_A.to(adapters), lora_B.to(adapters)
    g, s_lora = (torch.randn(M, r, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seed = torch.tensor([1], device="cuda")  # the call's seed, read in device memory
    if op == "dx_grads":
        dx_grads.lora_dx_and_grads(dy, weight, False, g, lora_A, x, s_lora, p=0.1, seed=seed, lora_drop=True)
    elif op == "dx_grads_db_sums":
        parts = torch.zeros(shrink_db.db_blocks(M) * N * r, device="cuda")
        dx_grads.lora_dx_and_grads(dy, weight, False, g, lora_A, x, None, db_partials=parts,
                                   db_parts=shrink_db.db_blocks(M), p=0.1, seed=seed, lora_drop=True)  # fmt: skip
    elif op == "shrink_db":
        shrink_db.lora_shrink_db(dy, lora_B, s_lora, 2.0, p=0.1, seed=seed, drop_post=True)
    else:
        shrink_gemm.lora_shrink_gemm(x, weight, True, b, lora_A, lora_B, 2.0, p=0.1, seed=seed, drop_post=True)
    assert checked
