"""Counter-based dropout for the LoRA branch: the mask is a pure function of (seed, row, column).

Nothing x-sized is stored between forward and backward: both passes regenerate the keep-mask from the call's
seed, a 1-element int64 tensor on the operands' device (8 bytes).
Element ``(m, k)`` of the mask (global row ``m``, global column ``k``) is kept when
``hash_uniform(seed, m, k) >= p``, a 16-bit uniform cut from a cheap counter-based hash (see
``hash_uniform``): columns ``2j`` and ``2j + 1`` of a row share one 32-bit hash word, the low and the high half.
The eager path below and the Triton kernels (``parallel_lora.kernels.dropout_mask``) compute the same hash bit
for bit, so the two backends drop exactly the same elements, and a tensor-parallel shard that owns columns
``[k_offset, k_offset + K_local)`` sees the matching slice of the full mask.

Where seeds come from (``DropoutStream``): each call draws one from the device's default generator, on the device,
so nothing syncs with the host, a CUDA graph replays with a fresh seed (torch's generator advances its offset at each
replay), torch.compile traces the draw (``parallel_lora::dropout_seed``, a random op AOTAutograd saves, or replays
with the forward's generator state under activation checkpointing), and an eager checkpoint rerun gets its
forward's seed back.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch.library import custom_op

MASK32 = 0xFFFFFFFF  # the hash works on uint32: every intermediate is taken mod 2**32
# murmur3's fmix32 multipliers, and the 32-bit golden ratio (offsets the seed's low word).
FMIX_M1 = 0x85EBCA6B
FMIX_M2 = 0xC2B2AE35
GOLDEN32 = 0x9E3779B9
Word = torch.Tensor | int  # uint32 values: an int64 tensor of them, or a Python int


@dataclass(frozen=True)
class Dropout:
    """Dropout on the LoRA branch of one call: ``"pre"`` drops ``x [M, K]`` before ``A``, ``"post"`` drops
    ``x A^T [M, r]``; ``k_offset`` is a row-parallel shard's first global input column; ``seed`` is ``[1]`` int64 on
    the operands' device (``seed_tensor`` makes one from an int)."""

    p: float
    seed: torch.Tensor
    position: str = "pre"
    k_offset: int = 0

    def __post_init__(self) -> None:
        check_dropout(self.p, self.position, self.k_offset, "dropout.p")
        check_seed(self.seed)

    @property
    def keep_scale(self) -> float:
        return 1.0 / (1.0 - self.p)


# The kernels keep an element when its 16-bit uniform ``v`` (``u = v * 2**-16``) reaches ``ceil(p * 2**16)``
# (p in fp32), a threshold that must itself fit in 16 bits: p below ``1 - 2**-16`` (which fp32 represents
# exactly, so a p below it never rounds past it).
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


def check_seed(seed: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """``seed`` as the kernels read it, ``[1]`` int64 (on ``device`` when given); ``ValueError`` otherwise."""
    if not isinstance(seed, torch.Tensor) or seed.dtype != torch.int64 or seed.numel() != 1:
        got = f"a {seed.dtype} tensor of shape {list(seed.shape)}" if isinstance(seed, torch.Tensor) else repr(seed)
        raise ValueError(f"a dropout seed must be a 1-element int64 tensor (seed_tensor(int, device)), got {got}")
    if device is not None and seed.device != device:
        raise ValueError(f"the dropout seed must be on the operands' device {device}, got {seed.device}")
    return seed.reshape(1)


def _mul32(x: Word, c: int) -> Word:
    """``x * c mod 2**32`` for uint32 values ``x`` (int64 tensor or Python int) and a uint32 constant ``c``.

    A product of two uint32 values overflows int64, so ``c`` is split into 16-bit halves: ``x * lo < 2**48``
    and ``x * hi < 2**48``, and only the low 16 bits of ``x * hi`` survive the shift by 16. Exact on CPU and
    CUDA, no reliance on wrap-around."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def fmix32(x: Word) -> Word:
    """murmur3's 32-bit finalizer on uint32 values held in int64 (a bijection of ``[0, 2**32)`` with full
    avalanche: each input bit flips each output bit with probability ~1/2)."""
    x = x ^ (x >> 16)
    x = _mul32(x, FMIX_M1)
    x = x ^ (x >> 13)
    x = _mul32(x, FMIX_M2)
    return x ^ (x >> 16)


def hash_keys(seed: torch.Tensor | int) -> tuple[Word, Word]:
    """The per-call keys ``(k_row, k_col)``: a bijection of the 64-bit seed ``(lo, hi)`` (scalar work, once per
    kernel program) so that every seed bit, ``hi`` included, reaches both keys through a full avalanche::

        t     = fmix32(lo + GOLDEN32)
        k_row = fmix32(hi ^ t)
        k_col = fmix32(t + k_row)

    (invertible: ``t = fmix32^-1(k_col) - k_row``, then ``lo`` and ``hi``). ``seed``: a Python int or a 1-element
    int64 tensor (whose two's-complement bits are the seed mod 2**64, so both give the same keys): int keys, or,
    for a device tensor (or any tensor under torch.compile), ``[1]`` int64 tensors on its device."""
    if not isinstance(seed, torch.Tensor) or (seed.device.type == "cpu" and not torch.compiler.is_compiling()):
        seed = int(seed)  # a CPU tensor's value costs no sync: its keys are a few host-side integer ops
    lo, hi = seed & MASK32, (seed >> 32) & MASK32
    t = fmix32((lo + GOLDEN32) & MASK32)
    k_row = fmix32(hi ^ t)
    k_col = fmix32((t + k_row) & MASK32)
    return k_row, k_col


def hash_bits(seed: torch.Tensor | int, rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash ``h(m, w) = fmix32(fmix32(m ^ k_row) + fmix32(w ^ k_col))`` (uint32 arithmetic, ``+``
    mod 2**32) of broadcastable int64 index tensors (row ``m``, word ``w``), as int64 holding uint32 values.
    Word ``w`` of a row holds the uniforms of columns ``2w`` and ``2w + 1`` (``hash_uniform``).

    Cost: the row term is one hash per row and the word term one per word, so on an ``[M, N]`` tile only the
    add and the outer fmix32 run per word, i.e. per two elements (9 integer ops), plus each element's keep
    test on its half.

    Quality: ``fmix32(m ^ k_row)`` and ``fmix32(w ^ k_col)`` are keyed bijections with full avalanche, so
    neighbouring rows (words) get unrelated 32-bit values, with no period along either axis; the outer
    fmix32 (a bijection) then avalanches their sum, which breaks the additive structure ``R[m] + C[w]``:
    pairs of rows (columns) are uncorrelated and both halves of a word are uniform and independent (checked
    in tests/test_dropout.py: keep rate, row/column pair agreement, lags, periodicity, seed sensitivity).
    Keying both terms through ``hash_keys`` means two seeds give unrelated masks, not index-permuted copies of
    each other (which a raw ``w ^ seed_lo`` would give: seeds 0 and 1 would swap words pairwise). Not a
    cryptographic or crush-grade generator; ample for dropout masks.
    """
    k_row, k_col = hash_keys(seed)
    r = fmix32((rows & MASK32) ^ k_row)
    c = fmix32((words & MASK32) ^ k_col)
    return fmix32((r + c) & MASK32)


def hash_uniform(seed: torch.Tensor | int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Uniform fp32 in [0, 1): ``u = v * 2**-16``, with ``v`` the low 16 bits of ``h(m, c >> 1)`` for an even
    column ``c`` and the high 16 bits for an odd one (``h = hash_bits``, ``c`` taken mod 2**32).

    ``rows``/``cols`` are broadcastable int64 tensors of global row/column indices (taken mod 2**32), ``seed`` an int
    or a 1-element int64 tensor on their device (``hash_keys``). Every
    value is a multiple of 2**-16 below 1, exact in fp32: bit-exact with the Triton kernels' ``uniform_tile``. Two
    uniforms per hash halve the hashes, the kernels' integer work per element, against one wider uniform per hash;
    p then moves in steps of 2**-16 (the kept fraction is ``1 - ceil(p * 2**16) * 2**-16``).
    """
    cols = cols & MASK32
    h = hash_bits(seed, rows, cols >> 1)
    return ((h >> ((cols & 1) * 16)) & 0xFFFF).to(torch.float32) * 2.0**-16


def keep_mask(dropout: Dropout, rows: int, cols: int, device: torch.device | str) -> torch.Tensor:
    """Boolean keep-mask ``[rows, cols]`` for this call's dropped tensor (``x`` for "pre", ``x A^T`` for
    "post"), columns shifted by ``k_offset`` for "pre". A tensor seed keeps the hash on the device (no sync)."""
    offset = dropout.k_offset if dropout.position == "pre" else 0
    m = torch.arange(rows, device=device, dtype=torch.int64).unsqueeze(1)
    k = torch.arange(offset, offset + cols, device=device, dtype=torch.int64).unsqueeze(0)
    return hash_uniform(dropout.seed, m, k) >= dropout.p  # [rows, 1] and [1, cols]: one hash per row/word


# Seeds are drawn below 2**62: any int64 keys the hash alike; non-negative ones print and compare plainly.
SEED_BOUND = 2**62


def new_seed() -> int:
    """A fresh 62-bit int from the CPU default generator (no device sync, reproducible under
    ``torch.manual_seed``): the checkpoint tags of ``CallSeeds`` (drawn only outside compiled graphs)."""
    return int(torch.randint(0, SEED_BOUND, (1,), dtype=torch.int64).item())


def seed_tensor(seed: int, device: torch.device | str) -> torch.Tensor:
    """A host-side seed (any int, taken mod 2**64) as the 1-element int64 tensor the kernels read, on ``device``.

    A host-to-device copy at each call, so a CUDA graph would replay the captured value: capture with seeds from
    ``draw_seed`` / ``DropoutStream`` instead, which is why this raises while the current CUDA stream is capturing."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"LoRA dropout: a host-side seed ({seed}) cannot be captured in a CUDA graph: every replay would reuse "
            "its mask. Let the layer draw its seeds (parallel_lora._dropout.DropoutStream, or dropout_seed=None in "
            "lora_linear), or capture with dropout=0.0."
        )
    seed = int(seed) % 2**64
    return torch.tensor([seed - 2**64 if seed >= 2**63 else seed], dtype=torch.int64, device=device)


def draw_seed(like: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """A fresh seed, ``[1]`` int64 in ``[offset, offset + 2**62)``, drawn on ``like``'s device from its default
    generator (``like``'s values are not read) in one op: no host sync, and under CUDA graph capture a new value at
    every replay (the generator's offset advances per replay). ``offset + randint(0, 2**62)`` by the same generator
    state. Traced by torch.compile as the ``parallel_lora::dropout_seed`` op, which draws the same numbers (but
    where AOTAutograd recomputes it on CUDA: see ``DropoutStream``)."""
    if torch.compiler.is_compiling():
        return torch.ops.parallel_lora.dropout_seed(like, offset)
    return torch.randint(offset, offset + SEED_BOUND, (1,), dtype=torch.int64, device=like.device)


# The draw as torch.compile sees it: an opaque op, so Inductor runs torch's own generator exactly as the eager path
# does (a lowered randint would draw other numbers), tagged random, so AOTAutograd saves its output for backward
# and, where activation checkpointing recomputes it, replays it with the forward's generator state (which takes a
# tensor argument to find the device: hence ``like``).
@custom_op("parallel_lora::dropout_seed", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def _dropout_seed_op(like: torch.Tensor, offset: int = 0) -> torch.Tensor:
    return draw_seed(like, offset)


@_dropout_seed_op.register_fake
def _(like: torch.Tensor, offset: int = 0) -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64, device=like.device)


class CallSeeds:
    """One layer's dropout seed per forward call, drawn again when activation checkpointing reruns the call.

    ``torch.utils.checkpoint`` reruns a region's forward inside the backward pass to rebuild the tensors it did
    not keep. A layer that took a new seed there would rebuild ``S = s * drop(x) A^T`` under another mask than
    its forward used, and ``dB = dy^T S`` would come out silently wrong. Checkpointing restores the CPU
    generator before the rerun (``preserve_rng_state=True``, its default), so every call draws one tag from it
    (``new_seed``, or the caller's ``tag``, drawn likewise): a call outside backward is a new call, whose ``seed``
    (an int, or a seed tensor) is kept under its tag and returned; a call inside backward is a rerun and gets the
    seed kept under its tag instead, or an error if there is none. Each call draws exactly one tag either way, so
    the generator stays in step for the region's other random ops.
    """

    # Calls of one layer whose rerun may still be to come: micro-batches in flight times calls per forward.
    KEPT = 64

    def __init__(self) -> None:
        self._seeds: OrderedDict[int, torch.Tensor | int] = OrderedDict()

    def __call__(self, seed: torch.Tensor | int, tag: int | None = None) -> torch.Tensor | int:
        tag = new_seed() if tag is None else tag
        # The autograd engine's graph task of this thread: -1 outside a backward pass (checkpointing asks the same).
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
                "would be computed under another mask). Either the checkpoint did not restore the CPU generator "
                "(use preserve_rng_state=True, the default of torch.utils.checkpoint; torchtitan's "
                "activation_checkpoint.preserve_rng_state defaults to False), or more calls of this "
                "layer ran between a forward and its rerun (raise parallel_lora._dropout.CallSeeds.KEPT)."
            )
        return seed


class DropoutStream:
    """A layer's dropout seeds: a fresh device seed per forward call, its forward's again in a checkpoint rerun.

    ``next_seed(x) -> [1] int64`` on ``x``'s device. Eager: ``draw_seed`` (the device's default generator), kept
    under a tag from the CPU generator (``CallSeeds``; on the CPU the seed's own value, which costs no sync and no
    second draw), so that a rerun inside backward gets the forward's seed back, or a clear error where the
    checkpoint did not preserve the RNG state. A rerun draws too and drops the draw: the generators advance alike in
    the forward and its rerun, so the region's other random ops (``nn.Dropout``) rerun with their own masks. Under
    torch.compile: the ``parallel_lora::dropout_seed`` op, with no bookkeeping (AOTAutograd replays the draw with
    the forward's generator state where it recomputes a checkpointed region), so compiled and eager calls draw the
    same seeds; off the CPU the eager path's tags also advance the CPU generator, which compiled calls leave alone.
    On CUDA a recomputed draw runs on AOTAutograd's graph-safe generators instead (its own, seeded from the CPU
    generator at the graph's first call): fresh per call and the same in the recompute, not eager's numbers.

    Seeds follow the generator, as ``nn.Dropout``'s masks do: ``torch.manual_seed`` (or restoring its state)
    replays them, and two copies of a model draw alike from the same generator state. ``offset`` (an int below
    2**62, default 0) is added to every seed, inside the draw (one op): streams that must not share masks on
    generators in the same state (e.g. data-parallel replicas of a tensor-parallel layer) take different offsets.
    """

    def __init__(self, offset: int = 0) -> None:
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < SEED_BOUND:
            raise ValueError(f"offset must be an int in [0, 2**62), got {offset!r}")
        self.offset = offset
        self._calls = CallSeeds()

    def next_seed(self, x: torch.Tensor) -> torch.Tensor:
        """The seed of this forward call on ``x`` (the layer's input), ``[1]`` int64 on its device, in
        ``[0, 2**63)``."""
        seed = draw_seed(x, self.offset)
        if torch.compiler.is_compiling():
            return seed
        return self._calls(seed, int(seed.item()) if x.device.type == "cpu" else None)
