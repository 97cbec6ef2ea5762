"""The launch cache (``parallel_lora.kernels.launcher``) and the op's per-layout launch sites (``dispatch``).

A signature's first launch binds its compiled kernel, grid and size/stride arguments (``launcher.bind``, the one
seam these tests stub); an op layout's first call fills one site per launch, and later calls launch the bound
kernels without the launchers' signatures or the checks. Reference: the first call's results, bit for bit, and
the eager oracle.
"""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest
import torch

from parallel_lora import kernels
from parallel_lora._dropout import Dropout
from parallel_lora.kernels import dispatch, launcher, workspace
from parallel_lora.kernels.spec import KernelSpec
from tests._kernels import (
    DROPOUTS,
    LAUNCH_NAMES,
    SCALE,
    assert_matches,
    make_inputs,
    patch_bind,
    reference,
)


def test_launcher_specs_name_every_kernel():
    # Every kernel file launches through ``launcher.launch``, whose first launches go through ``launcher.bind``:
    # stubbing bind (the tests below, tools/compile_hopper.py) reaches every kernel. A kernel file with a spec of
    # its own must be among LAUNCH_NAMES, which those tests expect to see launched.
    specs = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"parallel_lora.kernels.{info.name}")
        spec = getattr(module, "SPEC", None)
        if spec is not None:
            assert isinstance(spec, KernelSpec), module.__name__
            specs[spec.name] = module
            assert not hasattr(module, "bind"), f"{module.__name__} binds its kernel itself"
    assert set(specs) == set(LAUNCH_NAMES)


def _layouts(M, K, N, r, dtype, bias):
    """One problem under several operand layouts: transposed storage (of all, of the adapters, of dy alone), and
    rows shifted off 16-byte alignment."""
    x, weight, b, lora_A, lora_B, dy = make_inputs(M, K, N, r, dtype, bias=bias)

    def shifted(t):  # same values, storage one element further on: its address is no longer 16-byte aligned
        return torch.cat([t.new_zeros(1), t.flatten()])[1:].view_as(t)

    return b, [
        (x, weight, lora_A, lora_B, dy),
        (x.t().contiguous().t(), weight.t().contiguous().t(), lora_A, lora_B, dy.t().contiguous().t()),
        (x, weight, lora_A.t().contiguous().t(), lora_B.t().contiguous().t(), dy),
        (x, weight, lora_A, lora_B, dy.t().contiguous().t()),
        (shifted(x), weight, lora_A, lora_B, shifted(dy)),
    ]


def test_launcher_signature_fixes_every_argument_but_addresses_and_runtime_scalars(monkeypatch):
    # On GPU a signature's first launch binds its compiled kernel, grid and size/stride arguments, and every
    # later launch with an equal signature reuses them: two calls whose signatures match but whose build()
    # differs would silently run with another call's strides. Record both over many operand layouts.
    seen: dict[tuple, tuple] = {}

    def record(spec, kernel, signature, tensors, runtime, build):
        static, grid, consts = build()
        meta = {**consts, **spec.interp}
        aligned = tuple(t.data_ptr() % 16 == 0 for t in tensors)
        launch = (static, grid(meta), tuple(sorted(consts.items())), tuple(t.dtype for t in tensors))
        assert seen.setdefault((spec.name, signature, aligned), launch) == launch, (spec.name, signature)

    patch_bind(monkeypatch, record)
    for M, K, N, r in [(40, 48, 56, 8), (41, 48, 56, 8), (40, 56, 48, 8), (40, 48, 56, 16), (1, 48, 56, 8)]:
        for dtype in (torch.float32, torch.bfloat16):
            for bias in (True, False):
                b, layouts = _layouts(M, K, N, r, dtype, bias)
                for xi, wi, ai, bi, dyi in layouts:
                    for drop in DROPOUTS.values():
                        _, s_lora = kernels.forward(xi, wi, b, ai, bi, SCALE, drop)
                        for needs in ((True, True, True), (False, True, True), (True, False, False)):
                            kernels.backward(dyi, xi, wi, ai, bi, s_lora, SCALE, drop, *needs)
    assert {name for name, *_ in seen} == set(LAUNCH_NAMES)
    assert len(seen) > 100


def test_dispatch_layout_fixes_the_signature_of_every_launch(monkeypatch):
    # kernels.forward / backward bind their launch sites to the op's key (every operand's layout, the dropout
    # position, the wanted grads) and skip the wrappers' own signatures at later calls: two calls with equal
    # keys whose wrappers would launch differently would run one with the other's strides. Record, per key,
    # what the wrappers launch with the sites always empty.
    launched: list[tuple] = []

    def record(spec, kernel, signature, tensors, runtime, build):
        launched.append((spec.name, signature, tuple(t.data_ptr() % 16 == 0 for t in tensors), build()[0]))

    patch_bind(monkeypatch, record)
    seen: dict[tuple, list] = {}

    def check(key, op, *args):
        dispatch.clear_sites()
        launched.clear()
        out = op(*args)
        assert seen.setdefault(key, list(launched)) == launched, key
        return out

    for M, K, N, r in [(40, 48, 56, 8), (41, 48, 56, 8), (40, 56, 48, 16), (1, 48, 56, 8)]:
        for dtype in (torch.float32, torch.bfloat16):
            for bias in (True, False):
                b, layouts = _layouts(M, K, N, r, dtype, bias)
                for x, weight, lora_A, lora_B, dy in layouts:
                    for drop in DROPOUTS.values():
                        mode = None if drop is None else drop.position
                        mask = dispatch.mask_key(mode, 0 if drop is None else drop.k_offset)
                        key = dispatch.forward_key(x, weight, b, lora_A, lora_B, mask)
                        _, s_lora = check(key, kernels.forward, x, weight, b, lora_A, lora_B, SCALE, drop)
                        for needs in ((True, True, True), (False, True, True), (True, False, False)):
                            key = dispatch.backward_key(dy, x, weight, lora_A, lora_B, s_lora, mask, *needs)
                            check(key, kernels.backward, dy, x, weight, lora_A, lora_B, s_lora, SCALE, drop, *needs)
    names = {name for launches in seen.values() for name, *_ in launches}
    assert names == set(LAUNCH_NAMES)
    assert len(seen) > 100


@pytest.mark.slow
def test_dispatch_bound_sites_give_the_first_calls_results_bit_for_bit(monkeypatch):
    # The second call of a layout launches the kernels bound at its first call (no wrapper signature, no
    # checks); it must compute exactly what the first did, with new values in the same layout, and a new
    # layout must not reuse another's sites.
    dispatch.clear_sites()
    slow = []
    real = launcher.bind

    def spy(*args):
        slow.append(args[0].name)
        return real(*args)

    patch_bind(monkeypatch, spy)
    for dtype in (torch.float32, torch.bfloat16):
        b, layouts = _layouts(37, 48, 40, 8, dtype, bias=True)
        for x, weight, lora_A, lora_B, dy in layouts:
            for drop in DROPOUTS.values():
                first = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, drop)
                first_bwd = kernels.backward(dy, x, weight, lora_A, lora_B, first[1], SCALE, drop)
                slow.clear()
                again = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, drop)
                again_bwd = kernels.backward(dy, x, weight, lora_A, lora_B, again[1], SCALE, drop)
                assert slow == [], "a layout seen before went through the launchers' first-launch path"
                for a, c in zip((*first, *first_bwd), (*again, *again_bwd), strict=True):
                    assert torch.equal(a, c)
                # New values, same layout: bound sites, results of the new values.
                with torch.no_grad():
                    x.mul_(0.5)
                y, _ = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, drop)
                ref = reference(x, weight, b, lora_A, lora_B, dy, SCALE, drop)
                mag = reference(x, weight, b, lora_A, lora_B, dy, SCALE, drop, absolute=True)
                assert_matches("y", y, ref[0], mag[0], dtype)
                with torch.no_grad():
                    x.mul_(2.0)


def test_dispatch_bound_forward_still_checks_scale_and_dropout():
    x, weight, b, lora_A, lora_B, _ = make_inputs(8, 16, 8, 4, torch.bfloat16)
    kernels.forward(x, weight, b, lora_A, lora_B, SCALE, None)
    with pytest.raises(ValueError, match="scale must be a finite float"):
        kernels.forward(x, weight, b, lora_A, lora_B, float("nan"), None)
    with pytest.raises(ValueError, match="dropout must be a parallel_lora._dropout.Dropout"):
        kernels.forward(x, weight, b, lora_A, lora_B, SCALE, 0.1)
    with pytest.raises(ValueError, match="a dropout seed must be an int or a 1-element int64 tensor"):
        Dropout(p=0.1, seed=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="x must be a 2-D tensor"):
        kernels.forward(None, weight, b, lora_A, lora_B, SCALE, None)


def test_dispatch_bound_backward_still_checks_scale_and_dropout():
    # The backward checks its operands at a layout's first call only (autograd hands it the checked forward's
    # tensors); scale and dropout are not part of the layout and are checked at every call.
    x, weight, b, lora_A, lora_B, dy = make_inputs(8, 16, 8, 4, torch.bfloat16)
    _, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, None)
    kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, None)
    with pytest.raises(ValueError, match="scale must be a finite float"):
        kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, float("inf"), None)
    with pytest.raises(ValueError, match="dropout must be a parallel_lora._dropout.Dropout"):
        kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, 0.1)
    with pytest.raises(ValueError, match="dy must have shape"):  # another layout: checked at its first call
        kernels.backward(dy[:, :5], x, weight, lora_A, lora_B, s_lora, SCALE, None)


def test_descriptor_launches_use_the_shared_workspace_whatever_allocator_is_set(monkeypatch):
    # Inductor's launcher sets Triton's allocator to its own (a fresh tensor per launch). Our launches must still
    # get the per-stream workspace, and leave the caller's allocator in place, also when the launch raises.
    import triton
    from triton.runtime._allocation import _allocator

    from parallel_lora.kernels import workspace

    scratch = torch.empty(8, dtype=torch.int8)
    monkeypatch.setattr(workspace, "descriptor_scratch", lambda size, alignment, stream: scratch)
    foreign = lambda size, alignment, stream: torch.empty(size, dtype=torch.int8)  # noqa: E731
    got = []

    def launch(fail: bool) -> None:
        got.append(_allocator.get()(8, 128, None))  # what Triton asks for at a launch with descriptors
        if fail:
            raise RuntimeError("launch failed")

    run = workspace.with_descriptor_scratch(launch)
    before = _allocator.get()
    try:
        triton.set_allocator(foreign)
        run(False)
        with pytest.raises(RuntimeError, match="launch failed"):
            run(True)
        assert [t is scratch for t in got] == [True, True] and _allocator.get() is foreign
    finally:
        triton.set_allocator(before)


class _Launcher36:
    """A launcher shaped as Triton 3.6's ``CudaLauncher``: its ``launch`` records what it is called with."""

    num_ctas, global_scratch_size, global_scratch_align, profile_scratch_size = 1, 128, 64, 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self):
        self.calls = []
        self.launch = lambda *args: self.calls.append(args)

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        raise AssertionError("the Python half of the launcher ran")


def _compiled(run) -> object:
    members = {"run": run, "function": "fn", "packed_metadata": "meta", "_init_handles": lambda self: None}
    return type("Compiled", (), members)()


@pytest.mark.parametrize("version", ["3.6.0", "3.8.0"])
def test_bound_launch_under_triton_36_calls_its_c_entry_with_the_stream_workspace(version, monkeypatch):
    # Below Triton 3.6's Python launcher: the C entry gets grid, stream, launch flags, the descriptor scratch of the
    # whole grid from the per-stream workspace, no profile scratch, then Triton's metadata and hooks and the args.
    # Another Triton keeps its own launcher, behind the scratch wrapper. Runtime scalars come as every launcher
    # passes them, (c, p, seed tensor, salt, *ints).
    run, scratch, asked, stream = _Launcher36(), torch.empty(8, dtype=torch.int8), [], [77]
    monkeypatch.setattr(launcher.triton, "__version__", version)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: stream[0], raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launcher, "descriptor_scratch", lambda *a: asked.append(a) or scratch)
    x, y, seed = torch.zeros(4), torch.zeros(2), torch.zeros(1, dtype=torch.int64)
    first, second = (2.5, 0.1, seed, 9, 0), (3.5, 0.2, x, 7, 1)
    direct = launcher.direct_launch(_compiled(run), (3, 2, 1), True, ("static",), ("tail",))
    if version == "3.8.0":
        assert launcher.c_launch(run) is None and direct.__name__ == "go"
        return
    direct((x, y), first)
    direct((y, x), second)  # the same stream: its scratch is asked for once
    assert asked == [(3 * 2 * 128, 64, 77)]
    head = (3, 2, 1, 77, "fn", False, True, scratch.data_ptr(), None, "meta", None, None, None)
    # tensors as their addresses: the scratch, the tensors and the runtime scalars alike
    xp, yp, sp = x.data_ptr(), y.data_ptr(), seed.data_ptr()
    want = [(*head, xp, yp, "static", 2.5, 0.1, sp, 9, 0, "tail"),
            (*head, yp, xp, "static", 3.5, 0.2, xp, 7, 1, "tail")]  # fmt: skip
    assert run.calls == want
    assert all(type(a) is not torch.Tensor for call in run.calls for a in call)
    stream[0] = 78  # another stream: its own scratch
    direct((x,), first)
    assert asked[1:] == [(3 * 2 * 128, 64, 78)] and run.calls[-1][3] == 78
    run.profile_scratch_size = 16  # a profiler's scratch: Triton's own path
    assert launcher.c_launch(run) is None


@pytest.mark.parametrize("runtime", [(2.5, 0.1, 9, 0), (2.5, "seed", 0.1, 9), (2.5, 0.1, "seed", 9, "x"), (2.5,)])
def test_bind_refuses_a_runtime_not_laid_out_as_every_launchers(runtime):
    # A bound launch takes the address at index 2 alone: bind refuses any other layout before building anything.
    seed = torch.zeros(1, dtype=torch.int64)
    runtime = tuple(seed if a == "seed" else torch.zeros(2) if a == "x" else a for a in runtime)
    with pytest.raises(TypeError, match=r"runtime must be \(c, p, seed tensor, salt, \*ints\)"):
        launcher.bind(None, None, (), (), runtime, lambda: pytest.fail("built"))


def test_site_buffers_are_kept_per_stream(monkeypatch):
    # A site makes its workspaces once per stream; without a site every call makes them.
    stream, made = [5], []
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: stream[0], raising=False)
    device = types.SimpleNamespace(type="cuda", index=0)

    def make(n):
        made.append(n)
        return ("buffers", n, stream[0])

    site = launcher.Site()
    assert launcher.site_buffers(site, device, make, 1) == ("buffers", 1, 5)
    assert launcher.site_buffers(site, device, make, 1) == ("buffers", 1, 5) and made == [1]
    stream[0] = 6
    assert launcher.site_buffers(site, device, make, 1) == ("buffers", 1, 6) and made == [1, 1]
    launcher.site_buffers(None, device, make, 2)
    launcher.site_buffers(None, device, make, 2)
    assert made == [1, 1, 2, 2]


def test_dispatch_bound_sites_look_up_no_workspace(monkeypatch):
    # After a layout's first calls, its launches reuse their sites' workspaces: no lookup, the same results.
    x, weight, b, lora_A, lora_B, dy = make_inputs(40, 48, 56, 8, torch.float32, bias=True)
    dispatch.clear_sites()
    looked, grown = [], workspace.grown
    monkeypatch.setattr(workspace, "grown", lambda *args: looked.append(args[1]) or grown(*args))

    def calls():
        y, s_lora = kernels.forward(x, weight, b, lora_A, lora_B, SCALE, None)
        return (y, s_lora, *kernels.backward(dy, x, weight, lora_A, lora_B, s_lora, SCALE, None))

    first = calls()
    assert looked, "the first calls make their workspaces"
    looked.clear()
    again = calls()
    assert looked == []
    for a, b_ in zip(first, again, strict=True):
        assert torch.equal(a, b_)
