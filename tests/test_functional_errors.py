"""``lora_linear``'s input checks: a wrong shape, dtype, backend, option or seed tensor raises a clear error
naming what was expected, before any compute.
"""

from __future__ import annotations

import pytest
import torch

from parallel_lora import lora_linear
from parallel_lora.functional import resolve_backend
from tests._functional import FP32, SCALE, K, M, N, R, make_inputs

# ---------------------------------------------------------------------------------------------------------
# Bad input: clear errors before any compute.
# ---------------------------------------------------------------------------------------------------------


def _good():
    return make_inputs(FP32)


def test_wrong_input_width_names_the_expected_width():
    inp = _good()
    with pytest.raises(ValueError, match=f"in_features={K}"):
        lora_linear(torch.randn(M, K + 1), inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE)


def test_integer_input_raises_type_error():
    inp = _good()
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        lora_linear(torch.ones(M, K, dtype=torch.int64), inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE)


@pytest.mark.parametrize(
    ("which", "shape", "message"),
    [
        ("lora_A", (R, K + 1), f"lora_A must be \\[r, in_features={K}\\]"),
        ("lora_A", (K,), f"lora_A must be \\[r, in_features={K}\\]"),
        ("lora_B", (N, R + 1), f"lora_B must be \\[out_features={N}, r={R}\\]"),
        ("lora_B", (R, N), f"lora_B must be \\[out_features={N}, r={R}\\]"),
        ("bias", (N + 1,), f"bias must be \\[out_features={N}\\]"),
        ("weight", (N, K, 1), "weight must be 2-D"),
    ],
)
def test_wrong_parameter_shape_raises_value_error(which, shape, message):
    args = vars(_good())
    args[which] = torch.randn(*shape)
    with pytest.raises(ValueError, match=message):
        lora_linear(args["x_leaf"], args["weight"], args["bias"], args["lora_A"], args["lora_B"], SCALE)


def test_triton_on_cpu_without_the_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    inp = _good()
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        lora_linear(inp.x_leaf, inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE, backend="triton")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "bogus"}, "backend must be one of"),
        ({"dropout_p": 1.0, "training": True}, "dropout_p must be in"),
        ({"dropout_p": 1 - 2**-16, "training": True}, r"1 - 2\*\*-16\)"),
        ({"dropout_position": "mid"}, "dropout_position must be"),
    ],
)
def test_bad_option_raises_value_error(kwargs, message):
    inp = _good()
    with pytest.raises(ValueError, match=message):
        lora_linear(inp.x_leaf, inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE, **kwargs)


def test_auto_backend_is_torch_on_cpu():
    assert resolve_backend("auto", torch.device("cpu")) == "torch"


@pytest.mark.parametrize(
    "seed",
    [torch.tensor([1, 2]), torch.tensor([1.0]), torch.tensor([1], device="meta"), 2**63, -(2**63) - 1, 1.0],
    ids=["two", "float", "meta", "int_above", "int_below", "float_scalar"],
)
def test_a_bad_seed_raises_value_error(seed):
    inp = _good()
    with pytest.raises(ValueError, match=r"1-element int64 tensor|on the operands' device|must be in \[-2\*\*63"):
        lora_linear(inp.x_leaf, inp.weight, inp.bias, inp.lora_A, inp.lora_B, SCALE, dropout_p=0.1, training=True,
                    dropout_seed=seed)  # fmt: skip
