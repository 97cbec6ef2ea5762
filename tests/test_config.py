"""``LoRAConfig``: every out-of-range field raises ``ValueError`` naming the field and the bad value.

Reference: the field docstrings of ``parallel_lora.config.LoRAConfig`` and docs/design.md (scale is
``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA; the config is validated on construction, frozen afterwards).
"""

import dataclasses
import math

import pytest
import torch

from parallel_lora import LoRAConfig

BAD_FIELDS = [
    ("r", 0),
    ("r", -4),
    ("r", 1.5),
    ("r", True),
    ("r", "8"),
    ("alpha", 0),
    ("alpha", -1.0),
    ("alpha", float("nan")),
    ("alpha", "16"),
    ("dropout", 1.0),
    ("dropout", -0.1),
    ("dropout", float("nan")),
    ("dropout", 1 - 2**-16),  # below 1, but its keep threshold (2**16) overflows the mask's 16-bit uniforms
    ("dropout", "0.1"),
    ("dropout_position", "mid"),
    ("init_A", "foo"),
    ("backend", "cuda"),
    ("lora_dtype", torch.int32),
    ("lora_dtype", torch.bool),
    ("lora_dtype", "float32"),
    ("target_modules", ()),
    ("target_modules", []),
    ("target_modules", ""),
    ("target_modules", ("q_proj", "")),
    ("target_modules", ("q_proj", 3)),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
def test_bad_field_raises_value_error_naming_field_and_value(field, value):
    with pytest.raises(ValueError) as err:
        LoRAConfig(**{field: value})
    message = str(err.value)
    assert f"LoRAConfig.{field}" in message
    assert repr(value) in message, f"{message!r} does not show the bad value {value!r}"


def test_defaults_are_valid_and_match_the_design():
    c = LoRAConfig()
    assert (c.r, c.alpha, c.dropout, c.dropout_position, c.init_A) == (8, 16, 0.0, "pre", "kaiming")
    assert (c.use_rslora, c.lora_dtype, c.backend) == (False, None, "auto")
    assert c.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"r": 1},
        {"alpha": 0.5},
        {"dropout": 0.0},
        {"dropout": 0.999},
        {"dropout_position": "post"},
        {"init_A": "xavier"},
        {"init_A": "gaussian"},
        {"backend": "torch"},
        {"backend": "triton"},
        {"lora_dtype": torch.float32},
        {"lora_dtype": torch.bfloat16},
        {"target_modules": "all-linear"},
        {"target_modules": "layers.*.mlp.*"},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_boundary_values_are_accepted(kwargs):
    LoRAConfig(**kwargs)


def test_target_modules_sequence_is_stored_as_a_tuple():
    assert LoRAConfig(target_modules=["up", "down"]).target_modules == ("up", "down")


def test_scale_is_alpha_over_r():
    assert LoRAConfig(r=8, alpha=16).scale == 2.0
    assert LoRAConfig(r=3, alpha=1).scale == pytest.approx(1 / 3)


def test_rslora_scale_is_alpha_over_sqrt_r():
    assert LoRAConfig(r=16, alpha=8, use_rslora=True).scale == 2.0
    assert LoRAConfig(r=8, alpha=16, use_rslora=True).scale == pytest.approx(16 / math.sqrt(8))
    # Not vacuous: the two rules disagree for every r > 1.
    assert LoRAConfig(r=16, alpha=8, use_rslora=True).scale != LoRAConfig(r=16, alpha=8).scale


@pytest.mark.parametrize(("field", "value"), [("r", 0), ("r", 4), ("alpha", -1.0), ("target_modules", ())])
def test_config_is_frozen_after_validation(field, value):
    # A late change would skip validation (r = 0 divides by zero at the first forward) or silently change a scale
    # that layers built from the config already use.
    config = LoRAConfig(r=8, alpha=16)
    with pytest.raises(dataclasses.FrozenInstanceError, match=field):
        setattr(config, field, value)
    assert (config.r, config.alpha, config.scale) == (8, 16, 2.0)


def test_replace_builds_a_new_validated_config():
    config = LoRAConfig(r=8, alpha=16, target_modules=["up"])
    assert dataclasses.replace(config, r=4).scale == 4.0
    assert config.r == 8
    with pytest.raises(ValueError, match=r"LoRAConfig.r must be an integer >= 1, got 0"):
        dataclasses.replace(config, r=0)
