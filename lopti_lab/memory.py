"""Peak tensor memory of a block of work, on a GPU or on a CPU, so that memory bounds can be tested where no GPU is
at hand.

    with PeakMemory(device) as peak:
        step()
    peak.bytes        # the most tensor memory allocated inside the block and alive at once (above its start)
    peak.total        # on a GPU: the same peak counting what was allocated before the block (weights, ...)

On a GPU this is ``torch.cuda``'s allocator count (``max_memory_allocated``). On a CPU it is the same quantity taken
from torch's profiler (``profile_memory``: the allocation records its memory timeline is built from): every
allocation and free inside the block, in time order, whose running sum's maximum is the peak. That counts tensors
only, exactly and the same on every run, as a GPU's allocator does; the process's resident set would not do (a
24-layer checkpointed step's resident high-water mark climbed ~40 MB a layer where its live tensors grew 4 MB a
layer: the heap keeps freed pages). A CPU block's ``total`` is its ``bytes``: what was alive before it is not
counted. The profiler slows the block down: measure, then time apart.
"""

from __future__ import annotations

import torch

__all__ = ["PeakMemory", "cpu_peak_supported"]


def cpu_peak_supported() -> bool:
    """Whether this torch build can count CPU tensor memory (its profiler with ``profile_memory``)."""
    return hasattr(torch.profiler, "profile")


class PeakMemory:
    """Context manager: the peak tensor memory in use inside the block (module docstring). ``bytes`` above the
    entry level, ``total`` including it (a GPU only; equal to ``bytes`` on a CPU), ``start`` the entry level (0 on a
    CPU); all ints, set when the block ends."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.start = self.total = self.bytes = 0
        self._profile = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            return self
        activities = [torch.profiler.ProfilerActivity.CPU]
        self._profile = torch.profiler.profile(activities=activities, profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.total = torch.cuda.max_memory_allocated(self.device)
            self.bytes = max(self.total - self.start, 0)
            return
        self._profile.__exit__(*exc)
        if exc[0] is not None:
            return
        # every allocation and free the block made (the records the memory profiler builds on), in time order:
        # their running sum is the live tensor bytes; a tensor made before the block and freed inside it subtracts
        live = peak = 0
        for _, size in sorted(_allocations(self._profile.profiler.kineto_results.experimental_event_tree())):
            live += size
            peak = max(peak, live)
        self.bytes = self.total = int(peak)
        self._profile = None


def _allocations(events) -> list[tuple[int, int]]:
    """(time in ns, bytes: + allocated, - freed) of every CPU allocation event in a profiler's event tree."""
    from torch._C._profiler import _EventType

    found, stack = [], list(events)
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            found.append((event.start_time_ns, event.extra_fields.alloc_size))
        stack.extend(event.children)
    return found
