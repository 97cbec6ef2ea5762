"""Building the tensor-parallel layers: init independent of the TP size (rank 0's draw), the meta-device recipe,
and the errors bad shapes, meshes and devices raise (``tests/_tp.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from parallel_lora import ColumnParallelLoRALinear, LoRALinear, RowParallelLoRALinear
from parallel_lora.tp._layouts import LAYOUTS
from tests import _dist
from tests._recipes import reset_every_module
from tests._tp import (
    BATCH,
    SEQ,
    WORLD_SIZES,
    H,
    K,
    N,
    gpu,
    tp_config,
)


def _init_independent_of_tp(seed: int) -> None:
    mesh, rank = _dist.mesh(), dist.get_rank()
    cfg = tp_config()
    for cls, (fan_in, fan_out) in ((ColumnParallelLoRALinear, (K, H)), (RowParallelLoRALinear, (H, N))):
        torch.manual_seed(seed)
        ref = LoRALinear(fan_in, fan_out, cfg, bias=True)
        # Every rank seeded differently: the result must still be rank 0's draw (src_data_rank=0).
        torch.manual_seed(seed + rank)
        layer = cls(fan_in, fan_out, cfg, mesh, bias=True)
        layout = LAYOUTS[cls.kind]
        for name, placement, got, want in (
            ("weight", layout.weight, layer.weight, ref.weight),
            ("bias", layout.bias, layer.bias, ref.bias),
            ("lora_A", layout.lora_A, layer.lora_A.weight, ref.lora_A.weight),
            ("lora_B", layout.lora_B, layer.lora_B.weight, ref.lora_B.weight),
        ):
            assert got.placements == (placement,), f"{cls.kind} {name}: {got.placements}"
            assert torch.equal(got.full_tensor(), want), f"{cls.kind} {name} differs from the seeded LoRALinear"
        assert not layer.lora_B.weight.to_local().any(), "B must start at zero"
        replicated = getattr(layer, LAYOUTS[cls.kind].replicated_factor).weight
        _dist.assert_same_on_all_ranks(replicated.to_local(), f"{cls.kind} replicated factor")

        # from_linear: rank 0's nn.Linear is the source; A is drawn from the global shape as LoRALinear does.
        torch.manual_seed(seed)
        ref = LoRALinear.from_linear(nn.Linear(fan_in, fan_out), cfg)
        torch.manual_seed(seed + rank)
        layer = cls.from_linear(nn.Linear(fan_in, fan_out), cfg, mesh)
        for name in ("weight", "bias", "lora_A.weight", "lora_B.weight"):
            got, want = layer.get_parameter(name), ref.get_parameter(name)
            assert torch.equal(got.full_tensor(), want), f"{cls.kind}.from_linear {name} differs"
        assert not layer.weight.requires_grad and layer.lora_A.weight.requires_grad


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_init_is_independent_of_tp_size_and_comes_from_rank_0(world_size):
    _dist.run_ranks(world_size, _init_independent_of_tp, 7)


def _meta_built_layers_initialise_like_constructed_ones(seed: int) -> None:
    """torchtitan's flow: build on the meta device, ``to_empty()``, then ``reset_parameters()``. The full tensors
    must be the constructor's (so independent of the TP size), and rank 0's draw whatever the other ranks'
    generators; the ranks of a tp group share the dropout seeds' offset."""
    mesh, rank, device = _dist.mesh(), dist.get_rank(), _dist.device()
    cfg = tp_config(dropout=0.25)
    for cls, (fan_in, fan_out) in ((ColumnParallelLoRALinear, (K, H)), (RowParallelLoRALinear, (H, N))):
        torch.manual_seed(seed)
        ref = LoRALinear(fan_in, fan_out, cfg, bias=True, device=device)
        with torch.device("meta"):
            in_context = cls(fan_in, fan_out, cfg, mesh, bias=True)
            sharded_in_place = cls.from_lora_linear(LoRALinear(fan_in, fan_out, cfg, bias=True), mesh)
        built = {
            "device context": in_context,
            "device='meta'": cls(fan_in, fan_out, cfg, mesh, bias=True, device="meta"),
            "from_lora_linear": sharded_in_place,
        }
        for how, layer in built.items():
            what = f"{cls.kind} built with {how}"
            assert all(isinstance(p, DTensor) and p.is_meta for p in layer.parameters()), what
            width = fan_in // (mesh.size() if cls.kind == "row" else 1)
            with pytest.raises(RuntimeError, match=r"on the meta device; materialize them first with to_empty"):
                layer(torch.randn(BATCH, SEQ, width, device=device))
            layer.to_empty(device=device)
            torch.manual_seed(seed + rank)  # rank 0's draw must win
            reset_every_module(layer)  # the usual recipe: the layer's reset, then its factors' (which draw nothing)
            for name in ("weight", "bias", "lora_A.weight", "lora_B.weight"):
                got = layer.get_parameter(name)
                assert got.placements == (getattr(LAYOUTS[cls.kind], name.split(".")[0]),), f"{what}: {name}"
                assert torch.equal(got.full_tensor(), ref.get_parameter(name)), f"{what}: {name} differs"
            assert layer.lora_A.weight.requires_grad and not layer.weight.requires_grad, what
            offset = torch.tensor([layer._dropout_stream.offset], device=device)
            _dist.assert_same_on_all_ranks(offset, f"{what}: dropout seed offset")
            # It runs like the constructed layer: the same output and adapter gradients.
            torch.manual_seed(seed)
            constructed = cls(fan_in, fan_out, cfg, mesh, bias=True)
            x = torch.randn(BATCH, SEQ, width, device=device)
            results = []
            for m in (layer, constructed):
                with torch.no_grad():
                    m.lora_B.weight.to_local().fill_(0.5)  # B = 0 would hide the LoRA path
                y = m.eval()(x)
                y.square().sum().backward()
                results.append([y, m.lora_A.weight.grad.to_local(), m.lora_B.weight.grad.to_local()])
            for got, want, name in zip(*results, ("y", "dA", "dB"), strict=True):
                assert torch.equal(got, want), f"{what}: {name}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_layers_built_on_the_meta_device_initialise_like_constructed_ones(world_size):
    _dist.run_ranks(world_size, _meta_built_layers_initialise_like_constructed_ones, 7)


def _bad_inputs_raise() -> None:
    mesh, tp = _dist.mesh(), dist.get_world_size()
    assert tp == 2
    cfg = tp_config()
    with pytest.raises(ValueError, match=r"out_features=5 must be divisible by the tensor-parallel size 2"):
        ColumnParallelLoRALinear(K, 5, cfg, mesh)
    with pytest.raises(ValueError, match=r"in_features=5 must be divisible by the tensor-parallel size 2"):
        RowParallelLoRALinear(5, N, cfg, mesh)
    with pytest.raises(ValueError, match=r"out_features=5 must be divisible"):
        ColumnParallelLoRALinear.from_linear(nn.Linear(K, 5), cfg, mesh)
    with pytest.raises(ValueError, match=r"1-D mesh, got a 2-D mesh of shape \(1, 2\).*mesh\['tp'\]"):
        ColumnParallelLoRALinear(K, H, cfg, _dist.mesh((1, 2), ("dp", "tp")))
    with pytest.raises(TypeError, match="DeviceMesh"):
        RowParallelLoRALinear(H, N, cfg, dist.group.WORLD)
    # "cuda" is rejected before anything is allocated: no GPU needed. ("meta" is accepted: see the meta test.)
    msg = r"module device cuda.* does not match the mesh's device type 'cpu' \(or 'meta'"
    with pytest.raises(ValueError, match=msg):
        ColumnParallelLoRALinear(K, H, cfg, mesh, device="cuda")

    col = ColumnParallelLoRALinear(K, H, cfg, mesh)
    row = RowParallelLoRALinear(H, N, cfg, mesh)
    with pytest.raises(ValueError, match=r"expected input of last dimension 16 .*got shape \(2, 8, 12\)"):
        col(torch.randn(BATCH, SEQ, H // 2))
    with pytest.raises(ValueError, match=r"expected input of last dimension 12 \(in_features/tp = 24/2"):
        row(torch.randn(BATCH, SEQ, H))  # the full width is wrong for a row shard
    with pytest.raises(ValueError, match="input on meta"):
        col(torch.randn(BATCH, SEQ, K, device="meta"))
    with pytest.raises(TypeError, match="plain local torch.Tensor, got DTensor"):
        col(torch.distributed.tensor.distribute_tensor(torch.randn(BATCH, SEQ, K), mesh, [Replicate()]))
    row_sp = RowParallelLoRALinear(H, N, cfg, mesh, sequence_parallel=True)
    msg = r"sequence length 7 \(dim 1\) must be divisible by the tensor-parallel size 2"
    with pytest.raises(ValueError, match=msg):
        row_sp(torch.randn(BATCH, 7, H // 2))
    col_sp = ColumnParallelLoRALinear(K, H, cfg, mesh, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel needs x with at least 2 dims"):
        col_sp(torch.randn(K))


@pytest.mark.parametrize("world_size", [2])
def test_bad_shapes_meshes_and_devices_raise_errors_naming_the_numbers(world_size):
    _dist.run_ranks(world_size, _bad_inputs_raise)


@gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_gpu_nccl_layers_built_on_the_meta_device_initialise_like_constructed_ones(world_size):
    """The seed is drawn on the current CUDA device at construction; the resets draw on it too."""
    _dist.run_ranks(world_size, _meta_built_layers_initialise_like_constructed_ones, 7, backend="nccl")
