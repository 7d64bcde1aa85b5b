"""How the position probe holds a module call's input until the gradient at its output arrives
(``probes.position``): directly, or, under gradient checkpointing, only as a weak reference to autograd's storage."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef


@dataclass
class _Input:
    """A module call's input as the probe holds it: no tensor of its own beyond what the step's backward keeps.

    In a plain forward the input itself (autograd saves it, or a copy of it, for the weight gradient, so holding it
    costs at most that copy). Under saved-tensor hooks (gradient checkpointing) only a weak reference to its storage:
    autograd frees it after the forward and re-runs the layer inside the backward, and the probe then takes the
    input of that re-run (``GradientProbe._recomputed``), alive only while the layer's backward runs. Token ids (an
    embedding's input, (B, L) integers) and inputs seen in a re-run are held directly."""

    held: torch.Tensor | None = None  # held directly
    ref: StorageWeakRef | None = None  # held weakly: its storage, and where in it the input lies
    geometry: tuple = ()  # (storage offset, size, stride, dtype)
    width: int | None = None  # features per position; None for token ids
    call: int = 0  # held weakly: which of its module's weakly held calls since set_tokens (a re-run repeats them)

    @classmethod
    def weak(cls, x: torch.Tensor, width: int) -> _Input:
        where = (x.storage_offset(), x.shape, x.stride(), x.dtype)
        return cls(ref=StorageWeakRef(x.untyped_storage()), geometry=where, width=width)

    @staticmethod
    def flat(x: torch.Tensor, width: int | None) -> torch.Tensor:
        return x.detach().reshape(-1) if width is None else x.detach().reshape(-1, width)  # (N,) or (N, in)

    def get(self) -> torch.Tensor | None:
        """The (N, in) input (or (N,) ids), or None when it was freed; called when the gradient at the module's
        output arrives, before the module's backward runs and releases its saved input."""
        if self.held is not None:
            return self.held
        storage = None if self.ref.expired() else torch.UntypedStorage._new_with_weak_ptr(self.ref.cdata)
        if storage is None:
            return None
        offset, size, stride, dtype = self.geometry
        x = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)
        return self.flat(x, self.width)
