"""Recorded programs (``parallel_lora.kernels.program``): a plan's call recorded once, then replayed.

Every kernel is bound to a fake of Triton 3.6's C entry that records its arguments (the seam of
``test_launcher``), so a replay can be compared with the launchers' own call, argument by argument. Reference: the
launchers' call on the same operands; fresh outputs may sit at other addresses, one for one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from parallel_lora import LoRAConfig, LoRALinear, functional
from parallel_lora.kernels import dispatch, host, launcher, program, workspace
from tests._kernels import gpu, needs_cuda, patch_bind


class _Entry:
    """Triton 3.6's ``CudaLauncher`` for one kernel: its C entry appends ``(kernel, args)`` to a shared log."""

    num_ctas, global_scratch_size, global_scratch_align, profile_scratch_size = 1, 128, 64, 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, name: str, log: list):
        self.launch = lambda *args: log.append((name, args))

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        raise AssertionError("the Python half of the launcher ran")


@pytest.fixture
def log(monkeypatch) -> list:
    calls, scratch = [], torch.empty(4096, dtype=torch.int8)
    monkeypatch.setattr(launcher.triton, "__version__", "3.6.0")
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launcher, "descriptor_scratch", lambda *a: scratch)
    monkeypatch.setattr(program, "descriptor_scratch", lambda *a: scratch)
    monkeypatch.setattr(workspace, "_CACHES", (*workspace._CACHES, {"scratch": scratch}))

    def bind(spec, kernel, signature, tensors, runtime, build):
        static, grid, consts = build()
        members = {"run": _Entry(spec.name, calls), "function": spec.name, "packed_metadata": kernel.__name__,
                   "_init_handles": lambda self: None}  # fmt: skip
        compiled = type("Compiled", (), members)()
        bound = launcher.Bound(spec.name, launcher.direct_launch(compiled, (3, 2, 1), True, static, ("tail",)))
        bound.launch(tensors, runtime)
        return bound

    patch_bind(monkeypatch, bind)
    dispatch.clear_sites()
    return calls


def _layer(dropout: float, position: str, bias: bool, K: int = 64, N: int = 48, device: str = "cpu") -> LoRALinear:
    torch.manual_seed(0)
    cfg = LoRAConfig(r=8, alpha=16, dropout=dropout, dropout_position=position, backend="triton",
                     lora_dtype=torch.float32)  # fmt: skip
    layer = LoRALinear(K, N, cfg, bias=bias, dtype=torch.bfloat16, device=device).train()
    nn.init.normal_(layer.lora_B.weight)
    return layer


def _step(layer, x, dy, seed) -> tuple:
    """One forward and backward with ``seed`` as the layer's dropout seed: its outputs and gradients."""
    layer._dropout_stream = type("Seeds", (), {"next_seed": lambda self, x: seed})()
    y = layer(x)
    grads = torch.autograd.grad(y, [t for t in (x, layer.lora_A.weight, layer.lora_B.weight) if t.requires_grad], dy)
    return (y, *grads)


def _same_up_to_fresh_addresses(replayed: list, called: list, fresh: dict, outputs: set) -> None:
    # Argument by argument equal, but where the launchers' call passed the address of one of its fresh ``outputs``:
    # there the replay passes its own fresh output's, the same one at every use, another for another output.
    assert [name for name, _ in replayed] == [name for name, _ in called]
    for (name, ours), (_, theirs) in zip(replayed, called, strict=True):
        assert len(ours) == len(theirs), name
        for a, b in zip(ours, theirs, strict=True):
            if a != b:
                assert b in outputs and fresh.setdefault(b, a) == a, name
    assert len(set(fresh.values())) == len(fresh)


def _recorded_outputs(monkeypatch) -> set:
    """The addresses of the fresh outputs of every call recorded from now on."""
    addresses, real = set(), program.build

    def build(notes, *args):
        addresses.update(t.data_ptr() for t in notes.outputs)
        return real(notes, *args)

    monkeypatch.setattr(program, "build", build)
    return addresses


@pytest.mark.parametrize(("bias", "x_grad"), [(False, True), (True, True), (False, False)])
@pytest.mark.parametrize(("dropout", "position", "seed"), [(0.0, "pre", None), (0.1, "pre", 1234),
                         (0.1, "post", 99), (0.1, "post", "tensor")])  # fmt: skip
def test_a_replay_passes_every_entry_what_the_launchers_pass(log, dropout, position, seed, bias, x_grad, monkeypatch):
    layer = _layer(dropout, position, bias)
    x = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=x_grad)
    dy = torch.randn(40, 48, dtype=torch.bfloat16)
    if seed == "tensor":
        seed = torch.tensor([5], dtype=torch.int64)
    _step(layer, x, dy, seed)  # binds every launch and fills the plan's sites
    log.clear()
    outputs = _recorded_outputs(monkeypatch)
    called = _step(layer, x, dy, seed)  # the launchers' call, recorded
    first = list(log)
    log.clear()
    for name in ("run_forward", "run_backward"):
        monkeypatch.setattr(dispatch, name, lambda *a: pytest.fail("a replay called the launchers"))
    replayed = _step(layer, x, dy, seed)
    fresh = {}
    _same_up_to_fresh_addresses(log, first, fresh, outputs)
    assert replayed[0].grad_fn.name() == "LoRABackward"  # replay.cpp's node
    assert len(fresh) >= 2  # y and dx at least
    for ours, theirs in zip(replayed, called, strict=True):
        assert (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype)
        assert ours.data_ptr() == fresh.get(theirs.data_ptr(), theirs.data_ptr())
    plan = next(iter(layer._plans.values()))
    assert all(plan.fwd_programs.by_stream.values()), "the forward was not recorded"


@pytest.mark.parametrize("seed", [None, "tensor"])
def test_the_compiled_ops_calls_replay_too(log, seed, monkeypatch):
    # Callers without a plan (the compiled op) keep programs beside their layout's sites: the same entry calls.
    from parallel_lora import kernels
    from parallel_lora._dropout import Dropout

    x, weight, lora_A, lora_B = torch.randn(40, 64), torch.randn(48, 64), torch.randn(8, 64), torch.randn(48, 8)
    dy = torch.randn(40, 48)
    drop = None if seed is None else Dropout(0.1, torch.tensor([5], dtype=torch.int64), "post")

    def calls():
        y, s_lora = kernels.forward(x, weight, None, lora_A, lora_B, 2.0, drop)
        return y, s_lora, *kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, 2.0, drop)

    calls()  # binds
    log.clear()
    outputs = _recorded_outputs(monkeypatch)
    called = calls()  # records
    first = list(log)
    log.clear()
    for name in ("run_forward", "run_backward"):
        monkeypatch.setattr(dispatch, name, lambda *a: pytest.fail("a replay called the launchers"))
    replayed = calls()
    fresh = {}
    _same_up_to_fresh_addresses(log, first, fresh, outputs)
    for ours, theirs in zip(replayed, called, strict=True):
        assert ours.data_ptr() == fresh[theirs.data_ptr()]


@pytest.mark.parametrize(("p", "position"), [(0.0, "post"), (0.1, "post"), (0.1, "pre")])
def test_the_compiled_ops_replay_keeps_each_calls_scalars(log, p, position, monkeypatch):
    # Layers of one layout but another alpha, dropout p or "pre" k_offset (of one parity) share the op's sites;
    # each call's scalars must reach its launches.
    from parallel_lora import kernels
    from parallel_lora._dropout import Dropout

    x, weight, lora_A, lora_B = torch.randn(40, 64), torch.randn(48, 64), torch.randn(8, 64), torch.randn(48, 8)
    seed = torch.tensor([5], dtype=torch.int64)

    def scalars(scale: float, q: float, k_offset: int) -> list:
        log.clear()
        drop = Dropout(q, seed, position, k_offset) if q else None
        y, s_lora = kernels.forward(x, weight, None, lora_A, lora_B, scale, drop)
        kernels.backward(torch.randn(40, 48), x, weight, lora_A, lora_B, s_lora, scale, drop)
        small = (float, bool, str, type(None))  # every argument but an address
        return [[a for a in args if isinstance(a, small) or isinstance(a, int) and abs(a) < 2**20] for _, args in log]

    real = program.Programs.run
    for call in ((2.5, p, 0), (2.5, p, 0), (0.75, p, 0), (2.5, p / 2, 0), (2.5, p, 64), (0.75, p, 0)):
        monkeypatch.setattr(program.Programs, "run", lambda self, call, operands, seed: call())
        want = scalars(*call)  # the launchers'
        monkeypatch.setattr(program.Programs, "run", real)
        assert scalars(*call) == want and scalars(*call) == want  # records (or replays), replays


@pytest.mark.parametrize("seed", [None, "tensor"])
def test_the_ops_calls_replay_from_cpp(log, seed, monkeypatch):
    # The compiled graph calls the ops themselves: replay.cpp's kernels for them replay each call's layouts and
    # scalars, and call the Python kernels only for a call they have no program of.
    from parallel_lora.kernels import ops, replay

    assert replay.module() is not None
    lora = torch.ops.parallel_lora
    x, weight, lora_A, lora_B = torch.randn(40, 64), torch.randn(48, 64), torch.randn(8, 64), torch.randn(48, 8)
    dy = torch.randn(40, 48)
    p, seed = (0.0, None) if seed is None else (0.1, torch.tensor([5], dtype=torch.int64))
    python = []
    for name in ("_forward", "_backward"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _n=name, _f=real: python.append(_n) or _f(*a))

    def calls(scale: float) -> tuple:
        y, s_lora = lora.lora_forward(x, weight, None, lora_A, lora_B, scale, p, seed, "post", 0)
        return y, s_lora, *lora.lora_backward(dy, x, weight, lora_A, lora_B, s_lora, scale, p, seed, "post", 0,
                                              True, True, True)  # fmt: skip

    calls(2.5)  # binds
    log.clear()
    outputs = _recorded_outputs(monkeypatch)
    called = calls(2.5)  # records
    first = list(log)
    log.clear()
    python.clear()
    replayed = calls(2.5)
    assert not python
    fresh = {}
    _same_up_to_fresh_addresses(log, first, fresh, outputs)
    for ours, theirs in zip(replayed, called, strict=True):
        assert ours.data_ptr() == fresh[theirs.data_ptr()] and ours.shape == theirs.shape
    counts = []
    for _ in range(3):  # another scale: its own programs, recorded at its first call (the sites are filled)
        python.clear()
        calls(0.75)
        counts.append(len(python))
    assert counts == [2, 0, 0]
    python.clear()
    calls(2.5)
    assert not python
    dispatch.clear_sites()  # the C++ kernels forget theirs too: the next call checks and binds again
    calls(2.5)
    assert python == ["_forward", "_backward"]


def test_a_replay_takes_the_new_seed_and_a_new_seed_kind_goes_back_to_the_launchers(log):
    layer = _layer(0.1, "post", False)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    dy = torch.randn(40, 48, dtype=torch.bfloat16)
    for seed in (7, 8):
        _step(layer, x, dy, seed)
    log.clear()
    _step(layer, x, dy, 12345)
    zero = host.ZERO_SEEDS[x.device].data_ptr()  # an int seed travels as (zero's address, salt)
    salts = [args[args.index(zero) + 1] for _, args in log if zero in args]
    assert len(salts) >= 2 and set(salts) == {12345}, log  # S's mask in the forward, G's in the backward
    log.clear()
    seed = torch.tensor([3], dtype=torch.int64)
    _step(layer, x, dy, seed)  # no program for a tensor seed: the launchers
    assert any(seed.data_ptr() in args for _, args in log)
    tensor_seeded = _layer(0.1, "post", False)
    seeds = [torch.tensor([s], dtype=torch.int64) for s in (1, 2, 3)]
    for seed in seeds:  # binds, records, replays
        log.clear()
        _step(tensor_seeded, x, dy, seed)
    used = [seed.data_ptr() in args for _, args in log for seed in seeds]
    assert not any(used[0::3]) and not any(used[1::3]) and sum(used[2::3]) >= 2, log


def test_an_unrecordable_call_keeps_the_launchers(log, monkeypatch):
    # An address that is neither an operand, a fresh output nor a workspace: no program, the launchers every time.
    layer = _layer(0.0, "pre", False)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    dy = torch.randn(40, 48, dtype=torch.bfloat16)
    monkeypatch.setattr(program, "holding", lambda address: None)
    calls = []
    real = dispatch.run_forward
    monkeypatch.setattr(dispatch, "run_forward", lambda *a: calls.append(1) or real(*a))
    for _ in range(4):
        _step(layer, x, dy, None)
    plan = next(iter(layer._plans.values()))
    assert list(plan.fwd_programs.by_stream.values()) == [False] and len(calls) == 4


def test_a_fresh_output_no_launch_wrote_is_not_replayed():
    # A fresh output written on the host (adapter_grads zeroes its outputs at M == 0) cannot come from a replay.
    notes = program.Notes()
    out = torch.zeros(4)
    notes.outputs.append(out)
    parts = launcher.CEntry(print, 0, (1, 1, 1), "fn", False, False, 0, 64, "meta", (), ())
    bound = launcher.Bound("k", type("Run", (), {"parts": parts, "__call__": lambda self, *a: None})())
    x = torch.zeros(3)
    notes.launches.append((bound, (x,), (1.0, 0.0, x, 0)))
    with pytest.raises(program.Unrecordable, match="no launch wrote"):
        program.build(notes, (x,), None, (out,), 0)


def test_no_program_under_the_interpreter():
    # The interpreter's launches have no C entry: a plan records once per stream, finds that and keeps the launchers.
    layer = _layer(0.0, "pre", False)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    for _ in range(3):
        layer(x)
    plan = next(iter(layer._plans.values()))
    assert plan.fwd_programs.by_stream == {0: False}
    assert isinstance(plan, functional.Plan)


def _launched(monkeypatch) -> list:
    """The names of the launcher functions (``run_forward`` / ``run_backward``) called from now on."""
    calls = []
    for name in ("run_forward", "run_backward"):
        real = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    return calls


def test_a_3d_input_replays_from_cpp_in_its_own_shape(log, monkeypatch):
    layer = _layer(0.0, "pre", False)
    x = torch.randn(2, 20, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2, 20, 48, dtype=torch.bfloat16)
    for _ in range(2):
        _step(layer, x, dy, None)
    launched = _launched(monkeypatch)
    y, dx, dA, dB = _step(layer, x, dy, None)
    assert y.grad_fn.name() == "LoRABackward" and not launched
    assert (y.shape, dx.shape, dA.shape, dB.shape) == ((2, 20, 48), (2, 20, 64), (8, 64), (48, 8))
    assert not y._is_view() and y.is_contiguous() and dx.is_contiguous()


def test_a_new_dy_layout_is_recorded_then_replayed_from_cpp(log, monkeypatch):
    layer = _layer(0.1, "post", False)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    dy = torch.randn(40, 96, dtype=torch.bfloat16)[:, :48]  # another stride than the recorded dy's
    for _ in range(2):
        _step(layer, x, dy.contiguous(), 5)
    launched = _launched(monkeypatch)
    for _ in range(3):  # binds, records and replays the new layout's backward; the forward replays throughout
        _step(layer, x, dy, 5)
    assert launched == ["run_backward", "run_backward"]
    plan = next(iter(layer._plans.values()))
    assert len(plan.bwd_entries) == 2 and all(all(kept[1].by_stream.values()) for kept in plan.bwd_entries.values())


@pytest.mark.parametrize("case", ["weight_grad", "no_grad", "subclass", "no_cpp"])
def test_calls_cpp_cannot_replay_go_through_lora_function(log, case, monkeypatch):
    # A trainable base weight, a tensor subclass, or no C++ half: LoRAFunction (its launches still replayed).
    if case == "no_cpp":
        monkeypatch.setattr(functional.replay, "module", lambda: None)
    layer = _layer(0.0, "pre", False)
    x = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)
    if case == "weight_grad":
        layer.weight.requires_grad_(True)
    for _ in range(2):
        layer(x)
    if case == "subclass":
        x = x.detach().as_subclass(type("Tagged", (torch.Tensor,), {})).requires_grad_(True)
    log.clear()
    if case == "no_grad":
        with torch.no_grad():
            y = layer(x)
        assert y.grad_fn is None and log  # replayed from C++, no node
        return
    y = layer(x)
    assert y.grad_fn.name() == "LoRAFunctionBackward" and log
    assert layer.weight.grad is None or case == "weight_grad"


def test_the_cpp_node_saves_through_saved_tensor_hooks_and_checks_versions(log):
    layer = _layer(0.0, "pre", False)
    x = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(40, 48, dtype=torch.bfloat16)
    for _ in range(2):
        _step(layer, x, dy, None)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = layer(x)
    assert y.grad_fn.name() == "LoRABackward" and len(packed) == 5  # x, W, A, B and S
    y.backward(dy)
    with pytest.raises(RuntimeError, match="second time"):
        y.backward(dy)
    z = layer(x.detach().clone().requires_grad_(True))
    with torch.no_grad():
        layer.lora_A.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward(dy)


@gpu
@needs_cuda
@pytest.mark.parametrize(("M", "K", "N"), [(512, 1024, 768), (300, 256, 130)])  # a fused forward, separate launches
@pytest.mark.parametrize(("dropout", "position"), [(0.0, "pre"), (0.1, "pre"), (0.1, "post")])
def test_gpu_a_replay_matches_the_launchers_bit_for_bit(M, K, N, dropout, position, monkeypatch):
    # The same call through the launchers, then replayed on the default stream and recorded and replayed on another.
    layer = _layer(dropout, position, True, K, N, "cuda")
    x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn(M, N, dtype=torch.bfloat16, device="cuda")
    real = program.Programs.run
    monkeypatch.setattr(program.Programs, "run", lambda self, call, operands, seed: call())
    want = _step(layer, x, dy, 4321)
    monkeypatch.setattr(program.Programs, "run", real)
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            for _ in range(3):  # binds (or finds its sites filled), records, replays
                got = _step(layer, x, dy, 4321)
                for a, b in zip(got, want, strict=True):
                    assert torch.equal(a, b)
            assert got[0].grad_fn.name() == "LoRABackward"  # replayed from C++ (replay.cpp)
        torch.cuda.synchronize()
    plan = next(iter(layer._plans.values()))
    programs = [plan.fwd_programs, *(kept[1] for kept in plan.bwd_entries.values())]
    assert all(len(p.by_stream) == 2 and all(isinstance(v, program.Program) for v in p.by_stream.values())
               for p in programs)  # fmt: skip
