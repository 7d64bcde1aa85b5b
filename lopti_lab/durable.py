"""Durable writes for run folders: what survives a kill or a power cut, and in which order it reaches the disk.

Three facts of POSIX file systems carry everything here. A rename inside one file system is atomic: a reader, or a run
resumed after a crash, sees the old file or the new one, never a mix. File data is on disk only once the file is
fsynced, and a new or renamed name only once the folder holding it is fsynced. So:

    write(path, data)          new bytes in a file, flushed and fsynced (then renamed into place by the caller)
    append(path, data)         bytes at the end of a file, flushed and fsynced; a crash can leave a prefix of them
    replace(src, dst)          atomic rename, then fsync of the destination's folder
    atomic_write(path, data)   write(path.tmp) + replace(path.tmp, path): the file holds the old bytes or the new ones

Every durable byte that runs.py writes goes through these four functions (the kill-anywhere soak,
benchmarks/soak_kill.py, wraps them to kill a run inside each of them).

A full disk (ENOSPC), a used-up quota (EDQUOT) or a read-only file system (EROFS) inside any of them is a
``DiskFullError`` naming the file, the bytes the write needed and the space left, raised after undoing what the
failed call wrote (a half-appended line is cut off, a half-written temporary file removed): the folder is left as
it was before the call, so a run resumes from it once there is room (tests/test_faults.py fills a real tmpfs at
every write of a run).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TMP = ".tmp"
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
"""The errors that mean the disk will not take the bytes: full, over quota, read-only."""


class DiskFullError(OSError):
    """A write refused for want of space (or of a writable disk); the message names the file, what the write needed
    and what is free. What was written before it is durable and consistent: free space, then resume."""


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the file system holding ``path`` (its nearest existing folder), None if that cannot be read."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


@contextmanager
def room(path: str | Path, needed: int | None = None) -> Iterator[None]:
    """Turn a full disk, a quota or a read-only file system inside the block into a ``DiskFullError`` about
    ``path`` (``needed``: the bytes being written, when known)."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as err:
        if err.errno not in NO_ROOM:
            raise
        free = free_bytes(path)
        what = "a read-only file system" if err.errno == errno.EROFS else os.strerror(err.errno).lower()
        need = f"the write needed {needed:,} bytes" if needed is not None else "the write needed more"
        left = f"{free:,} bytes are free there" if free is not None else "the free space cannot be read"
        raise DiskFullError(
            err.errno,
            f"{path}: {what} ({need}, {left}); free some space (or fix the disk) and resume: what was "
            "written before is consistent",
        ) from err


def fsync_dir(path: str | Path) -> None:
    """Make the names in folder ``path`` durable (new files, renames, removals). A no-op where folders cannot be
    opened (Windows)."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(path: str | Path, data: bytes) -> None:
    """``data`` as the whole content of ``path``, flushed and fsynced (the folder is not: rename it into place).
    On a full disk the partial file is removed and a DiskFullError raised."""
    try:
        with room(path, len(data)), open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except DiskFullError:
        Path(path).unlink(missing_ok=True)
        raise


def append(path: str | Path, data: bytes) -> None:
    """``data`` at the end of ``path`` (created if missing), flushed and fsynced; a new file's name is made durable
    too. A crash mid-call can leave any prefix of ``data`` at the end of the file."""
    path = Path(path)
    new = not path.exists()
    size = path.stat().st_size if not new else 0
    try:
        with room(path, len(data)), open(path, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except DiskFullError:  # cut off what reached the file (truncating needs no space): the file is as before
        if path.exists():
            os.truncate(path, size)
        raise
    if new:
        with room(path.parent):
            fsync_dir(path.parent)


def replace(src: str | Path, dst: str | Path) -> None:
    """Rename ``src`` to ``dst`` atomically (files or folders; ``dst`` must not be a non-empty folder), then fsync
    the folder so the new name survives a power cut."""
    with room(dst):
        os.replace(src, dst)
        fsync_dir(Path(dst).parent)


def atomic_write(path: str | Path, data: bytes) -> None:
    """Replace ``path``'s content with ``data`` so that a crash at any moment leaves the old content or the new."""
    path = Path(path)
    tmp = path.with_name(path.name + TMP)
    write(tmp, data)
    try:
        replace(tmp, path)
    except DiskFullError:
        tmp.unlink(missing_ok=True)
        raise


def sync_tree(path: str | Path) -> None:
    """fsync every file and folder under ``path`` (files written by other libraries, e.g. PEFT's save_pretrained)."""
    with room(path):
        for folder, _, files in os.walk(path):
            for name in files:
                with open(Path(folder, name), "rb") as f:
                    os.fsync(f.fileno())
            fsync_dir(folder)


def remove(path: str | Path) -> None:
    """Remove a file or a folder tree if it exists, then fsync its parent folder."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    else:
        return
    fsync_dir(path.parent)
