"""Replacing a file or a directory as a whole, and removing what killed writers left (docs/checkpoints.md)."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Iterable
from pathlib import Path

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>
HOST = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "localhost"
_TAG = r"(?P<pid>\d+)@(?P<host>[A-Za-z0-9._-]+)"
_TEMPORARY = re.compile(rf"^\.(?P<target>.+)\.(?P<kind>new|old)-[0-9a-f]{{8}}(?:-{_TAG})?$")


def writer_tag() -> str:
    """``<pid>@<host>`` of this process, which the temporaries it writes carry."""
    return f"{os.getpid()}@{HOST}"


def _started_at(pid: int) -> float | None:
    """When process ``pid`` started (epoch seconds, to about a second), where Linux's /proc tells."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the parenthesised command name
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def writer_gone(tag: str | None, since: float | None = None) -> bool:
    """Whether the writer ``tag`` (``<pid>@<host>``, None: untagged) is gone; another host's never is."""
    if tag is None:
        return True
    match = re.fullmatch(_TAG, tag)
    if match is None or match["host"] != HOST:
        return False
    pid = int(match["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        pass
    started = _started_at(pid) if since is not None else None
    return started is not None and started > since + 1.0  # /proc's boot time has one-second resolution


def _last_write(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()


def is_stale(path: Path, tag: str | None) -> bool:
    """Whether the temporary ``path``, written by ``tag``, is left over: its writer is gone."""
    return writer_gone(tag, since=_last_write(path))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Remove and return the temporaries of ``path`` whose writer is gone (an ``.old-`` one only if ``path`` exists)."""
    out = Path(path)
    if not out.parent.is_dir():
        return []
    removed = []
    for p in sorted(out.parent.iterdir()):
        m = _TEMPORARY.match(p.name)
        if m is None or m["target"] != out.name or (m["kind"] == "old" and not out.exists()):
            continue
        if is_stale(p, f"{m['pid']}@{m['host']}" if m["pid"] else None):
            _remove(p)
            removed.append(p)
    return removed


def _temporary(out: Path, kind: str, tag: str) -> Path:
    return out.parent / f".{out.name}.{kind}-{tag}-{writer_tag()}"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_file(path: str | os.PathLike, data: bytes) -> None:
    """Make ``path`` a file holding ``data`` in one atomic, fsynced rename; a failure leaves ``path`` untouched."""
    out = Path(path)
    remove_stale_temporaries(out)
    tmp = _temporary(out, "new", secrets.token_hex(4))
    try:
        _write_synced(tmp, data)
        os.replace(tmp, out)
        _fsync_path(out.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (``renameat2(RENAME_EXCHANGE)``); False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError, TypeError):  # not glibc / not Linux
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_directory(path: str | os.PathLike, files: dict[str, bytes], keep: Iterable[str] = ()) -> None:
    """Make ``path`` a directory holding exactly ``files`` (name -> bytes) and the entries named in ``keep``, swapped
    in as a whole; a failure before the swap leaves ``path`` untouched."""
    out = Path(path).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    tag = secrets.token_hex(4)
    new = _temporary(out, "new", tag)
    new.mkdir()
    try:
        for name, data in files.items():
            _write_synced(new / name, data)
        for name in keep:
            if name not in files and (out / name).is_file():
                shutil.copy2(out / name, new / name)
        _fsync_path(new)
        if not out.exists():
            os.rename(new, out)
        elif not _exchange(new, out):
            old = _temporary(out, "old", tag)
            os.rename(out, old)
            os.rename(new, out)
            shutil.rmtree(old)
        _fsync_path(out.parent)
    finally:
        shutil.rmtree(new, ignore_errors=True)  # after an exchange, the previous directory
