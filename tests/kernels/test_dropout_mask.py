"""The dropout keep-mask as the kernels draw it (``parallel_lora.kernels.dropout_mask``).

Reference: ``parallel_lora._dropout`` (``hash_uniform``, ``keep_mask``), bit for bit: the eager and the fused
backends drop exactly the same elements.
"""

from __future__ import annotations

import pytest
import torch

from parallel_lora._dropout import Dropout, hash_uniform, keep_mask, seed_tensor
from tests._kernels import DEVICE, dropout_keep_mask, kernel_uniforms

SEEDS = [0, 1, 2**31 + 7, 2**32 - 1, 2**32, 2**32 + 1, 2**62 - 1, 2**64 - 1, 987_654_321_987]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rows, cols, offset", [(45, 67, 1000), (33, 5, 0), (1, 97, 2**31 - 50)])
def test_dropout_mask_kernel_uniforms_are_bit_exact_with_torch(seed, rows, cols, offset):
    u = kernel_uniforms(seed, rows, cols, offset, DEVICE)
    m = torch.arange(rows, device=DEVICE).unsqueeze(1)
    k = torch.arange(offset, offset + cols, device=DEVICE).unsqueeze(0)
    ref = hash_uniform(seed, m, k)
    assert ref.shape == (rows, cols) and ref.dtype == torch.float32
    assert torch.equal(u, ref)
    assert ((u >= 0) & (u < 1)).all() and torch.equal(u * 2**16, (u * 2**16).floor())


@pytest.mark.parametrize("seed", SEEDS)
def test_an_int_seed_draws_the_uniforms_of_its_tensor(seed):
    # An int goes to the kernels as the scalar seed_salt (beside a zero in memory), a tensor through seed_ptr; the
    # kernel's seed is their int64 sum, wrapping: split anyhow, one 64-bit seed draws one set of uniforms.
    want = kernel_uniforms(seed_tensor(seed, DEVICE), 21, 40, 7, DEVICE)
    as_int = (seed + 2**63) % 2**64 - 2**63
    assert torch.equal(kernel_uniforms(as_int, 21, 40, 7, DEVICE), want)
    for part in (1, 2**62 + 3, -(2**63)):
        salt = (seed - part + 2**63) % 2**64 - 2**63
        assert torch.equal(kernel_uniforms(seed_tensor(part, DEVICE), 21, 40, 7, DEVICE, salt=salt), want), part
    assert not torch.equal(kernel_uniforms(as_int ^ 1, 21, 40, 7, DEVICE), want)


@pytest.mark.parametrize("position,k_offset", [("pre", 0), ("pre", 37), ("post", 0), ("post", 37)])
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("seed", [3, 2**33 + 5])
def test_dropout_mask_equals_keep_mask(position, k_offset, p, seed):
    drop = Dropout(p=p, seed=seed_tensor(seed, DEVICE), position=position, k_offset=k_offset)
    mask = dropout_keep_mask(drop, 50, 70, DEVICE)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, keep_mask(drop, 50, 70, DEVICE))
    assert abs(mask.float().mean().item() - (1 - p)) < 0.05


def test_dropout_mask_keeps_exactly_the_uniforms_at_or_above_p():
    # The kernels test an integer threshold on each 16-bit half of the hash, not u >= p: at p equal to a drawn
    # uniform u (a multiple of 2**-16) that element is kept, in either half of its word, and at p half a step
    # above it (exact in fp32 below 0.5) it is dropped; at the largest p (just below 1 - 2**-16) the threshold must
    # not overflow (only v = 2**16 - 1 is kept). Odd widths and offsets pair columns across tiles and words.
    u = kernel_uniforms(5, 64, 64, 0, DEVICE)
    low = u[:, 0::2]
    high = u[:, 1::2]
    picks = [*low[low < 0.5][:2].tolist(), *high[high < 0.5][:2].tolist()]
    for p in (*picks, *(v + 2**-17 for v in picks), 0.1, 2**-16, 1 - 2**-15, 1 - 2**-16 - 2**-24, 0.0):
        for cols, offset in ((64, 0), (37, 5)):
            drop = Dropout(p=p, seed=seed_tensor(5, DEVICE), position="pre", k_offset=offset)
            mask = dropout_keep_mask(drop, 64, cols, DEVICE)
            want = kernel_uniforms(5, 64, cols, offset, DEVICE) >= torch.tensor(p, dtype=torch.float32)
            assert torch.equal(mask, want), (p, offset)
            if p == picks[0]:
                assert want.any() and not want.all()


def test_dropout_mask_of_a_shard_is_a_slice_of_the_full_mask():
    full = dropout_keep_mask(Dropout(p=0.3, seed=seed_tensor(8, DEVICE), position="pre"), 20, 96, DEVICE)
    shard = dropout_keep_mask(Dropout(p=0.3, seed=seed_tensor(8, DEVICE), position="pre", k_offset=48), 20, 48, DEVICE)
    assert torch.equal(shard, full[:, 48:])


def test_dropout_mask_differs_between_seeds():
    masks = [dropout_keep_mask(Dropout(p=0.5, seed=seed_tensor(s, DEVICE)), 32, 32, DEVICE) for s in (1, 2, 2**32 + 1)]
    for i in range(len(masks)):
        for j in range(i):
            assert (masks[i] != masks[j]).float().mean() > 0.3
