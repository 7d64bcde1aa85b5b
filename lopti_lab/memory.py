"""Peak memory of a block of work, on a GPU or on a CPU, so that memory bounds can be tested where no GPU is at hand.

    with PeakMemory(device) as peak:
        step()
    peak.bytes        # the highest memory in use during the block, above what was in use when it began
    peak.total        # the same peak, counting what was in use when it began (weights, optimizer state, ...)

On a GPU this is ``torch.cuda``'s allocator count (``max_memory_allocated``): tensors only. On a CPU (Linux) it is
the process's resident set: the kernel's high-water mark (``VmHWM``, reset on entry through ``/proc/self/clear_refs``)
against the resident size on entry. glibc would keep freed blocks of up to 32 MB in its heap and let the peak drift
from run to run, so on entry the mmap threshold is pinned at 64 KiB (``mallopt``): every tensor larger than that
gets pages of its own, mapped when allocated and returned when freed, and the heap's free pages are handed back
(``malloc_trim``), so the resident set follows the live tensors to within the allocator's small-block heap (a few
MB). A measurement on a CPU therefore counts Python objects and
library buffers too; compare two steps measured the same way, not one step against a GPU's number.
"""

from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path

import torch

__all__ = ["PeakMemory", "cpu_peak_supported"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
_MMAP_THRESHOLD = 1 << 16


def cpu_peak_supported() -> bool:
    """Whether this machine can measure a CPU peak: Linux with /proc and glibc."""
    return sys.platform.startswith("linux") and _STATUS.is_file() and _CLEAR_REFS.exists() and _libc() is not None


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _status_bytes(key: str) -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{_STATUS} has no {key} line")
    return int(match.group(1)) * 1024


class PeakMemory:
    """Context manager: the peak memory in use inside the block (module docstring). ``bytes`` above the entry level,
    ``total`` including it, ``start`` the entry level; all ints, set when the block ends."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.start = self.total = self.bytes = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            return self
        if not cpu_peak_supported():
            raise RuntimeError("PeakMemory on a CPU needs Linux (/proc/self/status, clear_refs) and glibc")
        libc = _libc()
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        libc.malloc_trim(0)  # free heap pages back to the kernel: a block's allocations must fault in pages of its own
        _CLEAR_REFS.write_text("5")  # resets VmHWM to the current resident size
        self.start = _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.total = torch.cuda.max_memory_allocated(self.device)
        else:
            self.total = _status_bytes("VmHWM")
        self.bytes = max(self.total - self.start, 0)
