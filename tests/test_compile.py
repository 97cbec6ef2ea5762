"""The layers under ``torch.compile(fullgraph=True)`` and in CUDA graphs (``parallel_lora.kernels.ops``, the dropout
seeds of ``parallel_lora._dropout``, the functional collectives of ``parallel_lora.tp._comm``).

Reference: the same module run eagerly (a deep copy), from the same generator state. ``aot_eager`` runs the very
ops the eager path runs, and Inductor on the CPU computes this small ReLU model's ops exactly, so there the compiled
step equals the eager one bit for bit; Inductor on a GPU fuses the block's norms and residuals, so the GPU block
compares within bf16 rounding. Every test drops with p > 0 and checks that the masks change from step to step: a
compiled step that drew other seeds than the eager one, or reused one, would be far outside any tolerance.

The tensor-parallel MLP runs on two gloo ranks (``tests/_dist.py``). Its compiled collectives are counted in the
forward and backward graphs AOTAutograd hands the backend (``CommDebugMode`` cannot wrap a compiled call) and
compared with ``CommDebugMode``'s counts of the eager step.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.debugging import aot_eager, boxed_nop
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils.checkpoint import checkpoint

import parallel_lora.tp._comm as comm
from parallel_lora import ColumnParallelLoRALinear, LoRAConfig, LoRALinear, RowParallelLoRALinear, lora_linear, no_sync
from tests import _dist
from tests._seeds import given_seeds, recording_seeds

F32, BF16 = torch.float32, torch.bfloat16
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _mlp(backend: str, device: str = "cpu") -> nn.Sequential:
    """LoRALinears with "pre" dropout, none, and "post" dropout (p = 0.1), random B (B = 0 would hide dB)."""
    configs = [
        LoRAConfig(r=4, alpha=8, dropout=0.1, backend=backend),
        LoRAConfig(r=4, alpha=8, backend=backend),
        LoRAConfig(r=4, alpha=8, dropout=0.1, dropout_position="post", backend=backend),
    ]
    with torch.device(device):
        model = nn.Sequential(
            LoRALinear(16, 32, configs[0]), nn.ReLU(), LoRALinear(32, 24, configs[1]), nn.ReLU(),
            LoRALinear(24, 16, configs[2]),
        ).train()  # fmt: skip
    for layer in model[::2]:
        nn.init.normal_(layer.lora_B.weight)
    return model


def _step(model: nn.Module, x: torch.Tensor, run=None) -> list[torch.Tensor]:
    """The output of ``run`` (default: ``model``), then the gradients of x and of ``model``'s trainable
    parameters, for a fixed upstream gradient."""
    x = x.detach().requires_grad_(True)
    y = (run or model)(x)
    params = [p for p in model.parameters() if p.requires_grad]
    dy = torch.linspace(-1, 1, y.numel(), device=y.device).reshape(y.shape)
    return [y.detach(), *torch.autograd.grad(y, [x, *params], dy)]


def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[1], device)


def _steps_as_eager(model: nn.Module, compiled: nn.Module, x: torch.Tensor, steps: int, run=None) -> list:
    """``steps`` pairs ``(model's eager step, compiled's step through run)``, each pair from one generator state
    (its dropout seeds)."""
    pairs = []
    for _ in range(steps):
        state = _rng_state(x.device)
        want = _step(model, x)
        _set_rng_state(state, x.device)
        pairs.append((want, _step(compiled, x, run)))
    return pairs


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "triton"])  # triton: the interpreter, through the registered op
def test_compiled_lora_mlp_traces_whole_and_matches_eager(backend):
    model = _mlp(backend)
    x = torch.randn(12, 16)
    explained = torch._dynamo.explain(copy.deepcopy(model))(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(copy.deepcopy(model), fullgraph=True, backend="aot_eager")
    pairs = _steps_as_eager(model, compiled, x, steps=2)
    for step, (want, got) in enumerate(pairs):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(g, w), f"step {step}: output/grad {i} differs from eager"
    assert not torch.equal(pairs[0][0][0], pairs[1][0][0]), "the second step reused the first step's masks"


@pytest.mark.slow
@pytest.mark.parametrize(
    "device,backend,compiler",
    [
        ("cpu", "torch", "aot_eager"),  # Inductor's C++ build of the eager masks' kernels takes a minute here
        ("cpu", "triton", "inductor"),  # Triton's interpreter, behind the registered op
        pytest.param("cuda", "auto", "inductor", marks=[pytest.mark.gpu, needs_cuda]),
    ],
)
def test_compiled_checkpoint_reruns_the_forward_seeds(device, backend, compiler):
    # The compiled checkpointed region is recomputed in backward. The seed draw is a random op to AOTAutograd,
    # which replays it there under the forward's generator state: the recompute draws the forward's seeds, and
    # the step equals an eager step under them. On the CPU those are the eager path's own seeds (the default
    # generator's); on CUDA AOTAutograd's graph-safe replay draws from generators of its own, seeded from the CPU
    # generator at the first call, as it does for every random op it recomputes.
    model = _mlp(backend, device)
    x = torch.randn(12, 16, device=device)
    drawn = []
    with recording_seeds() as seeds:
        compiled = torch.compile(lambda x: checkpoint(model, x, use_reentrant=False), fullgraph=True, backend=compiler)
        for step in range(2):
            state = _rng_state(x.device)
            seeds.clear()
            got = _step(model, x, run=compiled)
            forward = [seed for in_backward, seed in seeds if not in_backward]
            fwd, rerun = [int(s) for s in forward], [int(seed) for in_backward, seed in seeds if in_backward]
            assert len(set(fwd)) == 2, f"step {step}: the two dropout layers drew {fwd}"
            assert sorted(rerun) == sorted(fwd), f"step {step}: the recompute drew {rerun}, the forward {fwd}"
            with given_seeds(model[::2], forward):
                want = _step(model, x)
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                assert torch.equal(g, w), f"step {step}: output/grad {i} differs from eager under the same seeds"
            if device == "cpu":
                _set_rng_state(state, x.device)
                eager = _step(model, x)
                assert all(torch.equal(g, w) for g, w in zip(got, eager, strict=True)), f"step {step}: not eager's"
            drawn.append(fwd)
    assert not set(drawn[0]) & set(drawn[1]), "the second step reused the first step's seeds"


def test_registered_ops_pass_opcheck():
    # Schema, fake implementations (shapes and dtypes under symbolic sizes) and AOT dispatch of the fused op, on
    # the interpreter; a gradient not asked for comes back as an empty tensor.
    x, w, b = torch.randn(8, 16), torch.randn(12, 16), torch.randn(12)
    a, bb, dy, s = torch.randn(4, 16), torch.randn(12, 4), torch.randn(8, 12), torch.randn(8, 4)
    seed = torch.tensor([7])
    forward, backward = torch.ops.parallel_lora.lora_forward.default, torch.ops.parallel_lora.lora_backward.default
    torch.library.opcheck(forward, (x, w, b, a, bb, 2.0, 0.0, None, "pre", 0))
    torch.library.opcheck(forward, (x, w, None, a, bb, 2.0, 0.25, seed, "pre", 3))
    torch.library.opcheck(backward, (dy, x, w, a, bb, s, 2.0, 0.25, seed, "post", 0, True, True, True))
    torch.library.opcheck(backward, (dy, x, w, a, bb, s, 2.0, 0.0, None, "pre", 0, False, True, False))
    dx, da, db = backward(dy, x, w, a, bb, s, 2.0, 0.0, None, "pre", 0, False, True, False)
    assert dx.shape == (0,) and da.shape == a.shape and db.shape == (0,)
    # The sequence-parallel column layer's backward re-gathers a copy of x that waits for the incoming gradient.
    torch.library.opcheck(torch.ops.parallel_lora.after_grad.default, (x, dy))
    assert torch.equal(torch.ops.parallel_lora.after_grad(x, dy), x)


def test_the_ops_refuse_a_call_autograd_would_record():
    # No autograd formula: a direct call on tensors that require grad, in grad mode, would lose their gradients.
    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(12, 16)
    a, b = torch.randn(4, 16), torch.randn(12, 4)
    with pytest.raises(RuntimeError, match=r"lora_forward has no autograd formula: call it with grad mode off"):
        torch.ops.parallel_lora.lora_forward(x, w, None, a, b, 2.0, 0.0, None, "pre", 0)
    with torch.no_grad():
        y, s = torch.ops.parallel_lora.lora_forward(x, w, None, a, b, 2.0, 0.0, None, "pre", 0)
    assert y.shape == (8, 12) and s.shape == (8, 4)


def test_the_seed_op_is_one_int64_on_its_inputs_device():
    with FakeTensorMode():
        seed = torch.ops.parallel_lora.dropout_seed(torch.empty(3, 5, device="meta"))
    assert seed.shape == (1,) and seed.dtype == torch.int64 and seed.device.type == "meta"


@pytest.mark.gpu
@needs_cuda
def test_gpu_the_seed_op_does_not_synchronize():
    # Outside graph capture the compiled op hands the eager call's int over: filled on the device, since a copy from
    # pageable host memory would stall the host at every compiled call with dropout.
    like = torch.empty(2, device="cuda")
    torch.ops.parallel_lora.dropout_seed(like)  # the generator and the allocator warmed
    torch.cuda.set_sync_debug_mode("error")
    try:
        seed = torch.ops.parallel_lora.dropout_seed(like)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert seed.device.type == "cuda" and seed.shape == (1,) and seed.dtype == torch.int64


# ---------------------------------------------------------------------------------------------------------
# Tensor parallel: a column -> row LoRA MLP at tp = 2 (gloo).
# ---------------------------------------------------------------------------------------------------------


class _GraphCollectives:
    """An ``aot_eager`` backend that records, per graph it compiles, the collectives in it: ``(op, rank of the
    tensor)`` (adapter gradients are 2-D, the MLP's activations 3-D)."""

    def __init__(self) -> None:
        self.graphs: list[tuple[str, Counter]] = []  # ("forward" | "backward", Counter of (op, ndim))

    def _counting(self, phase: str):
        def compiler(gm: torch.fx.GraphModule, example_inputs):
            found = Counter()
            for node in gm.graph.nodes:
                if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                    name = _dist.collective_name(node.target.namespace, node.target._opname)
                    if name is not None:
                        found[name, node.args[0].meta["val"].dim()] += 1
            self.graphs.append((phase, found))
            return boxed_nop(gm, example_inputs)

        return compiler

    def __call__(self, gm, example_inputs):
        return aot_eager(gm, example_inputs, fw_compiler=self._counting("forward"),
                         bw_compiler=self._counting("backward"))  # fmt: skip

    def ops(self, index: int) -> dict[str, int]:
        """Collectives of graph ``index`` by op, whatever their tensors."""
        counts = Counter()
        for (name, _), n in self.graphs[index][1].items():
            counts[name] += n
        return dict(counts)


def _eager_ops(mode: CommDebugMode) -> dict[str, int]:
    """``CommDebugMode``'s counts under the collectives' functional names (in-place c10d all-reduces included)."""
    counts: Counter = Counter()
    for op, n in mode.get_comm_counts().items():
        name = str(op).rsplit(".", 1)[-1]
        counts[_dist.C10D_NAMES.get(name, name)] += n
    return {name: n for name, n in counts.items() if n}


def _tp_mlp(sp: bool, p: float) -> nn.Sequential:
    """``row(gelu(column(x)))`` with bias, r = 3, random B, "pre" dropout on the column, "post" on the row."""
    mesh = _dist.mesh()
    torch.manual_seed(1234)
    col = ColumnParallelLoRALinear(16, 24, LoRAConfig(r=3, alpha=6, dropout=p), mesh, bias=True, sequence_parallel=sp)
    row_config = LoRAConfig(r=3, alpha=6, dropout=p, dropout_position="post")
    row = RowParallelLoRALinear(24, 16, row_config, mesh, bias=True, sequence_parallel=sp)
    with torch.no_grad():
        for layer in (col, row):
            layer.lora_B.weight.to_local().normal_()
    return nn.Sequential(col, nn.GELU(), row).train()


def _tp_step(model: nn.Module, x: torch.Tensor, run=None) -> list[torch.Tensor]:
    """Output, x's gradient and every adapter's local gradient (a DTensor's, checked to keep its placements)."""
    x = x.detach().requires_grad_(True)
    y = (run or model)(x)
    params = [p for p in model.parameters() if p.requires_grad]
    dy = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
    grads = torch.autograd.grad(y, [x, *params], dy)
    for g, p in zip(grads[1:], params, strict=True):
        assert g.placements == p.placements, f"a gradient placed {g.placements}, its parameter {p.placements}"
    return [y.detach(), grads[0], *(g.to_local() for g in grads[1:])]


def _compiled_tp_mlp_matches_eager(sp: bool, p: float) -> None:
    model = _tp_mlp(sp, p)
    x = torch.randn(2, 8 // (dist.get_world_size() if sp else 1), 16)
    explained = torch._dynamo.explain(copy.deepcopy(model))(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    graphs = _GraphCollectives()
    compiled = torch.compile(copy.deepcopy(model), fullgraph=True, backend=graphs)
    with torch.random.fork_rng():
        with CommDebugMode() as fwd:
            y = model(x.detach().requires_grad_(True))
        with CommDebugMode() as bwd:
            y.sum().backward()
    steps = []
    for _ in range(2):
        state = torch.get_rng_state()  # both draw the same dropout seeds
        want = _tp_step(model, x)
        torch.set_rng_state(state)
        steps.append((want, _tp_step(compiled, x)))
    for step, (want, got) in enumerate(steps):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(g, w), f"step {step}: output/grad {i} differs from eager"
    if p > 0:
        assert not torch.equal(steps[0][0][0], steps[1][0][0]), "the second step reused the first step's masks"
    assert [phase for phase, _ in graphs.graphs] == ["forward", "backward"], "one graph each way, no recompile"
    assert (graphs.ops(0), graphs.ops(1)) == (_eager_ops(fwd), _eager_ops(bwd)), "compiled vs eager collectives"
    # The check can fail: the eager step issues collectives in both directions (the row output, dx and dA/dB).
    assert _eager_ops(fwd) and _eager_ops(bwd)


@pytest.mark.slow
@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_compiled_tp_mlp_traces_whole_matches_eager_and_issues_its_collectives(sp, p):
    _dist.run_ranks(2, _compiled_tp_mlp_matches_eager, sp, p)


def _compiled_no_sync_matches_eager(micro_steps: int = 3) -> None:
    """Gradient accumulation with ``no_sync`` around compiled micro-steps gives the eager accumulation's gradients bit
    for bit, and reduces each replicated factor once per optimizer step: not in the deferred micro-steps' graphs,
    nor in the synced one's, but in the hook after it; a synced step without deferred ones reduces in its graph."""
    model = _tp_mlp(sp=False, p=0.1)
    graphs = _GraphCollectives()
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(compiled_model, fullgraph=True, backend=graphs)
    hooked = []
    reduce = comm.reduce_accumulated_grad
    comm.reduce_accumulated_grad = lambda param, group: hooked.append(param.dim()) or reduce(param, group)
    try:
        batches = [torch.randn(2, 8, 16) for _ in range(micro_steps + 1)]
        grads, state = [], torch.get_rng_state()
        for m, run in ((model, model), (compiled_model, compiled)):
            hooked.clear()
            torch.set_rng_state(state)  # both draw the same dropout seeds
            for i, x in enumerate(batches):
                deferred = i < micro_steps - 1
                if i == micro_steps:  # the next optimizer step's first micro-step, synced
                    grads.append([p.grad.to_local().clone() for p in m.parameters() if p.requires_grad])
                    m.zero_grad(set_to_none=True)
                with no_sync(m) if deferred else contextlib.nullcontext():
                    run(x).sum().backward()
            grads[-1] += [p.grad.to_local() for p in m.parameters() if p.requires_grad]
            assert hooked == [2, 2], f"the synced micro-step's hook reduced {hooked}, not each replicated factor once"
    finally:
        comm.reduce_accumulated_grad = reduce
    for i, (g, w) in enumerate(zip(grads[1], grads[0], strict=True)):
        assert torch.equal(g, w), f"adapter grad {i} of the compiled accumulation differs from eager"
    adapter_reductions = [sum(n for (name, ndim), n in found.items() if ndim == 2) for _, found in graphs.graphs]
    phases = [phase for phase, _ in graphs.graphs]
    # Graphs: deferred micro-steps, the synced step after them, then a synced step after a synced one.
    assert phases == ["forward", "backward"] * 3, phases
    assert adapter_reductions == [0, 0, 0, 0, 0, 2], adapter_reductions
    _dist.assert_same_on_all_ranks(compiled_model[0].lora_A.weight.grad.to_local(), "column dA after no_sync")


@pytest.mark.slow
def test_compiled_no_sync_reduces_once_per_step_like_eager():
    _dist.run_ranks(2, _compiled_no_sync_matches_eager)


# ---------------------------------------------------------------------------------------------------------
# GPU: Inductor on a transformer block, and a CUDA graph of a whole step.
# ---------------------------------------------------------------------------------------------------------


class _Block(nn.Module):
    """Pre-norm attention (one head, causal) and a ReLU MLP, every projection a LoRALinear."""

    def __init__(self, d: int, config: LoRAConfig, dtype: torch.dtype = BF16) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": "cuda"}
        self.norm1, self.norm2 = nn.LayerNorm(d, **kw), nn.LayerNorm(d, **kw)
        self.qkv, self.out = LoRALinear(d, 3 * d, config, **kw), LoRALinear(d, d, config, **kw)
        self.up, self.down = LoRALinear(d, 4 * d, config, **kw), LoRALinear(4 * d, d, config, **kw)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        h = h + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return h + self.down(F.relu(self.up(self.norm2(h))))


@pytest.mark.gpu
@needs_cuda
def test_gpu_inductor_block_matches_eager():
    # bf16 base, fp32 adapters, dropout 0.1: the fused op inside Inductor's graph draws and applies the eager
    # masks. Inductor fuses the norms and residuals and rounds differently, and the gradients sum bf16 terms over
    # 512 tokens that largely cancel: each output and gradient must be as close to an fp32 reference under the
    # same masks (the torch backend) as eager's is. Another mask would put the adapter gradients tens of percent
    # off.
    torch.manual_seed(0)
    config = LoRAConfig(r=16, alpha=32, dropout=0.1, lora_dtype=F32)
    block = _Block(256, config).train()
    block.norm1.requires_grad_(False)  # a LoRA fine-tune trains the adapters alone
    block.norm2.requires_grad_(False)
    for layer in (block.qkv, block.out, block.up, block.down):
        nn.init.normal_(layer.lora_B.weight, std=0.02)
    reference = _Block(256, dataclasses.replace(config, backend="torch"), dtype=F32).train()
    reference.load_state_dict(block.state_dict())
    reference.requires_grad_(False)
    for layer in (reference.qkv, reference.out, reference.up, reference.down):
        layer.lora_A.weight.requires_grad_(True)
        layer.lora_B.weight.requires_grad_(True)
    x = torch.randn(4, 128, 256, device="cuda", dtype=BF16)
    compiled = torch.compile(copy.deepcopy(block), fullgraph=True)

    def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    outputs = []
    for step in range(3):
        state = _rng_state(x.device)
        ref = _step(reference, x.float())
        _set_rng_state(state, x.device)
        eager = _step(block, x)
        _set_rng_state(state, x.device)
        got = _step(compiled, x)
        for i, (g, e, r) in enumerate(zip(got, eager, ref, strict=True)):
            err, eager_err = rel_err(g, r), rel_err(e, r)
            assert eager_err < 0.1, f"step {step}, output/grad {i}: eager is {eager_err:.3g} off the reference"
            assert err <= 2 * eager_err + 1e-3, f"step {step}, output/grad {i}: {err:.3g} off, eager {eager_err:.3g}"
        outputs.append(got[0])
    assert not torch.equal(outputs[0], outputs[1]), "the second step reused the first step's masks"


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_of_a_step_replays_fresh_masks():
    # The seed is drawn on the device and read there by the kernels: each replay draws a new one (the
    # generator's offset advances per replay) and its outputs are an eager call's under that seed, bit for bit.
    torch.manual_seed(0)
    cfg = LoRAConfig(r=16, alpha=32, dropout=0.1, lora_dtype=F32)
    layer = LoRALinear(1024, 768, cfg, dtype=BF16, device="cuda").train()
    nn.init.normal_(layer.lora_B.weight, std=0.02)
    params = [layer.lora_A.weight, layer.lora_B.weight]
    x = torch.randn(2048, 1024, device="cuda", dtype=BF16, requires_grad=True)
    dy = torch.randn(2048, 768, device="cuda", dtype=BF16)
    seeds, stream = [], layer._dropout_stream
    draw = stream.next_seed
    stream.next_seed = lambda x: seeds.append(draw(x)) or seeds[-1]  # the captured seed's memory, per replay

    def step(y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (y.detach(), *torch.autograd.grad(y, [x, *params], dy))

    capture_stream = torch.cuda.Stream()
    capture_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture_stream):
        for _ in range(2):
            step(layer(x))  # tune, compile and bind before capture
    torch.cuda.current_stream().wait_stream(capture_stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream):
        captured = step(layer(x))
    replays = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        replays.append(([t.clone() for t in captured], seeds[-1].clone()))
    assert len({int(seed) for _, seed in replays}) == 3, "a replay reused its seed"
    assert not torch.equal(replays[0][0][0], replays[1][0][0]), "two replays dropped the same elements"
    for outputs, seed in replays:
        y = lora_linear(x, layer.weight, layer.bias, *params, layer.scale, cfg.dropout, training=True,
                        dropout_seed=seed)  # fmt: skip
        for name, got, want in zip(("y", "dx", "dA", "dB"), outputs, step(y), strict=True):
            assert torch.equal(got, want), f"{name} of the replay with seed {int(seed)}"


@pytest.mark.gpu
@needs_cuda
def test_gpu_reduce_overhead_block_trains_from_cuda_graphs_with_fresh_masks():
    # torch.compile's "reduce-overhead" replays the block from CUDA graphs: the kernels' workspaces must stay out of
    # the graphs' memory pool (kernels.workspace.outside_graph_pools), and every replay must draw new masks.
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    block = _Block(256, LoRAConfig(r=16, alpha=32, dropout=0.1, lora_dtype=F32)).train()
    block.requires_grad_(False)
    params = []
    for layer in (block.qkv, block.out, block.up, block.down):
        nn.init.normal_(layer.lora_B.weight, std=0.02)
        params += [layer.lora_A.weight.requires_grad_(True), layer.lora_B.weight.requires_grad_(True)]
    counters.clear()
    compiled = torch.compile(block, fullgraph=True, mode="reduce-overhead")
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    x = torch.randn(4, 128, 256, device="cuda", dtype=BF16)
    target = torch.randn_like(x, dtype=F32)
    losses = []
    for _ in range(8):
        torch.compiler.cudagraph_mark_step_begin()
        loss = (compiled(x).float() - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    with torch.no_grad():
        torch.compiler.cudagraph_mark_step_begin()
        first = compiled(x).clone()
        torch.compiler.cudagraph_mark_step_begin()
        second = compiled(x).clone()
    assert not torch.equal(first, second), "two replays dropped the same elements"
