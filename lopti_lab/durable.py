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
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TMP = ".tmp"


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
    """``data`` as the whole content of ``path``, flushed and fsynced (the folder is not: rename it into place)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def append(path: str | Path, data: bytes) -> None:
    """``data`` at the end of ``path`` (created if missing), flushed and fsynced; a new file's name is made durable
    too. A crash mid-call can leave any prefix of ``data`` at the end of the file."""
    path = Path(path)
    new = not path.exists()
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if new:
        fsync_dir(path.parent)


def replace(src: str | Path, dst: str | Path) -> None:
    """Rename ``src`` to ``dst`` atomically (files or folders; ``dst`` must not be a non-empty folder), then fsync
    the folder so the new name survives a power cut."""
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)


def atomic_write(path: str | Path, data: bytes) -> None:
    """Replace ``path``'s content with ``data`` so that a crash at any moment leaves the old content or the new."""
    path = Path(path)
    tmp = path.with_name(path.name + TMP)
    write(tmp, data)
    replace(tmp, path)


def sync_tree(path: str | Path) -> None:
    """fsync every file and folder under ``path`` (files written by other libraries, e.g. PEFT's save_pretrained)."""
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
