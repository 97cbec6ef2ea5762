"""The one multi-rank test helper: a pool of spawned ranks reused across tests, meshes, and collective recorders.

Why a pool rather than ``DTensorTestBase``: ``MultiProcessTestCase`` spawns ``world_size`` fresh interpreters
for *every* test method (~5-10 s each on a small CPU box), which would dominate the suite. Here each
``(world_size, backend)`` pair is spawned once per pytest session; a test sends a module-level function to
every rank and gets back each rank's return value, or an ``AssertionError`` carrying every failing rank's
traceback. After any failure or timeout the pool is torn down (a rank may be stuck in a collective) and the
next test starts a fresh one, so one broken test cannot poison the next.

On CPU the ranks use gloo; with ``backend="nccl"`` rank ``i`` runs on ``cuda:i`` (GPU tests only). Rank
functions see the usual ``torch.distributed`` world (``dist.get_rank()``), are seeded with
``torch.manual_seed(0)`` before each call, and get meshes from ``mesh(...)`` (cached per process, so tests do
not pile up process groups). torch's private testing utilities are not needed; if one ever is, import it here.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

_STARTUP_TIMEOUT_S = 180.0
_FORK_STARTUP_TIMEOUT_S = 60.0  # a forked rank needs ~1 s; past this, retry with spawn
_COLLECTIVE_TIMEOUT_S = 60.0  # gloo/NCCL timeout inside the ranks: a rank stuck in a collective errors out
_CALL_TIMEOUT_S = 150.0
_GRACE_S = 5.0  # after one rank fails, how long the others get to report before the pool is killed


# --------------------------------------------------------------------------------------------------- ranks
def _worker(rank: int, world_size: int, init_file: str, backend: str, conn) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=_COLLECTIVE_TIMEOUT_S),
    )
    conn.send(("ready", None))
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            fn, args, kwargs = msg
            torch.manual_seed(0)
            try:
                conn.send(("ok", fn(*args, **kwargs)))
            except BaseException:  # noqa: B036 - report everything, the parent decides
                conn.send(("err", traceback.format_exc()))
    finally:
        dist.destroy_process_group()
        conn.close()
        # A forked rank must not run the parent's atexit handlers (they would close the parent's pools).
        os._exit(0)


class _Pool:
    def __init__(self, world_size: int, backend: str, start_method: str | None = None) -> None:
        self.world_size, self.backend = world_size, backend
        self._tmp = tempfile.mkdtemp(prefix="parallel_lora_dist_")
        # CPU ranks fork the test process (torch is already imported: start-up is ~1 s instead of ~5-10 s of CPU
        # per rank); CUDA ranks must spawn (a CUDA runtime does not survive fork).
        start_method = start_method or ("spawn" if backend == "nccl" else "fork")
        ctx = mp.get_context(start_method)
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker, args=(rank, world_size, os.path.join(self._tmp, "store"), backend, child), daemon=True
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        limit = _FORK_STARTUP_TIMEOUT_S if start_method == "fork" else _STARTUP_TIMEOUT_S
        self._collect(f"start-up ({start_method})", limit)

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return self._collect(getattr(fn, "__qualname__", repr(fn)), timeout)

    def _collect(self, what: str, timeout: float) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            for conn in connection.wait(list(pending.values()), timeout=deadline - now):
                rank = self._conns.index(conn)
                del pending[rank]
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    status, value = "err", f"rank {rank} died (exit code {self._procs[rank].exitcode})"
                if status == "err":
                    errors[rank] = value
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
                else:
                    results[rank] = value
        if errors or pending:
            self.close()
            parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
            if pending:
                parts.append(f"ranks {sorted(pending)} did not answer within the time limit (stuck in a collective?)")
            raise AssertionError(f"{what} failed on {self.world_size} ranks ({self.backend}):\n" + "\n".join(parts))
        return results

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        shutil.rmtree(self._tmp, ignore_errors=True)
        _POOLS.pop((self.world_size, self.backend), None)


_POOLS: dict[tuple[int, str], _Pool] = {}


@atexit.register
def _close_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()


def run_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, backend: str = "gloo", timeout: float = _CALL_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank of a ``world_size`` pool; return the per-rank results.

    ``fn`` must be a module-level function of a test module (it is pickled by name); its arguments and
    return value must pickle. Raises ``AssertionError`` with every failing rank's traceback.
    """
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} CUDA devices, found {torch.cuda.device_count()}")
    key = (world_size, backend)
    if key not in _POOLS:
        try:
            _POOLS[key] = _Pool(world_size, backend)
        except AssertionError:
            if backend == "nccl":
                raise
            # A fork can inherit a lock held by another thread of the test process; spawn never does.
            _POOLS[key] = _Pool(world_size, backend, start_method="spawn")
    return _POOLS[key].run(fn, args, kwargs, timeout)


# ------------------------------------------------------------------------------------ helpers on the ranks
_MESHES: dict[tuple, DeviceMesh] = {}


def device_type() -> str:
    """The device of this pool's ranks: ``"cuda"`` under NCCL, else ``"cpu"``."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device_type() == "cuda" else torch.device("cpu")


def mesh(shape: tuple[int, ...] | None = None, names: tuple[str, ...] | None = None) -> DeviceMesh:
    """A (cached) mesh over the whole world; default 1-D ``("tp",)``."""
    shape = shape or (dist.get_world_size(),)
    names = names or (("tp",) if len(shape) == 1 else tuple(f"d{i}" for i in range(len(shape))))
    key = (device_type(), shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type(), shape, mesh_dim_names=names)
    return _MESHES[key]


def all_gather_object(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def assert_same_on_all_ranks(t: torch.Tensor, what: str, group=None) -> None:
    """Bitwise: every rank of ``group`` holds exactly this tensor (values and dtype)."""
    t = t.detach().contiguous()
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(gathered, t, group=group)
    for rank, other in enumerate(gathered):
        if not torch.equal(other, gathered[0]):
            diff = (other.double() - gathered[0].double()).abs().max().item()
            raise AssertionError(f"{what}: rank {rank} differs from rank 0 (max |diff| {diff:.3e})")


@dataclass(frozen=True)
class Collective:
    op: str  # e.g. "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"
    dtype: torch.dtype
    shape: tuple[int, ...]


# In-place c10d collectives under the functional collectives' names: the layers' all-reduces are in-place
# (``parallel_lora.tp._comm.all_reduce``); their gathers and reduce-scatters are functional.
C10D_NAMES = {"allreduce_": "all_reduce"}


def collective_name(namespace: str, opname: str) -> str | None:
    """The collective an op issues under one name, or None for bookkeeping ops (wait_tensor,
    _wrap_tensor_autograd, barriers) that move no data."""
    if namespace == "_c10d_functional" and opname != "wait_tensor" and not opname.startswith("_"):
        return opname
    if namespace == "c10d":
        return C10D_NAMES.get(opname)
    return None


class CollectiveRecorder(TorchDispatchMode):
    """Records the op, dtype and shape of the first tensor argument of every collective (functional or
    in-place c10d, under one name per collective) issued while active. Counts agree with ``CommDebugMode``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = collective_name(func.namespace, func._opname)
        if name is not None:
            first = args[0]
            if isinstance(first, (list, tuple)):
                first = first[0]
            self.calls.append(Collective(name, first.dtype, tuple(first.shape)))
        return func(*args, **(kwargs or {}))

    def counts(self) -> Counter:
        return Counter(c.op for c in self.calls)
