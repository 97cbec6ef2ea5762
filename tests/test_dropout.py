"""Tests for ``parallel_lora._dropout``: the counter-based mask hash, on the torch side (CPU).

The Triton transcription is checked bit for bit against this one in ``tests/kernels/test_dropout_mask.py``; here
the hash's arithmetic is checked against plain Python integers, and its statistics against those of independent
fair coins, on ~1M elements: a bad hash (a weak combine of row and column, a seed word that does not reach the
mask, a period along an axis, seeds that only permute the mask) fails these. The hash is deterministic, so the
bounds (5 to 7 sigma) never flake. Last, the seeds: ints and their device tensors key the same mask, and
``DropoutStream`` draws a fresh one per call from the generator, compiled or not; on CUDA (a stand-in generator
here) from the Philox state alone.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parallel_lora._dropout import (
    Dropout,
    DropoutStream,
    _mul32,
    draw_seed,
    fmix32,
    generator_seed,
    hash_bits,
    hash_keys,
    hash_uniform,
    keep_mask,
    philox_seed,
    seed_tensor,
)

M32 = 0xFFFFFFFF
ROWS = COLS = 1024  # ~1M elements
SEEDS = [0, 1, 12345, 2**32, 2**32 + 1, 2**62 - 1, 987_654_321_987]


def _py_fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def _py_hash(seed: int, m: int, k: int) -> int:
    lo, hi = seed & M32, (seed >> 32) & M32
    t = _py_fmix32((lo + 0x9E3779B9) & M32)
    k_row = _py_fmix32(hi ^ t)
    k_col = _py_fmix32((t + k_row) & M32)
    return _py_fmix32((_py_fmix32(m ^ k_row) + _py_fmix32(k ^ k_col)) & M32)


def _mask(seed: int, p: float, rows: int = ROWS, cols: int = COLS) -> torch.Tensor:
    return keep_mask(Dropout(p=p, seed=seed_tensor(seed, "cpu")), rows, cols, "cpu")


def _assert_rate(observed: float, expected: float, n: int, what: str, sigmas: float = 5.0) -> None:
    sigma = math.sqrt(expected * (1 - expected) / n)
    assert abs(observed - expected) < sigmas * sigma, f"{what}: {observed:.5f} vs {expected:.5f} (sigma {sigma:.2e})"


# ------------------------------------------------------------------------------------------- arithmetic
def test_mul32_is_exact_mod_2_32():
    rng = random.Random(0)
    xs = [0, 1, M32, 2**31, 0xFFFF, 0x10000] + [rng.getrandbits(32) for _ in range(4000)]
    cs = [0x85EBCA6B, 0xC2B2AE35, M32, 1, 0x10000] + [rng.getrandbits(32) for _ in range(3)]
    x = torch.tensor(xs, dtype=torch.int64)
    for c in cs:
        assert _mul32(x, c).tolist() == [(v * c) & M32 for v in xs]
        assert _mul32(xs[2], c) == (M32 * c) & M32  # Python ints too (the key schedule)


def test_hash_matches_a_plain_integer_transcription():
    rng = random.Random(1)
    for seed in [*SEEDS, 2**64 - 1]:
        m = torch.tensor([0, 1, 7, 2**31, M32] + [rng.getrandbits(32) for _ in range(200)], dtype=torch.int64)
        k = torch.tensor([0, 3, 1, M32, 2**31] + [rng.getrandbits(32) for _ in range(200)], dtype=torch.int64)
        want = [_py_hash(seed, a, b) for a, b in zip(m.tolist(), k.tolist(), strict=True)]
        assert hash_bits(seed, m, k).tolist() == want
    assert fmix32(torch.tensor([0, 1, M32])).tolist() == [_py_fmix32(v) for v in (0, 1, M32)]


def test_uniform_is_its_columns_half_of_the_pairs_word_and_indices_wrap_mod_2_32():
    m = torch.arange(64).unsqueeze(1)
    k = torch.arange(100, 164).unsqueeze(0)
    u = hash_uniform(5, m, k)
    assert u.dtype == torch.float32 and u.shape == (64, 64)
    word = hash_bits(5, m, k >> 1)
    half = torch.where(k % 2 == 0, word & 0xFFFF, word >> 16)
    assert torch.equal(u.double() * 2**16, half.double())
    assert ((u >= 0) & (u < 1)).all()
    assert torch.equal(hash_uniform(5, m + 2**32, k - 2**32 * 3), u)
    assert _py_hash(5, 3, 60) >> 16 == int(u[3, 21] * 2**16)  # column 121: the high half of word 60


def test_keep_mask_shards_are_slices_and_post_ignores_k_offset():
    full = keep_mask(Dropout(0.3, seed_tensor(8, "cpu"), "pre"), 40, 96, "cpu")
    assert torch.equal(keep_mask(Dropout(0.3, seed_tensor(8, "cpu"), "pre", k_offset=48), 40, 48, "cpu"), full[:, 48:])
    post = keep_mask(Dropout(0.3, seed_tensor(8, "cpu"), "post"), 40, 16, "cpu")
    assert torch.equal(keep_mask(Dropout(0.3, seed_tensor(8, "cpu"), "post", k_offset=48), 40, 16, "cpu"), post)
    assert keep_mask(Dropout(0.3, seed_tensor(8, "cpu")), 0, 5, "cpu").shape == (0, 5)


# ------------------------------------------------------------------------------------------- statistics
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_is_one_minus_p(seed, p):
    mask = _mask(seed, p)
    _assert_rate(mask.double().mean().item(), 1 - p, mask.numel(), f"keep rate, seed {seed}")


@pytest.mark.parametrize("seed", [0, 2**32 + 1])
def test_uniforms_and_2x2_patterns_are_uniform(seed):
    u = hash_uniform(seed, torch.arange(ROWS).unsqueeze(1), torch.arange(COLS).unsqueeze(0))
    # 64 equal bins of u: chi-square with 63 degrees of freedom (mean 63, sd 11.2).
    counts = torch.bincount((u * 64).long().flatten(), minlength=64).double()
    expected = u.numel() / 64
    assert ((counts - expected) ** 2 / expected).sum() < 63 + 6 * 11.2
    # The 16 keep patterns of disjoint 2x2 blocks at p = 0.5: chi-square with 15 dof (mean 15, sd 5.5).
    bits = (u >= 0.5).long().view(ROWS // 2, 2, COLS // 2, 2).permute(0, 2, 1, 3).reshape(-1, 4)
    counts = torch.bincount(bits @ torch.tensor([1, 2, 4, 8]), minlength=16).double()
    expected = bits.shape[0] / 16
    assert ((counts - expected) ** 2 / expected).sum() < 15 + 6 * 5.5


@pytest.mark.parametrize("seed", [0, 2**32 + 1])
def test_the_two_halves_of_a_word_are_independent(seed):
    """Columns ``2w`` and ``2w + 1`` come from one hash word: their uniforms' joint distribution, in 16 x 16
    bins, is that of independent uniforms (chi-square with 255 dof, mean 255, sd 22.6)."""
    u = hash_uniform(seed, torch.arange(ROWS).unsqueeze(1), torch.arange(COLS).unsqueeze(0))
    lo, hi = (u[:, 0::2] * 16).long().flatten(), (u[:, 1::2] * 16).long().flatten()
    counts = torch.bincount(lo * 16 + hi, minlength=256).double()
    expected = lo.numel() / 256
    assert ((counts - expected) ** 2 / expected).sum() < 255 + 6 * 22.6
    # And at p = 0.1 the pair is dropped together as often as independent coins are (p^2).
    mask = u < 0.1
    _assert_rate((mask[:, 0::2] & mask[:, 1::2]).double().mean().item(), 0.01, lo.numel(), "both halves dropped")


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("seed", [0, 2**40 + 17])
def test_rows_and_columns_at_any_small_or_power_of_two_lag_are_uncorrelated(seed, p):
    """Row ``m`` vs ``m + g`` and column ``c`` vs ``c + g`` agree at the rate of independent coins,
    ``p^2 + (1-p)^2``: no correlation between neighbours and no period ``2^k`` along either axis."""
    mask = _mask(seed, p)
    agree = p * p + (1 - p) ** 2
    for g in [1, 2, 3, 5, 7, *(2**k for k in range(2, 10))]:
        rows = mask[g:] == mask[:-g]
        _assert_rate(rows.double().mean().item(), agree, rows.numel(), f"rows m, m+{g}")
        cols = mask[:, g:] == mask[:, :-g]
        _assert_rate(cols.double().mean().item(), agree, cols.numel(), f"cols c, c+{g}")
        # Not even one whole row or column repeats at that lag.
        assert not rows.all(dim=1).any() and not cols.all(dim=0).any()


@pytest.mark.parametrize("seed", [0, 2**33 + 5])
def test_no_pair_of_rows_or_columns_is_correlated(seed):
    """Every pair of the 512 columns (rows) of a 512 x 512 mask, not just neighbours: the correlation of each
    pair is ~N(0, 1/512), so over ~131k pairs the largest is ~5 sigma; 7 sigma bounds it."""
    n = 512
    s = _mask(seed, 0.5, n, n).double() * 2 - 1
    bound = 7 / math.sqrt(n)
    off_diagonal = ~torch.eye(n, dtype=torch.bool)
    for corr in (s.T @ s / n, s @ s.T / n):
        assert corr[off_diagonal].abs().max() < bound
        assert abs(corr[off_diagonal].var().item() * n - 1) < 0.05  # the spread of independent pairs


SEED_PAIRS = [
    (0, 1),  # lowest bit of seed_lo
    (1, 2),
    (12345, 12346),
    (0, 2**32),  # seed_hi alone
    (5, 5 + 2**32),
    (5 + 2**32, 5 + 2**33),
    (2**62 - 1, 2**62 - 2),
    (0, 2**63),  # top bit of seed_hi
]


@pytest.mark.parametrize("a, b", SEED_PAIRS)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_different_seeds_give_unrelated_masks(a, b, p):
    """Masks of two seeds differ in ``2p(1-p)`` of the elements, as independent masks do, and neither is a
    row or column permutation of the other (a seed word XOR-ed into the raw index would give that)."""
    ma, mb = _mask(a, p), _mask(b, p)
    _assert_rate((ma != mb).double().mean().item(), 2 * p * (1 - p), ma.numel(), f"seeds {a}, {b} differ")
    if p == 0.5:
        n = 512
        sa, sb = (m[:n, :n].double() * 2 - 1 for m in (ma, mb))
        bound = 7 / math.sqrt(n)
        assert (sa.T @ sb / n).abs().max() < bound, "a column of one seed's mask is a column of the other's"
        assert (sa @ sb.T / n).abs().max() < bound, "a row of one seed's mask is a row of the other's"


def test_seed_hi_alone_changes_both_keys_and_the_mask():
    k_row, k_col = hash_keys(7)
    k_row_hi, k_col_hi = hash_keys(7 + 2**32)
    assert k_row != k_row_hi and k_col != k_col_hi
    assert not torch.equal(_mask(7, 0.5, 64, 64), _mask(7 + 2**32, 0.5, 64, 64))
    assert hash_keys(2**64 + 7) == hash_keys(7)  # the seed is taken mod 2**64, as seed_tensor takes it


def test_key_schedule_is_injective_on_a_sample():
    rng = random.Random(2)
    seeds = {rng.getrandbits(64) for _ in range(20000)} | {i for i in range(2000)} | {i << 32 for i in range(2000)}
    assert len({hash_keys(s) for s in seeds}) == len(seeds)


@pytest.mark.parametrize("rows, cols", [(2**16, 64), (64, 2**16)])
def test_32_bit_collisions_are_as_rare_as_for_a_random_function(rows, cols):
    """Among ``n = 2**22`` hashes, ~``n^2 / 2^33 = 2048`` pairs collide for a random function (Poisson, sd ~45).
    A weak row (column) term leaves pairs of rows (columns) whose terms differ by less than the tile width, each
    a near-shifted copy of the other contributing up to ``cols`` (``rows``) extra collisions: the long axis
    (``2**16``) makes such pairs certain, so the count overshoots by many sigma."""
    h = hash_bits(2**35 + 3, torch.arange(rows).unsqueeze(1), torch.arange(cols).unsqueeze(0)).flatten()
    n = h.numel()
    collisions = n - torch.unique(h).numel()
    expected = n * (n - 1) / 2**33
    assert abs(collisions - expected) < 6 * math.sqrt(expected), f"{collisions} collisions, expected ~{expected:.0f}"


# ------------------------------------------------------------------------------------------- seeds
@pytest.mark.parametrize("traced", [False, True], ids=["cpu-value", "tensor-arithmetic"])
def test_a_tensor_seed_keys_the_mask_of_its_int(traced, monkeypatch):
    # A [1] int64 tensor holds the seed mod 2**64 (two's complement). On the CPU its value is read (no sync);
    # on a GPU, or under torch.compile (simulated here), the keys are computed by tensor ops on the device.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: traced)
    m, k = torch.arange(64).unsqueeze(1), torch.arange(100, 164).unsqueeze(0)
    for seed in [*SEEDS, 2**63, 2**64 - 1, 2**64 + 3]:
        t = seed_tensor(seed, "cpu")
        assert t.dtype == torch.int64 and t.shape == (1,)
        keys = hash_keys(t)
        assert all(isinstance(key, torch.Tensor) == traced for key in keys)
        assert [int(key) for key in keys] == list(hash_keys(seed))
        assert torch.equal(hash_uniform(t, m, k), hash_uniform(seed, m, k))
        assert torch.equal(keep_mask(Dropout(0.3, t), 40, 48, "cpu"), _mask(seed, 0.3, 40, 48))


def test_the_stream_draws_a_fresh_seed_per_call_that_the_generator_replays():
    x = torch.zeros(2, 3)
    torch.manual_seed(5)
    stream = DropoutStream()
    seeds = [stream.next_seed(x) for _ in range(4)]
    assert all(isinstance(s, int) and 0 <= s < 2**62 for s in seeds)  # on the CPU: ints from its generator
    assert len(set(seeds)) == 4
    torch.manual_seed(5)
    again = DropoutStream()  # another layer (or a copy) from the same generator state: the same seeds
    assert [again.next_seed(x) for _ in range(4)] == seeds
    torch.manual_seed(5)
    shifted = DropoutStream(offset=2**61)
    assert [shifted.next_seed(x) for _ in range(4)] == [s + 2**61 for s in seeds]


@pytest.mark.parametrize("offset", [-1, 2**62, 1.5, True])
def test_a_bad_stream_offset_raises_value_error(offset):
    with pytest.raises(ValueError, match=r"offset must be an int in \[0, 2\*\*62\)"):
        DropoutStream(offset=offset)


@pytest.mark.parametrize("offset", [0, 2**61 + 5])
def test_compiled_draws_are_the_eager_draws(offset):
    # Inductor would lower a traced randint to its own generator; the draw is an opaque op, so Inductor calls
    # torch's generator as the eager path does.
    x = torch.zeros(4)
    torch.manual_seed(3)
    eager = [draw_seed(x, offset) for _ in range(3)]
    compiled = torch.compile(lambda x: draw_seed(x, offset), fullgraph=True)
    torch.manual_seed(3)
    assert [int(compiled(x)) for _ in range(3)] == [int(s) for s in eager]
    assert all(offset <= int(s) < offset + 2**62 for s in eager)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_a_stream_with_an_offset_draws_its_seed_in_one_op():
    # The offset goes into the draw's range: no second op (a CUDA launch per layer per forward) to add it.
    x = torch.zeros(4)
    with _Ops() as rec:
        DropoutStream(offset=2**61).next_seed(x)
    device_ops = [op for op in rec.ops if op != "_local_scalar_dense.default"]  # the CPU tag's read, no launch
    assert len(device_ops) == 1 and device_ops[0].startswith("randint"), rec.ops


def test_philox_seed_is_a_function_of_the_generator_state_in_the_stream_range():
    # A CUDA call's seed mixes its generator's (initial_seed, Philox offset): a new one per offset step, the same
    # one for the same state (a restored generator replays it), and the stream's offset shifts its range.
    seeds = [philox_seed(7, 4 * i) for i in range(20000)]
    assert len(set(seeds)) == len(seeds), "two offsets drew one seed"
    assert seeds == [philox_seed(7, 4 * i) for i in range(20000)]
    assert all(0 <= s < 2**62 for s in seeds)
    assert 0.48 < sum(s >= 2**61 for s in seeds) / len(seeds) < 0.52, "the seeds do not fill their range"
    assert not set(seeds) & {philox_seed(8, 4 * i) for i in range(20000)}, "another generator seed drew alike"
    assert philox_seed(2**64 - 1, 2**40) < 2**62  # any uint64 generator seed
    for offset in (1, 2**61, 2**62 - 1):
        shifted = [philox_seed(7, 4 * i, offset) for i in range(100)]
        assert shifted == [s + offset for s in seeds[:100]] and max(shifted) < 2**63  # an int64 seed


class _PhiloxGenerator:
    """A CUDA generator's host state, as ``generator_seed`` reads it."""

    def __init__(self, seed: int, offset: int) -> None:
        self.seed, self.offset = seed, offset

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        assert offset % 4 == 0, "Philox offsets move in steps of 4"
        self.offset = offset


def test_a_cuda_call_draws_its_seed_from_the_generator_state_with_no_tensor_op(monkeypatch):
    # No launch, no sync and no CPU-generator tag: the draw reads the CUDA generator's state and advances its
    # offset; a checkpoint that restores that state reruns the forward's seeds.
    generator = _PhiloxGenerator(2**64 - 3, 8)
    monkeypatch.setattr(torch.cuda, "default_generators", (generator,))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    x = SimpleNamespace(device=torch.device("cuda", 0))
    stream = DropoutStream(offset=2**61)
    cpu_state = torch.get_rng_state()
    with _Ops() as rec:
        seeds = [stream.next_seed(x) for _ in range(3)]
    assert rec.ops == [] and torch.equal(torch.get_rng_state(), cpu_state)
    assert seeds == [philox_seed(2**64 - 3, 8 + 4 * i, 2**61) for i in range(3)] and generator.offset == 20
    generator.offset = 8
    assert [generator_seed(generator, 2**61) for _ in range(3)] == seeds


@pytest.mark.parametrize(
    "change, message",
    [
        ({"p": 1.0}, "dropout.p must be in"),
        ({"p": 1 - 2**-16}, r"1 - 2\*\*-16\)"),  # its 16-bit keep threshold would not fit the mask's uniforms
        ({"position": "mid"}, "dropout_position must be 'pre' or 'post'"),
        ({"k_offset": -1}, "k_offset must be an int >= 0"),
        ({"seed": 2**63}, r"an int dropout seed must be in \[-2\*\*63, 2\*\*63\)"),
        ({"seed": -(2**63) - 1}, r"must be in \[-2\*\*63"),
        ({"seed": 3.0}, "a dropout seed must be an int or a 1-element int64 tensor"),
        ({"seed": True}, "an int or a 1-element int64 tensor"),
        ({"seed": torch.tensor([1, 2])}, "1-element int64"),
        ({"seed": torch.tensor([1.0])}, "1-element int64"),
    ],
)
def test_dropout_refuses_what_the_kernels_cannot_take(change, message):
    with pytest.raises(ValueError, match=message):
        Dropout(**{"p": 0.1, "seed": seed_tensor(1, "cpu"), **change})
