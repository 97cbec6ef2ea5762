"""Replacing a file or a directory as a whole: readers and crashes see the old contents or the new, never a mix."""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
from collections.abc import Iterable
from pathlib import Path

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


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
    """Make ``path`` a file holding ``data``, replacing what was there in one step: ``data`` is written and fsynced
    to a temporary file beside it, which ``os.replace`` renames over ``path``. Any failure before the rename
    leaves ``path`` untouched (and no temporary file)."""
    out = Path(path)
    tmp = out.parent / f".{out.name}.new-{secrets.token_hex(4)}"
    try:
        _write_synced(tmp, data)
        os.replace(tmp, out)
        _fsync_path(out.parent)  # the rename itself survives a power loss
    finally:
        tmp.unlink(missing_ok=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``). False where the system
    or the filesystem cannot; raises ``OSError`` for any other failure."""
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
    """Make ``path`` a directory holding exactly ``files`` (name -> contents), plus the existing entries named in
    ``keep`` (copied over), replacing what was there as a whole.

    The files are written and fsynced into a fresh sibling directory, which is then swapped with ``path`` in one
    atomic exchange (or renamed into place when ``path`` does not exist). Any failure before the swap leaves
    ``path`` untouched. Without an atomic exchange (not Linux, or a filesystem without it) the swap is two
    renames: a crash between them leaves the previous directory at ``.<name>.old-<hex>`` beside ``path``.
    """
    out = Path(path).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = secrets.token_hex(4)
    new = out.parent / f".{out.name}.new-{tag}"
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
            old = out.parent / f".{out.name}.old-{tag}"
            os.rename(out, old)
            os.rename(new, out)
            shutil.rmtree(old)
        _fsync_path(out.parent)  # the swap itself survives a power loss
    finally:
        shutil.rmtree(new, ignore_errors=True)  # after an exchange: the previous directory
