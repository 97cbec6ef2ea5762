"""``LoRALinear`` under ``torch.compile(fullgraph=True)`` and in CUDA graphs (``parallel_lora.ops``, the dropout seeds
of ``parallel_lora.dropout``).

Reference: the same module run eagerly (a deep copy), from the same generator state. ``aot_eager`` runs the very
ops the eager path runs, and Inductor on the CPU computes this small ReLU model's ops exactly, so there the compiled
step equals the eager one bit for bit; Inductor on a GPU fuses the block's norms and residuals, so the GPU block
compares within bf16 rounding. Every test drops with p > 0 and checks that the masks change from step to step: a
compiled step that drew other seeds than the eager one, or reused one, would be far outside any tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

from parallel_lora import LoRAConfig, LoRALinear, lora_linear

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


@pytest.mark.parametrize(
    "device,backend,compiler",
    [
        ("cpu", "torch", "aot_eager"),  # Inductor's C++ build of the eager masks' kernels takes a minute here
        ("cpu", "triton", "inductor"),  # Triton's interpreter, behind the registered op
        pytest.param("cuda", "auto", "inductor", marks=[pytest.mark.gpu, needs_cuda]),
    ],
)
def test_compiled_checkpoint_reruns_the_forward_masks(device, backend, compiler):
    # The compiled checkpointed region is recomputed in backward from the functionalized graph. The seed draw is a
    # random op to AOTAutograd, replayed there with the forward's generator state: the recompute gets the
    # forward's masks, and the compiled step equals an eager step without checkpointing.
    model = _mlp(backend, device)
    x = torch.randn(12, 16, device=device)
    compiled = torch.compile(lambda x: checkpoint(model, x, use_reentrant=False), fullgraph=True, backend=compiler)
    pairs = _steps_as_eager(model, model, x, steps=2, run=compiled)
    for step, (want, got) in enumerate(pairs):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(g, w), f"step {step}: output/grad {i} differs from eager"
    assert not torch.equal(pairs[0][0][0], pairs[1][0][0]), "the second step reused the first step's masks"


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


def test_the_seed_op_is_one_int64_on_its_inputs_device():
    with FakeTensorMode():
        seed = torch.ops.parallel_lora.dropout_seed(torch.empty(3, 5, device="meta"))
    assert seed.shape == (1,) and seed.dtype == torch.int64 and seed.device.type == "meta"


# ---------------------------------------------------------------------------------------------------------
# GPU: Inductor on a transformer block, and a CUDA graph of a whole step.
# ---------------------------------------------------------------------------------------------------------


class _Block(nn.Module):
    """Pre-norm attention (one head, causal) and a ReLU MLP, every projection a LoRALinear."""

    def __init__(self, d: int, config: LoRAConfig) -> None:
        super().__init__()
        kw = {"dtype": BF16, "device": "cuda"}
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
    # masks; only the fused norms and residuals round differently.
    torch.manual_seed(0)
    block = _Block(256, LoRAConfig(r=16, alpha=32, dropout=0.1, lora_dtype=F32)).train()
    for layer in (block.qkv, block.out, block.up, block.down):
        nn.init.normal_(layer.lora_B.weight, std=0.02)
    x = torch.randn(4, 128, 256, device="cuda", dtype=BF16)
    compiled = torch.compile(copy.deepcopy(block), fullgraph=True)
    pairs = _steps_as_eager(block, compiled, x, steps=3)
    for step, (want, got) in enumerate(pairs):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            scale = w.float().abs().max().item()
            what = f"step {step}, output/grad {i}"
            torch.testing.assert_close(g.float(), w.float(), atol=2e-2 * scale, rtol=2e-2,
                                       msg=lambda m, what=what: f"{what}: {m}")  # fmt: skip
    assert not torch.equal(pairs[0][0][0], pairs[1][0][0]), "the second step reused the first step's masks"


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
