"""Each launch's config, chosen on the GPU at its first call per kernel variant, size bucket and dtypes
(``launch_tuned``), kept in memory and in a JSON file per GPU and Triton version (docs/kernels.md, "Tuning").
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import statistics
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import triton

from .._log import logger
from .host import keep_at_most, next_pow2
from .spec import KernelSpec

if TYPE_CHECKING:
    from triton.runtime.jit import JITFunction

Grid = Callable[[dict], tuple[int, ...]] | tuple[int, ...]


@functools.cache
def max_shared_mem(device_index: int) -> int:
    """Opt-in shared memory per block, in bytes, of CUDA device ``device_index``."""
    props = torch.cuda.get_device_properties(device_index)
    smem = getattr(props, "shared_memory_per_block_optin", None)
    if smem:
        return int(smem)
    from triton.runtime import driver

    return int(driver.active.utils.get_device_properties(device_index)["max_shared_mem"])


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index``."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


SMALL_WORK = 2**27  # multiply-adds (512^3) below which a launch takes one small config untimed
ATOMIC_SLOT = 128  # shared memory a scalar atomic's broadcast takes in the estimates (16 B compiled for sm_90)


def prune(
    spec: KernelSpec, configs: list[triton.Config], nargs: dict, smem_limit: int | None = None, **consts
) -> list[triton.Config]:
    """The configs within the device's shared memory and the problem's size; never empty (else the smallest)."""
    ref = nargs[spec.dtype_arg]
    if smem_limit is None:
        smem_limit = max_shared_mem(ref.device.index if ref.device.index is not None else 0)
    elem = ref.element_size()

    sizes = {**nargs, **consts}

    def need(c):
        return spec.smem(c.kwargs, c.num_stages, elem, sizes)

    fitting = [c for c in configs if need(c) <= smem_limit]
    sized = [c for c in fitting if spec.fits(c.kwargs, nargs)]
    kept = sized or fitting or [min(configs, key=need)]
    if spec.work(nargs) < SMALL_WORK:
        return [min(kept, key=need)]
    return kept


TUNE_ROUNDS = 5
TUNE_REPLAY_MS = 5.0


def fastest(n: int, time_one: Callable[[int], float], rounds: int = TUNE_ROUNDS) -> int:
    """The index (of ``n``) with the lowest median of ``time_one(i)`` over ``rounds`` rounds, round ``k`` starting at
    candidate ``k mod n``; ties go to the lower index."""
    times: list[list[float]] = [[] for _ in range(n)]
    for k in range(rounds):
        for j in range(n):
            times[(k + j) % n].append(time_one((k + j) % n))
    return min(range(n), key=lambda i: (statistics.median(times[i]), i))


# One side stream per device for the tuning graphs (per-stream workspaces are keyed by stream).
_TUNE_STREAMS: dict[int, torch.cuda.Stream] = {}


def replay_timer(call: Callable[[], object]) -> Callable[[], float]:
    """A timer of ``call`` (one compiled launch): ms per launch over one replay of a CUDA graph of ~``TUNE_REPLAY_MS``
    of back-to-back launches, captured in thread-local mode."""
    device = torch.cuda.current_device()
    if device not in _TUNE_STREAMS:
        _TUNE_STREAMS[device] = torch.cuda.Stream(device)
    stream = _TUNE_STREAMS[device]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        start.record()
        for _ in range(3):
            call()
        end.record()
        end.synchronize()
        calls = max(1, min(1000, int(TUNE_REPLAY_MS / max(start.elapsed_time(end) / 3, 1e-3))))
        # Not ``torch.cuda.graph``, which would collect garbage and empty the allocator's cache per candidate.
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            for _ in range(calls):
                call()
        finally:
            graph.capture_end()

    def time_one() -> float:
        with torch.cuda.stream(stream):
            start.record()
            graph.replay()
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls

    return time_one


def tune(spec: KernelSpec, kernel: JITFunction, grid: Grid, args: tuple, consts: dict) -> triton.Config:
    """The fastest config ``prune`` keeps for this launch, timed on ``args`` (so the kernel must not accumulate into
    its outputs); configs the compiler refuses are skipped."""
    from triton.runtime.errors import OutOfResources

    nargs = dict(zip(kernel.arg_names, args, strict=False))
    candidates = prune(spec, spec.configs(), nargs, **consts)
    if len(candidates) == 1:
        return candidates[0]
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{spec.name}: the first launch of a layer shape times {len(candidates)} candidate configs of its "
            "kernel, which cannot happen inside CUDA graph capture. Run one step eagerly (same shapes and "
            "dtypes) before capturing."
        )
    # Nothing else of ours may run meanwhile: the fused launches' sync buffers belong to the caller's stream.
    torch.cuda.current_stream().synchronize()
    timers, kept = [], []
    for cfg in candidates:
        call = functools.partial(kernel[grid], *args, **consts, **cfg.all_kwargs())
        try:
            call()
        except OutOfResources:
            continue
        timers.append(replay_timer(call))
        kept.append(cfg)
    if not kept:
        raise RuntimeError(f"{spec.name}: no config of {candidates} compiles for this launch")
    return kept[fastest(len(kept), lambda i: timers[i]())]


# ``best_key`` -> the chosen config, least recently used first; past ``BEST_MAX`` the oldest goes (the file keeps it).
_BEST: dict[tuple, triton.Config] = {}
BEST_MAX = 512
_TUNING_LOCK = threading.Lock()

# fmt: off


@functools.cache
def _key_positions(spec: KernelSpec, kernel: JITFunction) -> tuple[int, ...]:
    return tuple(kernel.arg_names.index(k) for k in spec.key)


def bucketed_sizes(spec: KernelSpec, kernel: JITFunction, args: tuple) -> tuple[int, ...]:
    """The key sizes of a launch with the token count ``M`` (always first) rounded up to a power of two."""
    m, *rest = (args[i] for i in _key_positions(spec, kernel))
    return (next_pow2(m), *rest)


def best_key(spec: KernelSpec, kernel: JITFunction, args: tuple, consts: dict) -> tuple:
    """The ``_BEST`` key of a launch: kernel, constexprs, device, size bucket and tensor dtypes."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return (spec.name, kernel.__name__, tensors[0].device, bucketed_sizes(spec, kernel, args),
            tuple(t.dtype for t in tensors), tuple(consts.items()))


def launch_tuned(
    spec: KernelSpec, kernel: JITFunction, grid: Grid, args: tuple, consts: dict
) -> tuple[triton.compiler.CompiledKernel, triton.Config]:
    """Launch with the bucket's config (memory, else the file, else ``tune``); returns ``(compiled kernel, config)``."""
    key = best_key(spec, kernel, args, consts)
    # Autograd's device thread may launch meanwhile; one tuning at a time keeps the timings clean.
    with _TUNING_LOCK:
        cfg = _BEST.pop(key, None)  # re-inserted below: the most recently used entry is the last
        if cfg is None:
            cfg = _cached_or_tuned(spec, kernel, grid, args, consts)
        keep_at_most(_BEST, key, cfg, BEST_MAX)
        compiled = kernel[grid](*args, **consts, **cfg.all_kwargs())
    return compiled, cfg


CACHE_ENV = "PARALLEL_LORA_CACHE_DIR"
_FORMAT = 1  # the file's layout; a file of another is read as empty and rewritten
_WARNED: set[str] = set()


def cache_dir() -> Path:
    """The tuning cache's folder: ``$PARALLEL_LORA_CACHE_DIR/tuning``, else ``~/.cache/parallel_lora/tuning``."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "parallel_lora"
    return Path(root) / "tuning"


def gpu_tag(device_index: int) -> str:
    """The GPU's name and compute capability as a file name part, e.g. ``nvidia-h100-80gb-hbm3-sm90``."""
    name = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device_index).lower()).strip("-")
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"{name}-sm{major}{minor}"


def cache_file(device_index: int) -> Path:
    """The file of the configs tuned on this GPU kind under this Triton version."""
    return cache_dir() / f"{gpu_tag(device_index)}-triton{triton.__version__}.json"


def config_to_json(cfg: triton.Config) -> dict:
    """A ``triton.Config`` as plain JSON values (``config_from_json`` reads it back)."""
    return {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "num_ctas": getattr(cfg, "num_ctas", 1), "maxnreg": getattr(cfg, "maxnreg", None)}


def config_from_json(data: dict) -> triton.Config:
    """The ``triton.Config`` that ``config_to_json`` wrote; raises KeyError or TypeError on a malformed entry."""
    return triton.Config(dict(data["kwargs"]), num_warps=data["num_warps"], num_stages=data["num_stages"],
                         num_ctas=data["num_ctas"], maxnreg=data["maxnreg"])


@functools.cache
def _configs_digest(spec: KernelSpec) -> str:
    listed = json.dumps([config_to_json(c) for c in spec.configs()], sort_keys=True)
    return hashlib.sha256(listed.encode()).hexdigest()[:12]


def cache_key(spec: KernelSpec, kernel: JITFunction, args: tuple, consts: dict) -> str:
    """``best_key`` without the device index, plus hashes of the kernel's source and of its config list."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    sizes = ",".join(f"{k}={v}" for k, v in zip(spec.key, bucketed_sizes(spec, kernel, args), strict=True))
    dtypes = ",".join(str(t.dtype).removeprefix("torch.") for t in tensors)
    flags = ",".join(f"{k}={v!r}" for k, v in consts.items())
    source = str(getattr(kernel, "cache_key", ""))[:12]
    return f"{spec.name} {kernel.__name__}@{source} [{flags}] {sizes} {dtypes} configs@{_configs_digest(spec)}"


def _warn_once(path: Path, message: str) -> None:
    if str(path) not in _WARNED:
        _WARNED.add(str(path))
        logger.warning(message)


def read_cache(path: Path) -> dict[str, dict]:
    """The entries of a cache file: empty if it is missing, or unreadable (said once per file, in one line)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as err:
        _warn_once(path, f"parallel_lora: cannot read the tuning cache {path} ({err}); tuning again")
        return {}
    try:
        data = json.loads(text)
        entries = data["configs"]
        if data["format"] != _FORMAT or not isinstance(entries, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        _warn_once(path, f"parallel_lora: the tuning cache {path} is corrupt; tuning again and rewriting it")
        return {}
    return entries


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path``'s ``.lock`` file, across processes (none where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_cache(path: Path, key: str, cfg: triton.Config) -> None:
    """Add ``key -> cfg`` to the cache file: merged and replaced atomically under a file lock."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(path):
            entries = {**read_cache(path), key: config_to_json(cfg)}
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"format": _FORMAT, "triton": triton.__version__, "configs": entries}, f,
                              indent=1, sort_keys=True)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
    except OSError as err:
        _warn_once(path, f"parallel_lora: cannot write the tuning cache {path} ({err}); configs stay in memory")


def _cached_or_tuned(spec: KernelSpec, kernel: JITFunction, grid: Grid, args: tuple, consts: dict) -> triton.Config:
    """The cache file's config for this launch, else ``tune``'s, which is then added to the file."""
    device = next(a for a in args if isinstance(a, torch.Tensor)).device
    path = cache_file(device.index or 0)
    key = cache_key(spec, kernel, args, consts)
    entry = read_cache(path).get(key)
    if entry is not None:
        try:
            return config_from_json(entry)
        except (KeyError, TypeError):
            _warn_once(path, f"parallel_lora: the tuning cache {path} is corrupt; tuning again and rewriting it")
    cfg = tune(spec, kernel, grid, args, consts)
    write_cache(path, key, cfg)
    return cfg
