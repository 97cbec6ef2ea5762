"""``lora_linear``'s dropout: on the LoRA branch only, ``"pre"`` or ``"post"`` the down-projection, one mask per
seed (a function of seed, row and column) shared by the forward, the backward and both backends; seeds as ints or
device tensors, drawn per call when not given. Last, capture in a CUDA graph: a host-side seed refuses it (a
replay would reuse one mask), and the fused step (no dropout) replays to the eager results bit for bit.

Reference: ``tests/_reference.lora_reference`` with the same ``Dropout``, or the dropped branch computed by hand from
``parallel_lora._dropout.keep_mask``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from parallel_lora._dropout import Dropout, check_seed, keep_mask, seed_tensor
from tests._functional import (  # noqa: F401  (_backend_device: an autouse fixture, used by being imported)
    BACKENDS,
    BF16,
    F32,
    FP32,
    SCALE,
    Case,
    K,
    M,
    R,
    _backend_device,
    assert_all_close,
    grads_of,
    make_inputs,
    needs_cuda,
    run_op,
    triton_device,
)
from tests._reference import assert_close, lora_reference

# ---------------------------------------------------------------------------------------------------------
# Dropout (on the LoRA branch only; the mask is a function of (seed, row, column)).
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_eval_mode_ignores_dropout(backend):
    inp = make_inputs(FP32)
    _, y_eval = run_op(FP32, inp, backend, dropout_p=0.5, training=False, dropout_seed=3)
    _, y_none = run_op(FP32, inp, backend)
    assert torch.equal(y_eval, y_none)


@pytest.mark.parametrize("position", ["pre", "post"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_with_zero_B_leaves_the_base_output_unchanged(backend, position):
    inp = make_inputs(FP32)
    with torch.no_grad():
        inp.lora_B.zero_()
    _, y_train = run_op(FP32, inp, backend, dropout_p=0.5, training=True, dropout_position=position)
    _, y_eval = run_op(FP32, inp, backend)
    assert torch.equal(y_train, y_eval)
    if backend == "torch":
        assert torch.equal(y_train, F.linear(inp.x_leaf, inp.weight, inp.bias))


@pytest.mark.parametrize("position", ["pre", "post"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_with_zero_base_is_the_dropped_lora_branch(backend, position):
    inp = make_inputs(FP32, bias=False)
    inp.weight.zero_()
    p, seed = 0.3, 1234
    kwargs = {"dropout_p": p, "training": True, "dropout_position": position, "dropout_seed": seed}
    _, y = run_op(FP32, inp, backend, **kwargs)
    x, a, b = (t.detach().double() for t in (inp.x_leaf, inp.lora_A, inp.lora_B))
    cols = K if position == "pre" else R
    keep = keep_mask(Dropout(p, seed_tensor(seed, x.device), position), M, cols, x.device).double() / (1 - p)
    if position == "pre":
        manual = SCALE * ((x * keep) @ a.t()) @ b.t()
    else:
        manual = SCALE * ((x @ a.t()) * keep) @ b.t()
    assert_close(y, manual, F32, "dropped LoRA branch")
    assert not torch.allclose(y.double(), SCALE * (x @ a.t()) @ b.t(), rtol=0.01), "no element was dropped"


@pytest.mark.parametrize("position", ["pre", "post"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_backward_use_the_same_mask(backend, position):
    inp = make_inputs(FP32)
    seed = 2**40 + 17  # above 2**32: exercises both key words
    x, y = run_op(FP32, inp, backend, dropout_p=0.25, training=True, dropout_position=position, dropout_seed=seed)
    drop = Dropout(p=0.25, seed=seed_tensor(seed, x.device), position=position)
    dy = torch.randn_like(y)
    grads = grads_of(y, x, inp, dy)
    ref = lora_reference(x, inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE, dy, dropout=drop)
    assert_all_close((y, *grads), ref, F32)
    # Not vacuous: another seed's mask is outside the tolerance.
    other = lora_reference(x, inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE, dy,
                           dropout=Dropout(drop.p, seed_tensor(seed + 1, x.device), position))  # fmt: skip
    with pytest.raises(AssertionError):
        assert_close(grads[1], other.dA, F32, "dA with another seed")


@pytest.mark.parametrize("position", ["pre", "post"])
def test_triton_drops_the_same_elements_as_torch(position):
    """With ``W = 0`` and ``A = B = I`` the output is ``s * drop(x) / (1-p)`` and the input gradient is
    ``s * drop(dy) / (1-p)`` (either position): their zeros are exactly the dropped elements."""
    size, p, seed = 16, 0.5, 99
    case = Case(F32, F32, F32, False)
    keep = keep_mask(Dropout(p, seed_tensor(seed, "cpu"), position), M, size, "cpu")
    zeros = {}
    for backend, device in (("torch", "cpu"), ("triton", triton_device())):
        with torch.device(device):
            inp = make_inputs(case, k=size, n=size, r=size, bias=False)
            with torch.no_grad():
                inp.weight.zero_()
                inp.lora_A.copy_(torch.eye(size))
                inp.lora_B.copy_(torch.eye(size))
            x, y = run_op(case, inp, backend, dropout_p=p, training=True, dropout_position=position,
                          dropout_seed=seed)  # fmt: skip
            (dx,) = torch.autograd.grad(y, x, torch.randn_like(y))
        zeros[backend] = ((y == 0).cpu(), (dx == 0).cpu())
        y_zero, dx_zero = zeros[backend]
        assert torch.equal(y_zero, ~keep) and torch.equal(dx_zero, ~keep), f"{backend} dropped other elements"
    for torch_zero, triton_zero in zip(zeros["torch"], zeros["triton"], strict=True):
        assert torch.equal(torch_zero, triton_zero)
    assert 0.3 < keep.float().mean().item() < 0.7  # the mask is not all-keep or all-drop


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_int_seed_and_its_tensor_draw_one_mask(backend):
    # The kernels take an int as a scalar and a tensor from memory; the torch backend hashes either: one 64-bit
    # seed, one mask, forward and backward.
    inp = make_inputs(FP32)
    seed, kwargs = -(2**63) + 5, {"dropout_p": 0.3, "training": True}
    seed_t = seed_tensor(seed, inp.x_leaf.device)
    assert seed_t.tolist() == [seed] and seed_tensor(2**63 + 5, "cpu").tolist() == [seed]  # mod 2**64
    dy = None
    runs = []
    for given in (seed, seed_t, seed + 1):
        x, y = run_op(FP32, inp, backend, dropout_seed=given, **kwargs)
        dy = torch.randn_like(y) if dy is None else dy
        runs.append((y, *grads_of(y, x, inp, dy)))
    for got, want in zip(runs[1], runs[0], strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(runs[2][0], runs[0][0])


class _SeedSizedTensors(TorchDispatchMode):
    """Records the ops that make a ``[1]`` int64 tensor (not in place: the interpreter writes its arguments back)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        made = isinstance(out, torch.Tensor) and out.dtype == torch.int64 and out.shape == (1,)
        if made and not func._schema.is_mutable:
            self.ops.append(func.__name__)
        return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_int_seed_goes_to_the_kernels_with_no_tensor_made_per_call(backend):
    inp = make_inputs(FP32)
    kwargs = {"dropout_p": 0.3, "training": True, "dropout_seed": 2**40 + 3}
    run_op(FP32, inp, backend, **kwargs)  # the kernels' first int on this device makes its zero seed tensor
    with _SeedSizedTensors() as made:
        x, y = run_op(FP32, inp, backend, **kwargs)
        grads_of(y, x, inp, torch.ones_like(y))
    assert made.ops == []
    with _SeedSizedTensors() as made:  # not vacuous: a tensor made from an int is seen
        seed_tensor(2**40 + 3, inp.x_leaf.device)
    assert made.ops


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_seed_draws_one_on_the_device_per_call_reproducibly(backend):
    inp = make_inputs(FP32)
    kwargs = {"dropout_p": 0.3, "training": True}
    torch.manual_seed(1)
    first, second = (run_op(FP32, inp, backend, **kwargs)[1] for _ in range(2))
    torch.manual_seed(1)
    assert torch.equal(run_op(FP32, inp, backend, **kwargs)[1], first)
    assert not torch.equal(first, second)


# ---------------------------------------------------------------------------------------------------------
# CUDA graphs: a host-side seed refuses capture; the fused step replays bit for bit.
# ---------------------------------------------------------------------------------------------------------


def test_a_host_side_seed_refuses_cuda_graph_capture(monkeypatch):
    # A captured int would be replayed as it was, one mask forever. A seed tensor drawn on the device replays
    # fresh (tests/test_compile.py).
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        check_seed(3, torch.device("cuda", 0))
    assert check_seed(3, torch.device("cpu")) == 3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [2048, 8192])
def test_gpu_forward_backward_replays_from_a_cuda_graph_bit_for_bit(tokens):
    # Short sequences are host-bound; a user captures the step in a CUDA graph. The fused kernels (bound
    # launches, per-stream workspaces, in-kernel counters left at zero) must replay to the eager results. From
    # 8192 tokens the backward takes dB's partials from G's launch (kernels/shrink_db.py): more workspaces.
    from parallel_lora import LoRAConfig, LoRALinear

    torch.manual_seed(0)
    cfg = LoRAConfig(r=16, alpha=32, lora_dtype=F32)
    layer = LoRALinear(1024, 768, cfg, dtype=BF16, device="cuda")
    torch.nn.init.normal_(layer.lora_B.weight, std=0.02)
    params = [layer.lora_A.weight, layer.lora_B.weight]
    x = torch.randn(tokens, 1024, device="cuda", dtype=BF16, requires_grad=True)
    dy = torch.randn(tokens, 768, device="cuda", dtype=BF16)

    def step():
        y = layer(x)
        return (y.detach(), *torch.autograd.grad(y, [x, *params], dy))

    # Warm-up and capture on one stream, so the graph uses that stream's workspaces as they were.
    capture_stream = torch.cuda.Stream()
    capture_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture_stream):
        for _ in range(2):
            step()  # tune, compile and bind before capture
    torch.cuda.current_stream().wait_stream(capture_stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream):
        captured = step()
    for scale in (1.0, -0.5):
        with torch.no_grad():
            x.mul_(scale)
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for name, a, b in zip(("y", "dx", "dA", "dB"), captured, eager, strict=True):
            assert torch.equal(a, b), name
    # A larger layer called eagerly on the capture's own stream grows that stream's workspaces (the adapter
    # gradients' arrival counters and partial sums, dB's partials); the graph keeps the ones it captured, which
    # must stay allocated: small tensors allocated next would otherwise take their memory and be overwritten by
    # replays.
    wide = LoRALinear(4096, 4096, cfg, dtype=BF16, device="cuda")
    longer = torch.randn(8192, 4096, device="cuda", dtype=BF16, requires_grad=True)
    with torch.cuda.stream(capture_stream):
        y_long = wide(longer)
        torch.autograd.grad(y_long, [longer, wide.lora_A.weight, wide.lora_B.weight], torch.randn_like(y_long))
        filler = [torch.full((n,), 7, device="cuda", dtype=torch.int32) for n in (1 << 10, 1 << 12, 1 << 14) * 16]
    torch.cuda.current_stream().wait_stream(capture_stream)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for name, a, b in zip(("y", "dx", "dA", "dB"), captured, eager, strict=True):
        assert torch.equal(a, b), f"{name} after the workspaces grew"
    assert all(bool((f == 7).all()) for f in filler), "a replay wrote into memory the workspaces had freed"
