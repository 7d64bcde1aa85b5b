"""attribution="position": hooks that split every weight gradient by the probability bin of the position it passed
through, during the ordinary backward (see lopti_lab.probes)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import pandas as pd
import torch
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop

from lopti_lab.bins import DEFAULT_BINS, bin_index, check_bins
from lopti_lab.lean.forward import SEGMENT
from lopti_lab.probes._common import (
    COLUMNS,
    _check_level,
    _check_mask,
    _check_probs,
    _named_trainable,
    _Stats,
    _table,
    summarize,
    to_metrics,
)
from lopti_lab.probes._held import _Input

# ----------------------------------------------------------------------------------------------------------------------
# attribution="position": hooks that split dW = sum_t g_t a_t^T by the group of position t, in the ordinary backward


def _module_kind(module: nn.Module) -> str | None:
    """How a module's weight gradient splits over positions, or None if this probe cannot split it."""
    if isinstance(module, nn.Linear):
        return "linear"  # W (out, in): dW = sum_t g_t a_t^T; LoRA's A and B are Linears
    if isinstance(module, nn.Embedding):
        if module.sparse or module.scale_grad_by_freq or module.max_norm is not None:
            return None
        return "embedding"  # W (V, d): dW = sum_t e_{x_t} g_t^T
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return "conv1d"  # GPT-2's transposed Linear, W (in, out): dW = sum_t a_t g_t^T
    return None


@dataclass
class _Layout:
    """A (B, L') activation's positions, flattened to N = B * L': group k is perm[offsets[k]:offsets[k+1]]."""

    gid: torch.Tensor  # (N,)
    perm: torch.Tensor  # (N,)
    offsets: list[int]  # (G + 1,)
    _onehot: dict = field(default_factory=dict)

    def counts(self) -> list[int]:
        return [b - a for a, b in zip(self.offsets, self.offsets[1:])]

    def onehot(self, acc: torch.dtype) -> torch.Tensor:
        if acc not in self._onehot:
            self._onehot[acc] = nn.functional.one_hot(self.gid, len(self.offsets) - 1).to(acc)  # (N, G)
        return self._onehot[acc]


@dataclass
class _Use:
    """One call of a module that uses a probed parameter: what the split of its gradient needs."""

    kind: str  # "linear", "conv1d", "embedding" (weights) or "bias"
    x: torch.Tensor | None  # (N, in) inputs, (N,) token ids, None for a bias; set when the gradient is split
    g: torch.Tensor  # (N, out) gradient at the module's output
    layout: _Layout
    token_set: int
    module: nn.Module | None = None  # the module called
    call: int = 0  # its ``_Input.call``: which input of the module's re-run is its own

    def add_group(self, k: int, out: torch.Tensor, acc: torch.dtype) -> None:
        """out += this call's part of group k's gradient (out has the parameter's shape)."""
        idx = self.layout.perm[self.layout.offsets[k] : self.layout.offsets[k + 1]]
        if idx.numel() == 0:
            return
        g = self.g[idx].to(acc)  # (n_k, out)
        if self.kind == "bias":
            out += g.sum(0)
        elif self.kind == "embedding":
            out.index_add_(0, self.x[idx], g)
        elif self.kind == "linear":
            out.addmm_(g.T, self.x[idx].to(acc))  # sum_{t in k} g_t a_t^T
        else:
            out.addmm_(self.x[idx].to(acc).T, g)

    def all_groups(self, out: torch.Tensor, acc: torch.dtype) -> None:
        """out (G, *shape) += this call's gradient of every group at once: G times the flops of one matmul, but a
        single kernel, which wins on small layers where the per-group loop's overhead dominates."""
        onehot = self.layout.onehot(acc)  # (N, G)
        G = onehot.shape[1]
        g = self.g.to(acc)  # (N, out)
        if self.kind == "bias":
            out += onehot.T @ g  # (G, out)
        elif self.kind == "embedding":
            V = out.shape[1]
            out.view(G * V, -1).index_add_(0, self.layout.gid * V + self.x, g)
        else:
            g_by_group = (onehot[:, :, None] * g[:, None, :]).reshape(g.shape[0], -1)  # (N, G * out)
            x = self.x.to(acc)  # (N, in)
            if self.kind == "linear":
                out += (g_by_group.T @ x).view(out.shape)  # (G, out, in)
            else:
                out += (x.T @ g_by_group).view(x.shape[1], G, -1).transpose(0, 1)  # (G, in, out)

    def times(self, r: torch.Tensor, rows: int, acc: torch.dtype) -> torch.Tensor:
        """This call's part of (dW @ r), in O(N (in + out)): the Freivalds check that the hooks explain dW."""
        g = self.g.to(acc)
        if self.kind == "embedding":
            return torch.zeros(rows, dtype=acc, device=g.device).index_add_(0, self.x, g @ r)
        if self.kind == "linear":
            return g.T @ (self.x.to(acc) @ r)
        return self.x.to(acc).T @ (g @ r)


def _pair_width(u: _Use, v: _Use) -> int | None:
    """Multiply-adds per position pair of `_pair_gram(u, v)`, or None if the pair has no Gram form here."""
    kinds = {u.kind, v.kind}
    if kinds in ({"linear"}, {"conv1d"}):
        return u.x.shape[1] + u.g.shape[1]
    if kinds in ({"embedding"}, {"linear", "embedding"}):
        return (u.g if u.kind == "embedding" else v.g).shape[1] + 1
    return None


def _pair_gram(u: _Use, v: _Use, acc: torch.dtype, cache: dict | None = None) -> torch.Tensor:
    """(N_u, N_v) inner products between the per-position gradient terms of two calls of one weight."""
    if u.kind == "embedding" and v.kind == "linear":
        return _pair_gram(v, u, acc).T
    gu, gv = u.g.to(acc), v.g.to(acc)
    if u.kind == v.kind == "embedding":  # <e_{x_t} g_t^T, e_{x_s} g_s^T> = [x_t = x_s] (g_t . g_s)
        return (u.x[:, None] == v.x[None, :]).to(acc) * (gu @ gv.T)
    if v.kind == "embedding":  # a tied lm_head (V, d): <g_t a_t^T, e_{x_s} g_s^T> = g_t[x_s] (a_t . g_s)
        return gu[:, v.x] * (u.x.to(acc) @ gv.T)
    g_gram = _syrk(gu) if v is u else gu @ gv.T
    return _input_gram(u.x, v.x, acc, cache) * g_gram  # (a_t . a_s)(g_t . g_s), Linear or Conv1D alike


def _syrk(a: torch.Tensor, block: int = 128) -> torch.Tensor:
    """a @ a.T from the row panels on and right of the diagonal only (symmetric): 10-30% faster on a CPU."""
    n = a.shape[0]
    if n <= 2 * block:
        return a @ a.T
    out = torch.empty(n, n, dtype=a.dtype, device=a.device)
    for i in range(0, n, block):
        panel = a[i : i + block] @ a[i:].T  # (b, n - i)
        out[i : i + block, i:] = panel
        out[i + block :, i : i + block] = panel[:, block:].T
    return out


def _input_gram(x: torch.Tensor, y: torch.Tensor, acc: torch.dtype, cache: dict | None) -> torch.Tensor:
    """x y^T, reused across the modules that read the same input (q, k, v; gate and up): saves a third of the Gram."""
    key = (x.data_ptr(), y.data_ptr(), tuple(x.shape), tuple(y.shape), x.dtype, acc)
    if cache is not None and key in cache:
        return cache[key][0]
    gram = _syrk(x.to(acc)) if x is y else x.to(acc) @ y.to(acc).T
    if cache is not None:  # keep x and y alive with it, so that their storage cannot be reused under the same key
        if len(cache) >= 4:
            cache.pop(next(iter(cache)))
        cache[key] = (gram, x, y)
    return gram


@dataclass
class _Record:
    stats: dict[str, _Stats] = field(default_factory=dict)
    checks: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)
    token_sets: set[int] = field(default_factory=set)
    table: pd.DataFrame | None = None


_GRAM_MAX_POSITIONS = 4096  # the Gram route holds an (N, N) matrix
_ONE_SHOT_MACS = 2**24  # below this many extra multiply-adds, all groups in one kernel beat a Python loop over them


class GradientProbe:
    """Per-bin gradient norms of every backward, by position attribution, from hooks (module docstring).

    Attach it (``with GradientProbe(model) as probe:``, or ``attach()`` / ``detach()``), call
    ``set_tokens(probs, mask)`` with the (B, T) probabilities and response mask of each minibatch before its forward,
    and run forward + backward as usual. Each backward adds one record: per parameter, ||g_k||^2 and <g_k, g> for
    every bin and `context`, kept on the device (no host sync in the backward) and tabulated by `frame()`.

    How: a forward hook on each Linear / Embedding / Conv1D that owns a probed parameter notes its input (``_Input``)
    and hooks its output's gradient; when the parameter's own gradient dW arrives
    (a tensor hook), the probe groups the positions by bin and forms each group's sum_t g_t a_t^T: one matmul per
    group with the largest group taken as dW minus the others, or the Gram identity, by an operation count
    (``method="gram"`` forces the Gram, ``"matmul"`` forbids it). A cheap Freivalds check, dW r = sum_t g_t (a_t . r),
    confirms that the hooked calls explain dW; a parameter that fails it (used outside its module, e.g. DoRA's weight
    norm) is left out of the tables with a warning.

    Positions: input position L - T - 1 + t belongs to the bin of response token t when mask[:, t], else to `context`,
    like every other position (prompt, padding, the last position). An activation shorter than L (``logits_to_keep``)
    covers the last positions. A tied weight (embedding = lm_head) is split over both of its uses; gradient
    checkpointing, reentrant or not, counts each call once (tested). Not supported: models that flatten (B, L)
    before a Linear (MoE experts): a ValueError names the module.

    Memory bound: no layer input beyond what the step's own backward holds (``_Input``): in a plain forward the one
    autograd saves; under gradient checkpointing the one of the layer's re-run inside the backward, dropped once
    that layer's weights are split (checkpointing's early stop is off while attached, so a re-run reaches every
    probed module). Beyond that, a module's output gradient until its weight gradient arrives (one layer's
    backward), and per split one weight-sized matrix per group or one (N, N) Gram block (N <= 4096 positions).
    tests/test_probe_memory.py measures it on a Qwen2.5-0.5B shape; its time against a plain forward + backward
    (full fine-tuning, LoRA, tiny models) is measured in benchmarks/README.md.
    """

    def __init__(
        self,
        model: nn.Module,
        bins: Sequence[float] = DEFAULT_BINS,
        params: Iterable[torch.Tensor] | None = None,
        *,
        level: str = "model",
        method: str = "auto",
    ):
        self.bins = check_bins(bins)
        self.level = _check_level(level)
        if method not in ("auto", "matmul", "gram"):
            raise ValueError(f"method must be 'auto', 'matmul' or 'gram', got {method!r}")
        self.method = method
        self.K = len(self.bins) - 1
        self.model = model
        owners: dict[nn.Parameter, list[tuple[nn.Module, str | None, str]]] = {}
        for module in {id(m): m for m in model.modules()}.values():
            kind = _module_kind(module)
            for role, p in module._parameters.items():
                if p is not None:
                    owners.setdefault(p, []).append((module, kind, role))

        def splittable(p) -> bool:
            own = owners.get(p, [])
            return bool(own) and all(kind is not None and role in ("weight", "bias") for _, kind, role in own)

        self._named = _named_trainable(model, params, splittable)
        probed = {p for _, p in self._named}
        self._kinds: dict[nn.Module, str] = {}
        self._probed_of: dict[nn.Module, list[tuple[str, nn.Parameter]]] = {}
        for p in probed:
            for module, kind, role in owners[p]:
                self._kinds[module] = kind
                self._probed_of.setdefault(module, []).append((role, p))
        self._weight_modules = {m for m, roles in self._probed_of.items() if any(r != "bias" for r, _ in roles)}
        self._recomputed: dict[nn.Module, list[torch.Tensor]] = {}  # inputs of checkpointed layers' re-runs
        self._early_stop = None
        self._handles: list = []
        self._tensor_handles: list = []
        self._attached = False
        self._warned: set[str] = set()
        self._vectors: dict = {}
        self._input_grams: dict = {}  # a small LRU of x x^T for modules sharing an input
        self.reset()

    # -- lifecycle -------------------------------------------------------------------------------------------------

    @property
    def params(self) -> list[nn.Parameter]:
        """The probed parameters."""
        return [p for _, p in self._named]

    def attach(self) -> GradientProbe:
        if self._attached:
            return self
        for module in self._kinds:
            self._handles.append(module.register_forward_hook(self._on_forward, with_kwargs=True))
        for name, p in self._named:
            self._handles.append(p.register_hook(lambda grad, p=p, name=name: self._on_grad(p, name, grad)))
        # a checkpointed layer's re-run must reach every probed module: no early stop after the last saved tensor
        self._early_stop = set_checkpoint_early_stop(False)
        self._early_stop.__enter__()
        self._attached = True
        return self

    def detach(self) -> None:
        """Remove every hook; the model is as it was, and a later backward costs nothing extra."""
        for handle in [*self._handles, *self._tensor_handles]:
            handle.remove()
        self._handles.clear()
        self._tensor_handles.clear()
        self._pending.clear()
        self._recomputed.clear()
        if self._early_stop is not None:
            self._early_stop.__exit__(None, None, None)
            self._early_stop = None
        self._attached = False

    def __enter__(self) -> GradientProbe:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def reset(self) -> None:
        """Forget every record and token set."""
        self._records: list[_Record] = []
        self._current = _Record()
        self._token_counts: list[torch.Tensor] = []
        self._groups: torch.Tensor | None = None
        self._layouts: dict = {}
        self._weak_calls: dict[nn.Module, int] = {}
        self._pending: dict[nn.Parameter, list[_Use]] = {}
        self._recomputed = {}

    def set_tokens(self, probs: torch.Tensor, mask: torch.Tensor, *, census: tuple | None = None) -> None:
        """Bins for the next forward: (B, T) probabilities (normally old_logp.exp()) and response mask. ``census``
        ((B', T') probabilities and mask): the tokens the token shares count, when the forward runs only some of
        them (an update skips the rows without a gradient; theirs would add exact zeros to the split); default: the
        forward's own."""
        mask = _check_mask(mask)
        probs = _check_probs(probs, mask)
        self._close()
        bin_of = bin_index(probs, self.bins)  # (B, T)
        counted_bins, counted = bin_of, mask
        if census is not None:  # (B', T') tokens counted, beside the (B, T) the forward runs
            counted = _check_mask(census[1])
            counted_bins = bin_index(_check_probs(census[0], counted), self.bins)
        group = torch.where(mask, bin_of, self.K)  # (B, T): masked-out tokens' positions are context
        last = torch.full_like(group[:, :1], self.K)  # (B, 1): the last input position predicts nothing
        self._groups = torch.cat([group, last], dim=1)  # (B, T + 1): groups of input positions L-T-1 .. L-1
        self._token_counts.append(torch.bincount(counted_bins[counted], minlength=self.K))
        self._layouts, self._weak_calls = {}, {}
        # output-gradient hooks of graphs already freed need no removal: keep a long-attached probe's list short
        self._tensor_handles = [h for h in self._tensor_handles if h.hooks_dict_ref() is not None]

    # -- hooks -----------------------------------------------------------------------------------------------------

    def _layout(self, x: torch.Tensor, segment: tuple | None) -> _Layout:
        """The groups of a module call's input positions x (b, L, ...): a plain forward's rows are the batch's
        [prompt | response] (``segment`` None); a lean forward's calls say which block they compute (``SEGMENT``)."""
        b, length, device = x.shape[0], x.shape[1], x.device
        rows = None if segment is None or segment[0] == "context" else segment[1]
        key = (length, str(device), None if segment is None else segment[0], None if rows is None else id(rows))
        if key in self._layouts:
            return self._layouts[key][0]
        groups = self._groups.to(device)
        B, T1 = groups.shape
        if segment is not None and segment[0] == "context":  # shared prompt positions predict no response token
            gid = torch.full((b, length), self.K, dtype=groups.dtype, device=device)
        elif segment is not None:  # rows of the batch whose position j predicts response token j
            gid = groups[rows.to(device), :length]
        elif length >= T1:  # prompt positions in front are context
            gid = torch.cat([torch.full((B, length - T1), self.K, dtype=groups.dtype, device=device), groups], 1)
        else:  # logits_to_keep: the activation covers only the last `length` positions
            gid = groups[:, -length:]
        if gid.shape != (b, length):
            raise ValueError(f"GradientProbe: a module call's input {tuple(x.shape)} does not match its segment")
        gid = gid.reshape(-1)  # (N,)
        counts = torch.bincount(gid, minlength=self.K + 1).tolist()  # one host sync per minibatch and length
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        self._layouts[key] = (_Layout(gid, torch.argsort(gid, stable=True), offsets), rows)  # rows kept: id stays
        return self._layouts[key][0]

    def _on_forward(self, module, args, kwargs, output):
        if not self._attached or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        if self._groups is None:
            raise RuntimeError("GradientProbe: call set_tokens(probs, mask) before the forward pass")
        x = args[0] if args else kwargs.get("input")
        kind = self._kinds[module]
        B, segment = self._groups.shape[0], SEGMENT.get()
        want = 2 if kind == "embedding" else 3
        if x.dim() != want or (segment is None and x.shape[0] != B):
            raise ValueError(
                f"GradientProbe: a {type(module).__name__} got input {tuple(x.shape)}; expected (B={B}, L"
                f"{'' if want == 2 else ', features'}) as in set_tokens (models that flatten tokens are not supported)"
            )
        layout = self._layout(x, segment)
        width = None if kind == "embedding" else x.shape[-1]
        if width is None:  # token ids: small, and the padding mask below needs them in the backward
            source = _Input(held=_Input.flat(x, None))
        elif torch._C._current_graph_task_id() != -1:  # a re-run inside a backward: checkpointing recomputes
            source = _Input(held=_Input.flat(x, width))
            if module in self._weight_modules:
                self._recomputed.setdefault(module, []).append(source.held)
        elif torch._C._autograd._top_saved_tensors_default_hooks(False) is None:  # autograd keeps it as it is
            source = _Input(held=_Input.flat(x, width))
        else:  # saved-tensor hooks (checkpointing) will free or pack what autograd saves: hold nothing
            source = _Input.weak(x, width)
            source.call = self._weak_calls[module] = self._weak_calls.get(module, -1) + 1
        token_set = len(self._token_counts) - 1
        self._tensor_handles.append(
            output.register_hook(lambda g: self._on_output_grad(module, source, layout, token_set, g))
        )

    def _on_output_grad(self, module, source, layout, token_set, g):
        if not self._attached:
            return
        g = g.detach().reshape(-1, g.shape[-1])  # (N, out)
        kind = self._kinds[module]
        if kind == "embedding" and module.padding_idx is not None:
            pad = source.held == module.padding_idx  # (N,)
            g = g.masked_fill(pad[:, None], 0)  # F.embedding gives the padding row no gradient
        for role, p in self._probed_of[module]:
            # the input is taken now, before the module's backward runs and autograd releases what it saved
            x = None if role == "bias" else source.get()
            use = _Use("bias" if role == "bias" else kind, x, g, layout, token_set, module, source.call)
            self._pending.setdefault(p, []).append(use)

    def _inputs(self, uses: list[_Use]) -> bool:
        """Give each weight use whose input was freed before its output's gradient arrived the input of the layer's
        re-run, the re-run's calls in the forward's order (the Freivalds check catches a mismatch). False when an
        input was freed and never re-run (e.g. offloaded)."""
        for u in uses:
            if u.x is None and u.kind != "bias":
                rerun = self._recomputed.get(u.module, [])
                if u.call >= len(rerun):
                    return False
                u.x = rerun[u.call]
        for u in uses:
            if u.kind != "bias":  # the layer's backward is done with its re-run inputs
                self._recomputed.pop(u.module, None)
        return True

    def _on_grad(self, p, name, grad):
        uses = self._pending.pop(p, [])
        if not self._attached:
            return
        if not uses:
            self._warn(name, "got a gradient that no hooked module call explains (used functionally?)")
            return
        if not self._inputs(uses):
            self._warn(name, "has a module input that was freed after the forward and not recomputed")
            return
        if name in self._current.stats:  # this parameter already reported: a new backward began
            self._close()
        acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
        full = grad.detach().to(acc)  # never written to: it may be the very tensor autograd accumulates
        counts = [sum(c) for c in zip(*(u.layout.counts() for u in uses))]
        kinds = {u.kind for u in uses}
        if kinds == {"embedding"}:
            nsq, ip = self._split_sparse(full, uses, acc)
        elif kinds != {"bias"} and self._gram_pays(full, uses, counts):
            nsq, ip = self._split_gram(uses, acc)
        else:
            nsq, ip = self._split_dense(full, uses, acc, counts)
        flat_full = full.reshape(-1)
        self._current.stats[name] = _Stats(nsq=nsq, ip=ip, full_sq=flat_full.dot(flat_full), numel=p.numel())
        self._current.checks[name] = self._check(full, uses, acc, grad.dtype)
        self._current.token_sets.update(u.token_set for u in uses)

    # -- the split -------------------------------------------------------------------------------------------------

    def _gram_pays(self, full: torch.Tensor, uses: list[_Use], counts: list[int]) -> bool:
        """Gram or per-group matmuls, by an operation count calibrated on a CPU (one pass over a weight-sized
        buffer ~ 20 multiply-adds): the matmuls write G weight-sized matrices, the Gram only N x N ones."""
        widths = [[_pair_width(u, v) for v in uses] for u in uses]
        if self.method == "matmul" or any(w is None for row in widths for w in row):
            return False
        if self.method == "gram":
            return True
        n, G = sum(counts), len(counts)
        if n > _GRAM_MAX_POSITIONS:
            return False
        gram = sum(u.g.shape[0] * v.g.shape[0] * widths[i][j] for i, u in enumerate(uses) for j, v in enumerate(uses))
        matmul = (n - max(counts)) * full.numel() + 20 * (8 * (G - 1) + 6) * full.numel()
        return gram + n * n * G < matmul

    def _split_dense(self, full, uses, acc, counts):
        """Each group's gradient as a matrix, one group at a time; the largest group is dW minus the others."""
        G = len(counts)
        if sum(counts) * full.numel() * (G - 1) < _ONE_SHOT_MACS:  # small layer: every group in one kernel
            groups = torch.zeros((G, *full.shape), dtype=acc, device=full.device)
            for u in uses:
                u.all_groups(groups, acc)
            flat = groups.reshape(G, -1)
            return flat.square().sum(1), flat @ full.reshape(-1)
        skip = max(range(len(counts)), key=counts.__getitem__)
        zero = full.new_zeros(())
        nsq, ip = [zero] * len(counts), [zero] * len(counts)
        group = torch.empty_like(full)
        rest = torch.zeros_like(full)
        flat_full = full.reshape(-1)
        for k, n_k in enumerate(counts):
            if k == skip or n_k == 0:
                continue
            group.zero_()
            for u in uses:
                u.add_group(k, group, acc)
            flat = group.reshape(-1)
            nsq[k], ip[k] = torch.dot(flat, flat), torch.dot(flat, flat_full)
            rest += group
        skipped = (full - rest).reshape(-1)  # exact when the hooks explain dW, which _check verifies
        nsq[skip], ip[skip] = torch.dot(skipped, skipped), torch.dot(skipped, flat_full)
        return torch.stack(nsq), torch.stack(ip)

    def _split_gram(self, uses, acc):
        """<G_k, G_j> from the Gram identity, summed over pairs of calls: sum_{t in k, s in j} <term_t, term_s>, where
        a Linear's term g_t a_t^T pairs with another as (g_t . g_s)(a_t . a_s). No weight-sized matrix at all."""
        C = 0
        for i, u in enumerate(uses):
            for v in uses[i:]:
                gram = _pair_gram(u, v, acc, self._input_grams)  # (N_u, N_v)
                block = u.layout.onehot(acc).T @ gram @ v.layout.onehot(acc)  # (G, G)
                C = C + (block if v is u else block + block.T)
        return C.diagonal().clone(), C.sum(1)

    def _split_sparse(self, full, uses, acc):
        """An embedding's group gradients touch only the rows of the tokens seen: sum them per (group, token)."""
        V = full.shape[0]
        ids = torch.cat([u.x for u in uses])  # (N,)
        g = torch.cat([u.g for u in uses]).to(acc)  # (N, d)
        gid = torch.cat([u.layout.gid for u in uses])  # (N,)
        keys, inverse = torch.unique(gid * V + ids, return_inverse=True)
        rows = torch.zeros(len(keys), g.shape[1], dtype=acc, device=g.device).index_add_(0, inverse, g)  # (U, d)
        group, token = keys // V, keys % V
        G = self.K + 1
        nsq = torch.zeros(G, dtype=acc, device=g.device).index_add_(0, group, rows.square().sum(1))
        ip = torch.zeros(G, dtype=acc, device=g.device).index_add_(0, group, (rows * full[token]).sum(1))
        return nsq, ip

    def _check(self, full, uses, acc, grad_dtype):
        """Freivalds: does the sum over the hooked calls of (their dW) r equal dW r? -> (residual, scale, tolerance)."""
        if uses[0].kind == "bias":
            lhs = full
            rhs = sum(u.g.to(acc).sum(0) for u in uses)
        else:
            r = self._probe_vector(full.shape[1], full.device, acc)
            lhs = full @ r
            rhs = sum(u.times(r, full.shape[0], acc) for u in uses)
        dtypes = {grad_dtype, *(u.g.dtype for u in uses)}
        tol = 1e-8 if dtypes == {torch.float64} else 1e-3 if dtypes <= {torch.float32, torch.float64} else 3e-2
        return (lhs - rhs).norm(), lhs.norm() + rhs.norm(), tol

    def _probe_vector(self, n: int, device, acc) -> torch.Tensor:
        """A fixed vector with no structure a real gradient could share (no RNG: the trainer's stays untouched)."""
        key = (n, str(device), acc)
        if key not in self._vectors:
            self._vectors[key] = torch.sin(torch.arange(n, device=device, dtype=acc) * 0.7548776662 + 0.5)
        return self._vectors[key]

    # -- results ---------------------------------------------------------------------------------------------------

    def _warn(self, name: str, why: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(f"GradientProbe: {name} {why}; it is left out of the tables", stacklevel=3)

    def _close(self) -> None:
        self._input_grams.clear()
        if self._current.stats:
            self._records.append(self._current)
        self._current = _Record()

    def _record_table(self, record: _Record, index: int) -> pd.DataFrame:
        if record.table is None:
            names = list(record.checks)
            resid, scale = (torch.stack([record.checks[n][i].double().cpu() for n in names]) for i in (0, 1))
            for n, r, s in zip(names, resid.tolist(), scale.tolist()):
                if not r <= record.checks[n][2] * s + 1e-30:
                    self._warn(n, "has a gradient that its hooked calls do not explain (used outside its module?)")
                    del record.stats[n]
            counts = sum(self._token_counts[i] for i in sorted(record.token_sets)).cpu().numpy()
            record.table = _table(record.stats, counts, self.bins, "position", self.level, record=index)
        return record.table

    def frame(self) -> pd.DataFrame:
        """Every record so far, one table per backward, with a `record` column (0, 1, ...)."""
        self._close()
        tables = [self._record_table(r, i) for i, r in enumerate(self._records)]
        if not tables:
            return pd.DataFrame(columns=["record", *COLUMNS])
        return tables[0].copy() if len(tables) == 1 else pd.concat(tables, ignore_index=True)

    def summary(self) -> pd.DataFrame:
        """The per-bin table averaged over the records (`summarize`)."""
        return summarize(self.frame())

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """`to_metrics` of the records so far: {"grad/norm_bin0": ..., "grad/share_context": ..., ...}."""
        table = self.frame()
        if table.empty:
            raise RuntimeError("GradientProbe has no records: run a backward while it is attached")
        return to_metrics(table, prefix)
