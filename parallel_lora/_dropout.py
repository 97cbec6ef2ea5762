"""Counter-based LoRA dropout: the keep-mask is a hash of (seed, row, column); see docs/design.md, "Dropout seeds"."""

from __future__ import annotations

import numbers
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ._library import define

MASK32 = 0xFFFFFFFF
FMIX_M1 = 0x85EBCA6B
FMIX_M2 = 0xC2B2AE35
GOLDEN32 = 0x9E3779B9
Word = torch.Tensor | int


@dataclass(frozen=True)
class Dropout:
    """Dropout on the LoRA branch of one call: ``"pre"`` drops ``x [M, K]`` before ``A``, ``"post"`` drops
    ``x A^T [M, r]``; ``k_offset`` is a row-parallel shard's first global input column; ``seed`` as ``check_seed``
    takes it."""

    p: float
    seed: torch.Tensor | int
    position: str = "pre"
    k_offset: int = 0

    def __post_init__(self) -> None:
        check_dropout(self.p, self.position, self.k_offset, "dropout.p")
        check_seed(self.seed)

    @property
    def keep_scale(self) -> float:
        return 1.0 / (1.0 - self.p)


# The kernels' keep threshold ceil(p * 2**16) must fit in 16 bits; fp32 holds this bound exactly.
P_LIMIT = 1.0 - 2.0**-16
P_RANGE = "[0, 1 - 2**-16)"


def valid_p(p: object) -> bool:
    """Whether ``p`` is a usable dropout probability: a real number in ``P_RANGE``."""
    return isinstance(p, numbers.Real) and not isinstance(p, bool) and 0.0 <= p < P_LIMIT


POSITIONS = ("pre", "post")


def check_dropout(p: float, position: str = "pre", k_offset: int = 0, name: str = "dropout_p") -> None:
    """Raise ``ValueError`` unless ``p`` is in ``P_RANGE``, ``position`` is "pre" or "post" and ``k_offset >= 0``."""
    if not valid_p(p):
        raise ValueError(f"{name} must be in {P_RANGE}, got {p!r}")
    if position not in POSITIONS:
        raise ValueError(f"dropout_position must be 'pre' or 'post', got {position!r}")
    if isinstance(k_offset, bool) or not isinstance(k_offset, int) or k_offset < 0:
        raise ValueError(f"dropout k_offset must be an int >= 0, got {k_offset!r}")


INT64_MIN, INT64_END = -(2**63), 2**63


def check_seed(seed: torch.Tensor | int, device: torch.device | None = None) -> torch.Tensor | int:
    """A dropout seed is a 64-bit value: a ``[1]`` int64 tensor on the operands' ``device`` (when given), or a host
    int in the int64 range, which a CUDA graph capture on ``device`` refuses. Returns it (a tensor as ``[1]``);
    ``ValueError`` otherwise."""
    if isinstance(seed, int) and not isinstance(seed, bool):
        if not INT64_MIN <= seed < INT64_END:
            raise ValueError(f"an int dropout seed must be in [-2**63, 2**63), got {seed}")
        if device is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"LoRA dropout: a host-side seed ({seed}) cannot be captured in a CUDA graph: every replay would "
                "reuse its mask. Let the layer draw its seeds (parallel_lora._dropout.DropoutStream, or "
                "dropout_seed=None in lora_linear), or capture with dropout=0.0."
            )
        return seed
    if not isinstance(seed, torch.Tensor) or seed.dtype != torch.int64 or seed.numel() != 1:
        got = f"a {seed.dtype} tensor of shape {list(seed.shape)}" if isinstance(seed, torch.Tensor) else repr(seed)
        raise ValueError(f"a dropout seed must be an int or a 1-element int64 tensor, got {got}")
    if device is not None and seed.device != device:
        raise ValueError(f"the dropout seed must be on the operands' device {device}, got {seed.device}")
    return seed.reshape(1)


def _mul32(x: Word, c: int) -> Word:
    """``x * c mod 2**32``, with ``c`` split in 16-bit halves so that no product overflows int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def fmix32(x: Word) -> Word:
    x = x ^ (x >> 16)
    x = _mul32(x, FMIX_M1)
    x = x ^ (x >> 13)
    x = _mul32(x, FMIX_M2)
    return x ^ (x >> 16)


def hash_keys(seed: torch.Tensor | int) -> tuple[Word, Word]:
    """The keys ``(k_row, k_col)`` of the 64-bit seed: ints, or ``[1]`` int64 tensors for a device seed."""
    if not isinstance(seed, torch.Tensor) or (seed.device.type == "cpu" and not torch.compiler.is_compiling()):
        seed = int(seed)
    lo, hi = seed & MASK32, (seed >> 32) & MASK32
    t = fmix32((lo + GOLDEN32) & MASK32)
    k_row = fmix32(hi ^ t)
    k_col = fmix32((t + k_row) & MASK32)
    return k_row, k_col


def hash_bits(seed: torch.Tensor | int, rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """``h(m, w) = fmix32(fmix32(m ^ k_row) + fmix32(w ^ k_col)) mod 2**32`` of int64 rows and words, as int64."""
    k_row, k_col = hash_keys(seed)
    r = fmix32((rows & MASK32) ^ k_row)
    c = fmix32((words & MASK32) ^ k_col)
    return fmix32((r + c) & MASK32)


def hash_uniform(seed: torch.Tensor | int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in [0, 1), steps of 2**-16: the low (even col) or high half of ``hash_bits(seed, row, col>>1)``."""
    cols = cols & MASK32
    h = hash_bits(seed, rows, cols >> 1)
    return ((h >> ((cols & 1) * 16)) & 0xFFFF).to(torch.float32) * 2.0**-16


def keep_mask(dropout: Dropout, rows: int, cols: int, device: torch.device | str) -> torch.Tensor:
    """Boolean keep-mask ``[rows, cols]`` of the dropped tensor, columns shifted by ``k_offset`` for "pre"."""
    offset = dropout.k_offset if dropout.position == "pre" else 0
    m = torch.arange(rows, device=device, dtype=torch.int64).unsqueeze(1)
    k = torch.arange(offset, offset + cols, device=device, dtype=torch.int64).unsqueeze(0)
    return hash_uniform(dropout.seed, m, k) >= dropout.p


SEED_BOUND = 2**62
MASK64 = 2**64 - 1
MIX_M0 = 0x9E3779B97F4A7C15  # odd: spreads the generator's seed before its offset is added
MIX_M1 = 0xBF58476D1CE4E5B9  # splitmix64's finalizer
MIX_M2 = 0x94D049BB133111EB
PHILOX_STEP = 4  # CUDA generators move their Philox offset in multiples of 4


def philox_seed(initial_seed: int, philox_offset: int, offset: int = 0) -> int:
    """The seed of a CUDA generator state ``(initial_seed, philox_offset)``: an int in ``[offset, offset + 2**62)``,
    a 64-bit mix of the two (splitmix64's finalizer over ``initial_seed * MIX_M0 + philox_offset``)."""
    z = (initial_seed * MIX_M0 + philox_offset) & MASK64
    z = ((z ^ (z >> 30)) * MIX_M1) & MASK64
    z = ((z ^ (z >> 27)) * MIX_M2) & MASK64
    return offset + ((z ^ (z >> 31)) >> 2)


def generator_seed(generator, offset: int = 0) -> int:
    """``philox_seed`` of a CUDA ``generator``'s state, advancing its offset by one step: no launch, no sync."""
    philox_offset = generator.get_offset()
    generator.set_offset(philox_offset + PHILOX_STEP)
    return philox_seed(generator.initial_seed(), philox_offset, offset)


def new_seed() -> int:
    """A fresh 62-bit int from the CPU default generator: a ``CallSeeds`` tag."""
    return int(torch.randint(0, SEED_BOUND, (1,), dtype=torch.int64).item())


def seed_tensor(seed: int, device: torch.device | str) -> torch.Tensor:
    """An int seed, mod 2**64, as a ``[1]`` int64 tensor on ``device``: filled there, since a host-to-device copy from
    pageable memory would synchronize the stream at every compiled call."""
    seed = int(seed) % 2**64
    return torch.full((1,), seed - 2**64 if seed >= 2**63 else seed, dtype=torch.int64, device=device)


def draw_seed(like: torch.Tensor, offset: int = 0) -> torch.Tensor | int:
    """A fresh seed in ``[offset, offset + 2**62)`` for a call on ``like``'s device, from its default generator: an
    int, or ``[1]`` int64 drawn on the device (no sync) while compiling and in CUDA graph capture."""
    if torch.compiler.is_compiling():
        return torch.ops.parallel_lora.dropout_seed(like, offset)
    device = like.device
    if device.type == "cpu":
        return int(torch.randint(offset, offset + SEED_BOUND, (1,), dtype=torch.int64).item())
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return generator_seed(torch.cuda.default_generators[index], offset)
    return torch.randint(offset, offset + SEED_BOUND, (1,), dtype=torch.int64, device=device)


def _dropout_seed_op(like: torch.Tensor, offset: int = 0) -> torch.Tensor:
    seed = draw_seed(like, offset)  # the eager call's seed; drawn on the device in CUDA graph capture
    return seed if isinstance(seed, torch.Tensor) else seed_tensor(seed, like.device)


def _dropout_seed_fake(like: torch.Tensor, offset: int = 0) -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64, device=like.device)


# The draw as torch.compile sees it (docs/design.md, "Dropout seeds"); ``like`` gives the replay its device.
define("dropout_seed", "(Tensor like, int offset=0) -> Tensor", _dropout_seed_op, _dropout_seed_fake,
       tags=(torch.Tag.nondeterministic_seeded,))  # fmt: skip


class CallSeeds:
    """A layer's seeds by tag: a call keeps its ``seed`` under ``tag``, a checkpoint rerun in backward gets it back
    (an int seed is its own tag: then the rerun checks that it drew its forward's seed)."""

    # Calls of one layer whose rerun may still be to come: micro-batches in flight times calls per forward.
    KEPT = 64

    def __init__(self) -> None:
        self._seeds: OrderedDict[int, torch.Tensor | int] = OrderedDict()

    def __call__(self, seed: torch.Tensor | int, tag: int) -> torch.Tensor | int:
        # -1 outside a backward pass, as torch.utils.checkpoint tests it.
        if torch._C._current_graph_task_id() == -1:
            self._seeds[tag] = seed
            self._seeds.move_to_end(tag)
            while len(self._seeds) > self.KEPT:
                self._seeds.popitem(last=False)
            return seed
        seed = self._seeds.get(tag)
        if seed is None:
            raise RuntimeError(
                "LoRA dropout: a forward call inside the backward pass (an activation-checkpoint rerun) matches none "
                f"of this layer's last {self.KEPT} forward calls, so it cannot draw its forward's mask again (dB "
                "would be computed under another mask). Either the checkpoint did not restore the generators "
                "(use preserve_rng_state=True, the default of torch.utils.checkpoint; torchtitan's "
                "activation_checkpoint.preserve_rng_state defaults to False), or more calls of this "
                "layer ran between a forward and its rerun (raise parallel_lora._dropout.CallSeeds.KEPT)."
            )
        return seed


class DropoutStream:
    """A layer's seeds: ``next_seed(x)`` draws one per call, its forward's in a checkpoint rerun; ``offset`` (below
    2**62) is added to each, so that streams that must not share masks take different offsets."""

    def __init__(self, offset: int = 0) -> None:
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < SEED_BOUND:
            raise ValueError(f"offset must be an int in [0, 2**62), got {offset!r}")
        self.offset = offset
        self._calls = CallSeeds()

    def next_seed(self, x: torch.Tensor) -> torch.Tensor | int:
        """This forward call's seed (``draw_seed``) for the layer's input ``x``."""
        seed = draw_seed(x, self.offset)
        if isinstance(seed, int):
            return self._calls(seed, seed)
        if torch.compiler.is_compiling():
            return seed
        return self._calls(seed, new_seed())  # CUDA graph capture: the CPU generator's tag
