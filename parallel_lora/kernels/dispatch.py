"""The fused LoRA op on one device (one TP shard): operand checks, the choice of launches, the launches.

Operands in one compute dtype (fp32, fp16 or bf16), the adapters in theirs; the math, the two paths and their
launches: docs/kernels.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .._dropout import Dropout, check_seed
from . import replay
from .adapter_grads import lora_adapter_grads
from .dx_grads import lora_dx_and_grads
from .gemm import lora_gemm
from .gemm_tma import tma_compatible, tma_operand
from .host import interpreting, keep_at_most, pad_rank
from .launcher import Site
from .program import Programs
from .shrink import lora_shrink
from .shrink_db import lora_shrink_db, takes_db_partials
from .shrink_gemm import MAX_FUSED_R_PAD, MAX_FUSED_WIDE_R_PAD, lora_shrink_gemm, programs, spares_keep_pace

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The largest rank: every kernel's fallback config fits ~100 KB of shared memory up to it, even in fp32.
MAX_RANK = 256


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


_LABELS = {
    "x": ("M", "K"), "dy": ("M", "N"), "weight": ("N", "K"), "bias": ("N",), "lora_A": ("r", "K"),
    "lora_B": ("N", "r"), "s_lora": ("M", "r"),
}


_ADAPTERS = ("lora_A", "lora_B")


def _check_tensors(named: dict[str, torch.Tensor | None], expected: dict[str, tuple[int, ...]]) -> None:
    """Every tensor: a Tensor of the expected sizes on one device; the adapters in one dtype, the rest in another."""
    dtype = device = None
    adapter_dtype = named["lora_A"].dtype
    for name, t in named.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        want = expected[name]
        if t.shape != want:
            labels = _LABELS[name]
            sizes = ", ".join(f"{label}={n}" for label, n in zip(labels, want, strict=True))
            raise ValueError(f"{name} must have shape [{', '.join(labels)}] ({sizes}), got {_shape(t)}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        if name in _ADAPTERS:
            if t.dtype != adapter_dtype:
                raise ValueError(f"lora_A and lora_B must share one dtype (the caller casts), got {adapter_dtype} "
                                 f"and {t.dtype}")  # fmt: skip
        elif dtype is None:
            dtype, first = t.dtype, name
        elif t.dtype != dtype:
            raise ValueError(
                f"every operand but the adapters must share one dtype (the caller casts): {first} is {dtype}, "
                f"{name} is {t.dtype}"
            )
        if device is None:
            device, first_device = t.device, name
        elif t.device != device:
            raise ValueError(f"all operands must be on one device: {first_device} on {device}, {name} on {t.device}")
    if device is not None and device.type != "cuda" and not interpreting():
        raise ValueError(f"the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got device {device}")


def _check_sizes(x, weight, lora_A, lora_B) -> tuple[int, int, int, int]:
    for name, t in (("x", x), ("weight", weight), ("lora_A", lora_A), ("lora_B", lora_B)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            got = _shape(t) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 2-D tensor, got {got}")
    return x.shape[0], x.shape[1], weight.shape[0], lora_A.shape[0]


def _check_kernel(x: torch.Tensor, lora_A: torch.Tensor) -> int:
    """What the kernels take beyond the op's shapes: the rank and the compute dtype."""
    if x.dtype not in _DTYPES:
        raise ValueError(f"the Triton kernels compute in float32, float16 or bfloat16, got {x.dtype}")
    r = lora_A.shape[0]
    if not 1 <= r <= MAX_RANK:
        raise ValueError(f"the LoRA rank r = lora_A.shape[0] must be in [1, {MAX_RANK}], got {r}")
    return r


def _check_forward(x, weight, bias, lora_A, lora_B) -> None:
    M, K, N, r = _check_sizes(x, weight, lora_A, lora_B)
    _check_tensors(
        {"x": x, "weight": weight, "bias": bias, "lora_A": lora_A, "lora_B": lora_B},
        {"x": (M, K), "weight": (N, K), "bias": (N,), "lora_A": (r, K), "lora_B": (N, r)},
    )


def _check_backward(dy, x, weight, lora_A, lora_B, s_lora) -> None:
    M, K, N, r = _check_sizes(x, weight, lora_A, lora_B)
    _check_tensors(
        {"dy": dy, "x": x, "weight": weight, "lora_A": lora_A, "lora_B": lora_B, "s_lora": s_lora},
        {"dy": (M, N), "x": (M, K), "weight": (N, K), "lora_A": (r, K), "lora_B": (N, r), "s_lora": (M, r)},
    )


def _check_call(scale: float, dropout: Dropout | None, x) -> None:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    if dropout is not None and not isinstance(dropout, Dropout):
        raise ValueError(f"dropout must be a parallel_lora._dropout.Dropout or None, got {dropout!r}")
    if dropout is not None and dropout.p > 0.0 and isinstance(x, torch.Tensor):
        check_seed(dropout.seed, x.device)


def _device_key(x: torch.Tensor) -> tuple[int, int]:
    """x's device index and the current CUDA device (a kernel is loaded and launched on the current one)."""
    index = x.get_device()
    return index, torch._C._cuda_getDevice() if index >= 0 else -1  # torch.cuda.current_device() minus its wrapper


def _layout(t: torch.Tensor | None) -> tuple | None:
    """Everything about an operand that its checks and its kernels' launches depend on, but its address."""
    if t is None:
        return None
    # Triton specializes pointers on 16-byte alignment; get_device() is -1 on the CPU (the interpreter).
    return t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16


def mask_key(mode: str | None, k_offset: int) -> tuple | None:
    """What launches compile for of a call's mask (``mode``, None without one): it and "pre"'s ``k_offset`` parity."""
    if mode is None:
        return None
    return mode, mode == "pre" and k_offset % 2 == 1


def forward_key(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    mask: tuple | None,
) -> tuple:
    """The ``_FORWARD_SITES`` key: the devices, every operand's layout and the dropout's ``mask_key``."""
    return _device_key(x), _layout(x), _layout(weight), _layout(bias), _layout(lora_A), _layout(lora_B), mask


def backward_key(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    s_lora: torch.Tensor,
    mask: tuple | None,
    *needs: bool,
) -> tuple:
    """The ``_BACKWARD_SITES`` key: as ``forward_key``, plus which gradients are wanted."""
    return (_device_key(dy), _layout(dy), _layout(x), _layout(weight), _layout(lora_A), _layout(lora_B),
            _layout(s_lora), mask, *needs)


# launch sites by checked layout, for callers without a plan (the compiled op, direct calls)
SITES_KEPT = 256
_FORWARD_SITES: dict[tuple, tuple[tuple, dict]] = {}  # (forward_entry, its Programs by (scale, p, k_offset))
_BACKWARD_SITES: dict[tuple, tuple[tuple, dict]] = {}


def clear_sites() -> None:
    """Forget every layout's launch sites (callers without a plan): the next calls check and choose again."""
    _FORWARD_SITES.clear()
    _BACKWARD_SITES.clear()
    replay.forget()


def _programs(kept: tuple, *scalars: float) -> Programs:
    """A kept layout's programs for one call's ``(scale, p, k_offset)``: constants of a recorded call."""
    programs = kept[1].get(scalars)
    return keep_at_most(kept[1], scalars, Programs(), 8) if programs is None else programs


def kept_programs(key_of: Callable, operands: tuple, scale: float, dropout: Dropout | None,
                  *needs: bool) -> Programs | None:
    """The ``Programs`` a call without a plan records into (``forward_key`` / ``backward_key`` its sites' key), None
    while its layout is not kept."""
    _, p, _, k_offset, key = _prologue(scale, dropout, key_of, operands, needs)
    sites = _FORWARD_SITES if key_of is forward_key else _BACKWARD_SITES
    kept = sites.get(key)
    return None if kept is None else _programs(kept, float(scale), p, k_offset)


def _y_operand(weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """W as the TMA GEMM reads it for y (``w = W^T``, as ``gemm.lora_gemm`` is called)."""
    return tma_operand(weight.t())


def _y_takes_fused(x: torch.Tensor, weight: torch.Tensor, lora_A: torch.Tensor, mode: str | None) -> bool:
    # Empty problems, large ranks, adapters wider than x above r16, the "pre" mask and outputs too narrow for the
    # spare programs to keep pace stay on the separate launches (docs/kernels.md says why).
    r_pad = pad_rank(lora_A.shape[0])
    if x.numel() == 0 or weight.numel() == 0 or r_pad > MAX_FUSED_R_PAD or mode == "pre":
        return False
    if r_pad > MAX_FUSED_WIDE_R_PAD and lora_A.element_size() > x.element_size():
        return False
    if not tma_compatible(x, _y_operand(weight)[0], weight.shape[0]):
        return False
    return spares_keep_pace(x.shape[0], weight.shape[0], x.element_size(), programs(x), lora_A.element_size())


def _dx_operand(weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """W as the TMA GEMM reads it for dx (``w = W``, as ``gemm.lora_gemm`` is called)."""
    return tma_operand(weight)


def _dx_takes_fused(dy: torch.Tensor, weight: torch.Tensor) -> bool:
    return dy.numel() > 0 and weight.numel() > 0 and tma_compatible(dy, _dx_operand(weight)[0], weight.shape[1])


def _prologue(scale: float, dropout: Dropout | None, key_of: Callable[..., tuple], operands: tuple, needs=()):
    """Check a direct call's scalars -> ``(mode, p, seed, "pre" k_offset or 0, sites key or None)``."""
    _check_call(scale, dropout, operands[0])
    if dropout is None or dropout.p == 0.0:  # p == 0 keeps every element: no mask at all
        mode, p, seed, k_offset = None, 0.0, None, 0
    else:
        mode, p, seed = dropout.position, float(dropout.p), dropout.seed
        k_offset = dropout.k_offset if mode == "pre" else 0
    try:
        key = key_of(*operands, mask_key(mode, k_offset), *needs)
    except AttributeError:
        key = None
    return mode, p, seed, k_offset, key


def forward_entry(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_A: torch.Tensor, lora_B: torch.Tensor,
    mode: str | None,
) -> tuple[Site, Site, bool | None]:
    """A checked forward layout's launches: ``(site, site, w_nk)``, ``w_nk`` None for separate launches."""
    _check_kernel(x, lora_A)
    return Site(), Site(), _y_operand(weight)[1] if _y_takes_fused(x, weight, lora_A, mode) else None


def run_forward(
    entry: tuple, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_A: torch.Tensor,
    lora_B: torch.Tensor, scale: float, p: float, seed: torch.Tensor | int | None, mode: str | None, k_offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The launches of a checked layout (``forward_entry``): ``mode`` is the active mask's position or None."""
    drop_kw = {} if mode is None else {"p": p, "seed": seed}
    site_s, site_y, w_nk = entry
    if w_nk is not None:
        return lora_shrink_gemm(
            x, weight if w_nk else weight.t(), w_nk, bias, lora_A, lora_B, scale, drop_post=mode == "post",
            **drop_kw, site=site_s,
        )
    s_lora = lora_shrink(
        x, lora_A.t(), scale, drop_pre=mode == "pre", drop_post=mode == "post", k_offset=k_offset, **drop_kw,
        site=site_s,
    )
    return lora_gemm(x, weight.t(), bias, s_lora, lora_B.t(), site=site_y), s_lora


def forward(x, weight, bias, lora_A, lora_B, scale, dropout=None):
    """Without a plan: ``x [M, K]``, ``W [N, K]``, ``b [N]``, ``A [r, K]``, ``B [N, r]`` -> ``y [M, N], S [M, r]``."""
    operands = (x, weight, bias, lora_A, lora_B)
    mode, p, seed, k_offset, key = _prologue(scale, dropout, forward_key, operands)
    kept = _FORWARD_SITES.get(key)
    if kept is not None:
        entry = kept[0]
        call = lambda: run_forward(entry, *operands, float(scale), p, seed, mode, k_offset)  # noqa: E731
        return _programs(kept, float(scale), p, k_offset).run(call, operands, seed)
    _check_forward(*operands)
    entry = forward_entry(*operands, mode)
    out = run_forward(entry, *operands, float(scale), p, seed, mode, k_offset)
    if key is not None:  # stored once filled: another thread never reads a half-bound site
        keep_at_most(_FORWARD_SITES, key, (entry, {}), SITES_KEPT)
    return out


def backward_entry(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
    s_lora: torch.Tensor, mode: str | None, needs_dx: bool, needs_dA: bool, needs_dB: bool,
) -> tuple:
    """A checked backward layout's launches: ``(site, site, site, w_nk, db_in_g)``."""
    _check_kernel(x, lora_A)
    fused = needs_dx and (needs_dA or needs_dB) and _dx_takes_fused(dy, weight)
    # Not under "pre" dropout: there the masked dA items set the launch's tail, and dB's are no longer in it.
    db_in_g = fused and needs_dB and mode != "pre" and takes_db_partials(*dy.shape, pad_rank(lora_A.shape[0]))
    return Site(), Site(), Site(), _dx_operand(weight)[1] if fused else None, db_in_g


def run_backward(
    entry: tuple, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, lora_A: torch.Tensor,
    lora_B: torch.Tensor, s_lora: torch.Tensor, scale: float, p: float, seed: torch.Tensor | int | None,
    mode: str | None, k_offset: int, needs_dx: bool, needs_dA: bool, needs_dB: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The launches of a checked layout (``backward_entry``); dx in the compute dtype, dA and dB in the adapters'."""
    site_g, site_dx, site_ab, w_nk, db_in_g = entry
    pre = mode == "pre"
    drop_kw = {} if mode is None else {"p": p, "seed": seed}
    dx = dA = dB = None
    g, pdb, blocks = None, None, 0
    if db_in_g:
        g, pdb, blocks = lora_shrink_db(dy, lora_B, s_lora, scale, drop_post=mode == "post", **drop_kw, site=site_g)
    elif needs_dx or needs_dA:
        g = lora_shrink(dy, lora_B, scale, drop_post=mode == "post", **drop_kw, site=site_g)
    if w_nk is not None:
        dx, dA, dB = lora_dx_and_grads(
            dy, weight.t() if w_nk else weight, w_nk, g, lora_A, x if needs_dA else None,
            s_lora if needs_dB and not db_in_g else None, lora_drop=pre, k_offset=k_offset, db_partials=pdb,
            db_parts=blocks, like=lora_A, **drop_kw, site=site_dx,
        )
        return dx, dA, dB
    # dx before the adapter grads: the GPU runs the long GEMM while the host issues them (docs/kernels.md)
    if needs_dx:
        dx = lora_gemm(dy, weight, None, g, lora_A, lora_drop=pre, n_offset=k_offset, **drop_kw, site=site_dx)
    if needs_dA or needs_dB:
        dA, dB = lora_adapter_grads(
            x if needs_dA else None, g if needs_dA else None, dy if needs_dB else None,
            s_lora if needs_dB else None, drop_x=pre, f_offset=k_offset, like=lora_A, **drop_kw,
            site=site_ab,
        )
    return dx, dA, dB


def backward(dy, x, weight, lora_A, lora_B, s_lora, scale, dropout=None, needs_dx=True, needs_dA=True, needs_dB=True):
    """The backward without a plan: ``dy [M, N]``, the forward's operands -> ``(dx, dA, dB)``, None where unwanted."""
    operands = (dy, x, weight, lora_A, lora_B, s_lora)
    needs = (needs_dx, needs_dA, needs_dB)
    mode, p, seed, k_offset, key = _prologue(scale, dropout, backward_key, operands, needs)
    kept = _BACKWARD_SITES.get(key)
    if kept is not None:
        entry = kept[0]
        call = lambda: run_backward(entry, *operands, float(scale), p, seed, mode, k_offset, *needs)  # noqa: E731
        return _programs(kept, float(scale), p, k_offset).run(call, operands, seed)
    _check_backward(*operands)
    entry = backward_entry(*operands, mode, *needs)
    grads = run_backward(entry, *operands, float(scale), p, seed, mode, k_offset, *needs)
    if key is not None:
        keep_at_most(_BACKWARD_SITES, key, (entry, {}), SITES_KEPT)
    return grads
