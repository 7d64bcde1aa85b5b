"""Closed-form softmax-gradient facts and a toy policy that shows low-probability tokens dominating the update.

The paper's §2 (reference/PAPER.md): for a token y sampled with probability pi_y = softmax(z)_y over N tokens,

    d log pi_y / d z = e_y - pi
    ||e_y - pi||^2   = (1 - pi_y)^2 + sum_{k != y} pi_k^2
    sqrt(N / (N - 1)) * (1 - pi_y)  <=  ||e_y - pi||  <=  sqrt(2) * (1 - pi_y)

so the gradient a token sends back through the logits shrinks linearly to zero as its probability goes to one: the few
low-probability tokens of a batch carry most of the update. This module holds those facts as functions, the probability
bins the whole toolkit shares (`check_bins`, `bin_index`, `bin_labels`), the paper's "correct ratio" table
(`shift_summary`), and a seeded toy (`simulate`) that trains a softmax sequence policy with GRPO, AR, Lopti and
AR + Lopti in about a second on a CPU. numpy / torch / pandas only: no transformers.

Shape legend: B = sequences (prompts x group size G), T = response tokens, V = vocabulary (N in the paper),
S = toy states, D = toy feature dimension, K = probability bins.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import pandas as pd
import torch

DEFAULT_BINS: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The paper's Fig. 1 bins: [0, .25), [.25, .5), [.5, .75), [.75, 1]."""

DTYPE = torch.float32  # the toy's dtype: half float64's time, and AR(alpha=0) == GRPO holds bit for bit anyway


# ----------------------------------------------------------------------------------------------------------------------
# Probability bins


def check_bins(bins: Sequence[float]) -> tuple[float, ...]:
    """Validate bin edges and return them as a tuple of floats.

    Edges must be strictly increasing, start at 0 and end at 1, so that every probability falls in exactly one bin:
    bin k is [bins[k], bins[k+1]), the last one closed, [bins[-2], 1].

    >>> check_bins([0, 0.5, 1])
    (0.0, 0.5, 1.0)
    """
    try:
        edges = tuple(float(b) for b in bins)
    except (TypeError, ValueError) as err:
        raise ValueError(f"bins must be a sequence of numbers, got {bins!r}") from err
    if len(edges) < 2:
        raise ValueError(f"bins needs at least two edges, got {edges}")
    if any(not 0.0 <= b <= 1.0 for b in edges):
        raise ValueError(f"bins must lie in [0, 1], got {edges}")
    if any(b1 <= b0 for b0, b1 in itertools.pairwise(edges)):
        raise ValueError(f"bins must be strictly increasing, got {edges}")
    if edges[0] != 0.0 or edges[-1] != 1.0:
        raise ValueError(f"bins must start at 0 and end at 1 so that every token has a bin, got {edges}")
    return edges


def bin_index(p: torch.Tensor, bins: Sequence[float] = DEFAULT_BINS) -> torch.Tensor:
    """The bin of each probability: k such that bins[k] <= p < bins[k+1] (p = 1 goes to the last bin).

    >>> bin_index(torch.tensor([0.0, 0.25, 0.7, 1.0]))
    tensor([0, 1, 2, 3])
    """
    edges = check_bins(bins)
    inner = torch.tensor(edges[1:-1], dtype=p.dtype, device=p.device)
    return torch.bucketize(p.detach(), inner, right=True)  # right=True: an edge value opens the next bin


def bin_labels(bins: Sequence[float] = DEFAULT_BINS) -> list[str]:
    """Interval labels for plots and tables.

    >>> bin_labels((0, 0.5, 1))
    ['[0, 0.5)', '[0.5, 1]']
    """
    edges = check_bins(bins)
    last = len(edges) - 2
    return [f"[{lo:g}, {hi:g}{']' if k == last else ')'}" for k, (lo, hi) in enumerate(itertools.pairwise(edges))]


# ----------------------------------------------------------------------------------------------------------------------
# Softmax-gradient facts (PAPER.md §2)


def logit_grad_norm(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """||e_y - softmax(z)||, the norm of d log softmax(z)_y / dz, for every token: (..., V), (...) -> (...).

    Exact (it forms p - e_y and takes its norm, as autograd would) and computed in the logits' dtype, upcast from
    half precision to float32.

    Example: z = (0, 0), y = 0 -> p = (.5, .5), e_y - p = (.5, -.5), norm = sqrt(.5) = 0.7071.
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(
            f"tokens must have the logits' shape without V: {tuple(logits.shape[:-1])}, got {tokens.shape}"
        )
    z = logits.detach()
    if z.dtype in (torch.float16, torch.bfloat16):
        z = z.float()
    p_minus_e = z.softmax(-1)  # (..., V)
    p_minus_e.scatter_add_(-1, tokens[..., None], torch.full_like(p_minus_e[..., :1], -1.0))
    return torch.linalg.vector_norm(p_minus_e, dim=-1)  # (...)


def grad_norm_bounds(p, vocab_size: int):
    """The wedge of PAPER.md §2: (lower, upper) = (sqrt(N/(N-1)) (1 - p), sqrt(2) (1 - p)).

    Works on floats, numpy arrays and tensors alike. The lower bound is reached when the other N-1 tokens share the
    remaining mass equally, the upper one when a single other token holds all of it.

    >>> grad_norm_bounds(0.5, 2)
    (0.7071067811865476, 0.7071067811865476)
    """
    if int(vocab_size) != vocab_size or vocab_size < 2:
        raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
    gap = 1 - p
    return math.sqrt(vocab_size / (vocab_size - 1)) * gap, math.sqrt(2.0) * gap


# ----------------------------------------------------------------------------------------------------------------------
# The paper's correct ratio (Fig. 2b)


def shift_summary(tokens: pd.DataFrame, bins: Sequence[float] = DEFAULT_BINS, by: Sequence[str] = ()) -> pd.DataFrame:
    """Per bin and advantage sign, how far probabilities moved, how many did not move at all, and the share of the
    tokens that moved which moved the right way (Fig. 2b).

    `tokens` has one row per response token with columns `bin` (int), `advantage` and `delta_p` (new - old
    probability), optionally `dlogp` (new - old log-probability), plus any grouping columns named in `by` (e.g.
    ``("method", "step")``). The direction of a move is the sign of `dlogp` when given (precise even where a
    probability near 1 cannot show the move: 1 - 3e-5 and 1 - 2e-5 are the same float32 number), else of `delta_p`.
    A token that did not move (direction 0) is *unmoved*: neither right nor wrong, counted apart. A token that moved is
    *correct* when it moved the way its advantage asks: up for A > 0, down for A < 0. Tokens with A = 0 ask for
    nothing and are left out. Returns one row per (by..., bin, sign) with sign in ("pos", "neg"), empty cells
    included: `bin`, `label`, `sign`, `n_tokens` (tokens asked to move), `n_moved`, `unmoved_share`,
    `correct_ratio` (among the moved; NaN when none moved), and the mean, median and quartiles of `delta_p`.

    Example: a bin holding tokens (A, delta_p) = (+1, +.1), (+1, -.2), (+1, 0), (-1, -.3) has for "pos" n_tokens 3,
    n_moved 2, unmoved_share 1/3 and correct_ratio .5 (one of the two that moved went up); for "neg" correct_ratio 1.
    """
    by = list(by)
    labels = bin_labels(bins)
    missing = {"bin", "advantage", "delta_p", *by} - set(tokens.columns)
    if missing:
        raise ValueError(f"tokens lacks columns {sorted(missing)}")
    adv = tokens["advantage"].to_numpy(dtype=float)
    dp = tokens["delta_p"].to_numpy(dtype=float)
    direction = np.sign(tokens["dlogp"].to_numpy(dtype=float) if "dlogp" in tokens.columns else dp)
    asked = adv != 0
    moved = direction[asked] != 0
    right = np.where(adv[asked] > 0, direction[asked] > 0, direction[asked] < 0)
    cells = tokens.loc[asked, [*by, "bin"]].assign(
        sign=np.where(adv[asked] > 0, "pos", "neg"),
        delta_p=dp[asked],
        moved=moved.astype(float),
        correct=np.where(moved, right.astype(float), np.nan),
    )
    keys = [*by, "bin", "sign"]
    grouped = cells.groupby(keys, sort=False)
    table = grouped.agg(
        n_tokens=("moved", "size"),
        n_moved=("moved", "sum"),
        correct_ratio=("correct", "mean"),  # NaN (unmoved) rows are skipped: the ratio among the tokens that moved
        dp_mean=("delta_p", "mean"),
        dp_median=("delta_p", "median"),
    )
    # reindex: with no token asking for a move (every group's rewards tied) there are no cells and no columns
    quartiles = grouped["delta_p"].quantile([0.25, 0.75]).unstack().reindex(columns=[0.25, 0.75])
    table["dp_q25"], table["dp_q75"] = quartiles[0.25], quartiles[0.75]
    # Every (group, bin, sign) cell appears, empty ones with n_tokens = 0, so tables from different runs line up.
    groups = [()] if not by else list(tokens[by].drop_duplicates().itertuples(index=False, name=None))
    full = pd.MultiIndex.from_tuples(
        [(*g, k, s) for g in groups for k in range(len(labels)) for s in ("pos", "neg")], names=keys
    )
    table = table.reindex(full).reset_index()
    table["n_tokens"] = table["n_tokens"].fillna(0).astype(int)
    table["n_moved"] = table["n_moved"].fillna(0).astype(int)
    table.insert(table.columns.get_loc("n_moved") + 1, "unmoved_share", 1 - table["n_moved"] / table["n_tokens"])
    table.loc[table["n_tokens"] == 0, "unmoved_share"] = np.nan
    table.insert(len(by) + 1, "label", [labels[k] for k in table["bin"]])
    return table


# ----------------------------------------------------------------------------------------------------------------------
# The toy: a softmax sequence policy trained by GRPO, AR, Lopti and AR + Lopti


@dataclass(frozen=True)
class Method:
    """One training variant. alpha = 0 and eta = None is plain GRPO."""

    name: str
    alpha: float = 0.0
    """AR strength (PAPER.md §3, Eq. 4): A_hat = (alpha * pi_old + 1 - alpha) * A."""
    eta: float | None = None
    """Lopti threshold (§4): update tokens with pi_old < eta first, then the rest. None: one update on all tokens."""

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"Method.alpha must be in [0, 1], got {self.alpha}")
        if self.eta is not None and not 0.0 < self.eta < 1.0:
            raise ValueError(f"Method.eta must be in (0, 1) or None, got {self.eta}")


METHODS: tuple[Method, ...] = (
    Method("GRPO"),
    Method("AR", alpha=0.3),
    Method("Lopti", eta=0.5),
    Method("AR+Lopti", alpha=0.3, eta=0.5),
)
"""The paper's four variants with its K&K defaults (alpha = 0.3, eta = 0.5)."""


@dataclass(frozen=True)
class ToyConfig:
    """A softmax sequence policy small enough to train in a second, shaped like an LLM's token statistics.

    The policy is in one of S states at every response position and picks a token from V: its logits are a frozen
    prior (the "pretrained model": peaked on a preferred token in most states) plus a trainable linear head on D-dim
    state features, W phi_s. With D < S the states share W, as an LLM's tokens share weights, so a large gradient from
    one token moves the probabilities of tokens in other states. The reward of a response is the fraction of its
    positions where the sampled token is the state's target (the prior's preferred token in most states).
    """

    vocab_size: int = 256
    """V: large, so that a sampled low-probability token has ||e_y - pi|| near 1 while a confident one is near 0."""
    n_states: int = 64
    """S: states the policy can be in."""
    feature_dim: int = 16
    """D < S: the states' features overlap, so updates interfere."""
    seq_len: int = 16
    """T: response tokens per sample."""
    n_prompts: int = 8
    """Prompts per step; a prompt is a random sequence of T states."""
    group_size: int = 8
    """G: samples per prompt; advantages are normalised within each group (GRPO)."""
    steps: int = 30
    """RL steps per method."""
    optimizer: str = "adam"
    """"adam" (the paper trains with AdamW) or "sgd" (plain SGD, under which gradient sizes show directly, as in the
    paper's Fig. 1). The choice matters for Lopti: under Adam each stage's step is normalised, so the high-probability
    tokens' small gradients still get a full-size step of their own; under SGD they barely move."""
    lr: float = 0.05
    """Learning rate of the optimizer on the token-mean loss."""
    clip_eps: float = 0.2
    """PPO clip range; matters only in Lopti's second stage, whose ratio sees the first stage's drift."""
    margin: tuple[float, float] = (3.0, 11.0)
    """The preferred token's extra prior logit in each state, uniform in this range: its probability spans ~.05-1."""
    target_is_preferred: float = 0.75
    """Share of states whose target is the prior's preferred token; the others must be learned."""
    bins: tuple[float, ...] = DEFAULT_BINS
    """Probability bins for the per-bin tables."""
    seed: int = 0
    """Seeds the world (prior, features, targets) and the sampling; every method sees the same first batch."""

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("vocab_size", "n_states", "feature_dim", "seq_len", "n_prompts", "steps") and (
                int(value) != value or value < 1
            ):
                raise ValueError(f"ToyConfig.{f.name} must be a positive integer, got {value!r}")
        if self.vocab_size < 2:
            raise ValueError(f"ToyConfig.vocab_size must be at least 2, got {self.vocab_size}")
        if self.group_size < 2:
            raise ValueError(
                f"ToyConfig.group_size must be at least 2 (advantages are group-normalised), got {self.group_size}"
            )
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"ToyConfig.optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.lr <= 0:
            raise ValueError(f"ToyConfig.lr must be positive, got {self.lr}")
        if self.clip_eps <= 0:
            raise ValueError(f"ToyConfig.clip_eps must be positive, got {self.clip_eps}")
        if not 0 <= self.margin[0] <= self.margin[1]:
            raise ValueError(f"ToyConfig.margin must be (low, high) with 0 <= low <= high, got {self.margin}")
        if not 0.0 <= self.target_is_preferred <= 1.0:
            raise ValueError(f"ToyConfig.target_is_preferred must be in [0, 1], got {self.target_is_preferred}")
        object.__setattr__(self, "bins", check_bins(self.bins))


@dataclass
class ToyResult:
    """Tidy tables from `simulate`, one row per (step, method, ...)."""

    steps: pd.DataFrame
    """step, method, reward (mean over the batch), p_target (policy's mean probability of the target over states),
    accuracy (share of states whose greedy token is the target), measured on the batch sampled at that step."""
    bins: pd.DataFrame
    """step, method, bin, label, n_tokens, token_share, grad_norm (norm of the gradient of the bin's tokens alone, at
    the start of the step, with the method's advantages: Fig. 1d), grad_share (<g_bin, g> / ||g||^2, sums to 1 over
    bins), token_grad_norm (mean over the bin's tokens of ||e_y - pi||)."""
    shift: pd.DataFrame
    """step, method and `shift_summary`'s columns: the correct ratio after the whole step's update (Fig. 2b)."""
    tokens: pd.DataFrame = field(repr=False)
    """One row per sampled token: step, method, seq, pos, state, token, prob (pi_old), grad_norm (||e_y - pi||),
    advantage, weight (the advantage after AR), bin, p_new, delta_p, dlogp (new - old log-prob). Fig. 2a's wedge is
    prob vs grad_norm."""


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - mean_group) / (std_group + eps), groups being consecutive runs of `group_size`. (B,) -> (B,)."""
    r = rewards.view(-1, group_size)  # (P, G)
    return ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + eps)).view(-1)  # (B,)


def _world(config: ToyConfig, gen: torch.Generator):
    """The frozen prior logits (S, V), unit state features (S, D) and each state's target token (S,)."""
    S, V, D = config.n_states, config.vocab_size, config.feature_dim
    prior = torch.randn(S, V, generator=gen, dtype=DTYPE)
    preferred = torch.randint(V, (S,), generator=gen)
    lo, hi = config.margin
    margin = lo + (hi - lo) * torch.rand(S, generator=gen, dtype=DTYPE)
    prior[torch.arange(S), preferred] += margin
    phi = torch.randn(S, D, generator=gen, dtype=DTYPE)
    phi = phi / phi.norm(dim=-1, keepdim=True)
    other = (preferred + torch.randint(1, V, (S,), generator=gen)) % V  # never the preferred token
    keep = torch.rand(S, generator=gen) < config.target_is_preferred
    target = torch.where(keep, preferred, other)
    return prior, phi, target


class _SGD:
    def __init__(self, param: torch.Tensor, lr: float):
        self.param, self.lr = param, lr

    @torch.no_grad()
    def __call__(self, grad: torch.Tensor) -> None:
        self.param -= self.lr * grad


class _Adam:
    """torch.optim.Adam's update written out: building a torch.optim optimizer imports torch._dynamo (seconds)."""

    def __init__(self, param: torch.Tensor, lr: float, betas=(0.9, 0.999), eps: float = 1e-8):
        self.param, self.lr, self.betas, self.eps, self.t = param, lr, betas, eps, 0
        self.m, self.v = torch.zeros_like(param), torch.zeros_like(param)

    @torch.no_grad()
    def __call__(self, grad: torch.Tensor) -> None:
        b1, b2 = self.betas
        self.t += 1
        self.m.mul_(b1).add_(grad, alpha=1 - b1)
        self.v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        m_hat, v_hat = self.m / (1 - b1**self.t), self.v / (1 - b2**self.t)
        self.param -= self.lr * m_hat / (v_hat.sqrt() + self.eps)


def _run(config: ToyConfig, method: Method) -> dict[str, pd.DataFrame]:
    gen = torch.Generator().manual_seed(config.seed)
    prior, phi, target = _world(config, gen)
    S, V, D, T = config.n_states, config.vocab_size, config.feature_dim, config.seq_len
    B = config.n_prompts * config.group_size
    n = B * T  # token-mean denominator: every response token, in every Lopti stage (PAPER.md §4)
    K = len(config.bins) - 1
    W = torch.zeros(V, D, dtype=DTYPE, requires_grad=True)
    step_W = _Adam(W, config.lr) if config.optimizer == "adam" else _SGD(W, config.lr)
    steps, bins, int_cols, float_cols = [], [], [], []

    def logits_of(states):
        return prior[states] + phi[states] @ W.T  # (..., V)

    def logp_of(states, tokens):
        return logits_of(states).log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)  # (B, T)

    for _ in range(config.steps):
        states = torch.randint(S, (config.n_prompts, T), generator=gen).repeat_interleave(
            config.group_size, 0
        )  # (B, T)
        with torch.no_grad():
            logits = logits_of(states)  # (B, T, V)
            # Gumbel-max sampling: argmax(z + Gumbel noise) ~ softmax(z), and much faster than multinomial
            u = torch.rand(B, T, V, generator=gen, dtype=DTYPE).clamp_min(torch.finfo(DTYPE).tiny)
            tokens = (logits - (-u.log()).log()).argmax(-1)  # (B, T)
            pi = logits.softmax(-1)  # (B, T, V)
            p_old = pi.gather(-1, tokens[..., None]).squeeze(-1)  # (B, T)
            old_logp = p_old.log()
            rewards = (tokens == target[states]).to(DTYPE).mean(-1)  # (B,)
            adv = group_advantages(rewards, config.group_size)[:, None].expand(B, T)  # (B, T)
            weight = (method.alpha * p_old + 1 - method.alpha) * adv  # AR, Eq. 4
            bin_of = bin_index(p_old, config.bins)  # (B, T)
            pi_all = (prior + phi @ W.T).softmax(-1)  # (S, V): the policy in every state
            steps.append((rewards.mean(), pi_all[torch.arange(S), target].mean(), (pi_all.argmax(-1) == target).sum()))

            # Fig. 1d at the start of the step (ratio = 1): the bin's gradient -(1/n) sum_t w_t (e_y - pi_t) phi_t^T
            e_minus_p = -pi
            e_minus_p.scatter_add_(-1, tokens[..., None], torch.ones_like(pi[..., :1]))  # (B, T, V)
            norms = e_minus_p.norm(dim=-1)  # (B, T): ||e_y - pi||, as logit_grad_norm computes it
            per_bin = torch.nn.functional.one_hot(bin_of, K).to(DTYPE) * (-weight / n)[..., None]  # (B, T, K)
            coef_phi = (per_bin[..., None] * phi[states][..., None, :]).view(n, K * D)  # (B*T, K*D)
            g_bins = (e_minus_p.view(n, V).T @ coef_phi).view(V, K, D).transpose(0, 1)  # (K, V, D)
            g_all = g_bins.sum(0)
            counts = torch.bincount(bin_of.view(-1), minlength=K)  # (K,)
            norm_sums = torch.zeros(K, dtype=DTYPE).index_add_(0, bin_of.view(-1), norms.view(-1))  # (K,)
            bins.append(
                torch.stack(
                    [
                        counts.to(DTYPE),
                        g_bins.flatten(1).norm(dim=-1),
                        (g_bins * g_all).flatten(1).sum(-1) / g_all.square().sum().clamp_min(torch.finfo(DTYPE).tiny),
                        norm_sums / counts.clamp_min(1),
                    ],
                    dim=-1,
                )  # (K, 4)
            )

        stages = [torch.ones_like(p_old, dtype=torch.bool)]
        if method.eta is not None:
            low = p_old < method.eta
            stages = [low, ~low]  # Lopti: stage 1 the low-probability tokens, stage 2 the rest (§4)
        for stage in stages:
            ratio = (logp_of(states, tokens) - old_logp).exp()  # pi_old is not recomputed between Lopti's stages
            surr1 = ratio * weight
            surr2 = ratio.clamp(1 - config.clip_eps, 1 + config.clip_eps) * weight
            per_token_loss = -torch.minimum(surr1, surr2)
            loss = (per_token_loss * stage).sum() / n
            (grad,) = torch.autograd.grad(loss, W)
            step_W(grad)

        with torch.no_grad():
            new_logp = logp_of(states, tokens)  # (B, T)
        int_cols.append(torch.stack([states, tokens, bin_of]).view(3, n).T)  # (B*T, 3)
        # the move's direction from the log-probs (shift_summary): exp() of a probability near 1 can hide it
        moves = [p_old, norms, adv, weight, new_logp.exp(), new_logp - old_logp]
        float_cols.append(torch.stack(moves).view(len(moves), n).T)  # (B*T, 6)

    seq, pos = torch.meshgrid(torch.arange(B), torch.arange(T), indexing="ij")
    ints = torch.cat(int_cols).numpy()  # (steps*B*T, 3)
    floats = torch.cat(float_cols).double().numpy()  # (steps*B*T, 6)
    tokens = pd.DataFrame(
        {
            "step": np.repeat(np.arange(config.steps), n),
            "method": method.name,
            "seq": np.tile(seq.reshape(-1).numpy(), config.steps),
            "pos": np.tile(pos.reshape(-1).numpy(), config.steps),
            "state": ints[:, 0],
            "token": ints[:, 1],
            "prob": floats[:, 0],
            "grad_norm": floats[:, 1],
            "advantage": floats[:, 2],
            "weight": floats[:, 3],
            "bin": ints[:, 2],
            "p_new": floats[:, 4],
            "delta_p": floats[:, 4] - floats[:, 0],
            "dlogp": floats[:, 5],
        }
    )
    step_stats = torch.tensor([[r, p, a / S] for r, p, a in steps], dtype=torch.float64).numpy()
    steps_frame = pd.DataFrame(
        {
            "step": np.arange(config.steps),
            "method": method.name,
            "reward": step_stats[:, 0],
            "p_target": step_stats[:, 1],
            "accuracy": step_stats[:, 2],
        }
    )
    per_bin = torch.stack(bins).double().numpy()  # (steps, K, 4)
    bins_frame = pd.DataFrame(
        {
            "step": np.repeat(np.arange(config.steps), K),
            "method": method.name,
            "bin": np.tile(np.arange(K), config.steps),
            "label": np.tile(bin_labels(config.bins), config.steps),
            "n_tokens": per_bin[..., 0].reshape(-1).astype(int),
            "token_share": per_bin[..., 0].reshape(-1) / n,
            "grad_norm": per_bin[..., 1].reshape(-1),
            "grad_share": per_bin[..., 2].reshape(-1),
            "token_grad_norm": np.where(per_bin[..., 0] > 0, per_bin[..., 3], np.nan).reshape(-1),
        }
    )
    return {"steps": steps_frame, "bins": bins_frame, "tokens": tokens}


def simulate(config: ToyConfig | None = None, methods: Sequence[Method] = METHODS) -> ToyResult:
    """Train the toy policy of `ToyConfig` with each method from the same seed and return tidy tables.

    Every method starts from the same world and the same first batch (the sampling generator is reseeded per method),
    so step 0's tables differ only by what the method does with that batch, and `Method("AR", alpha=0)` reproduces
    GRPO exactly.

    What it shows, default config (1.3 s on one CPU thread; seeds 0-2 agree):
    - the 1 - p scaling (Fig. 1a/d, 2a): at step 0 the lowest bin holds 32% of the sampled tokens and 84% of the
      gradient (grad_share), the top bin 55% of the tokens and under 1%; per token, ||e_y - pi|| averages 1.07 in the
      lowest bin and 0.07 in the top one, every token inside the wedge of `grad_norm_bounds`.
    - under Adam (the default, as the paper trains), Lopti and AR + Lopti end with a higher reward than GRPO (0.67 vs
      0.62 at seed 0, +0.03 to +0.05 over seeds 0-2): their second stage gives the high-probability tokens a
      normalised step of their own. AR alone is indistinguishable from GRPO there.
    - under SGD (``optimizer="sgd", lr=80``), AR raises the top bin's correct ratio (A > 0) by 0.01-0.04, as the
      paper's Fig. 2b has it, but learns slower (reward 0.65 vs 0.67 at seed 0); Lopti equals GRPO.
    - what it does NOT reproduce: the top bin's correct ratio stays well above 0.5 (0.6-0.9) for every method, where
      the paper's GRPO falls below 0.5; one linear head on fixed features interferes far less than an LLM's layers.

    Example: ``res = simulate(ToyConfig(steps=5)); res.bins.query("step == 0 and method == 'GRPO'")``.
    """
    config = config or ToyConfig()
    names = [m.name for m in methods]
    if not names:
        raise ValueError("methods must name at least one Method")
    if len(set(names)) != len(names):
        raise ValueError(f"method names must be unique, got {names}")
    runs = [_run(config, m) for m in methods]
    tokens = pd.concat([r["tokens"] for r in runs], ignore_index=True)
    return ToyResult(
        steps=pd.concat([r["steps"] for r in runs], ignore_index=True),
        bins=pd.concat([r["bins"] for r in runs], ignore_index=True),
        shift=shift_summary(tokens, config.bins, by=("method", "step")),
        tokens=tokens,
    )


def sampled_tokens(n: int = 5000, vocab_size: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Tokens sampled from random softmax distributions of every sharpness: one token per distribution, its
    probability `prob` and the norm `grad_norm` of d log pi_y / dz = e_y - pi. Fig. 2a's wedge, in numbers.

    Logits are standard normal times a scale drawn log-uniformly in [0.3, 30], so both flat and peaked distributions
    (and therefore both rare and confident tokens) appear.
    """
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.empty(n, 1, dtype=torch.float64).uniform_(math.log(0.3), math.log(30), generator=gen))
    logits = torch.randn(n, vocab_size, generator=gen, dtype=torch.float64) * scale  # (n, V)
    tokens = torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(-1)  # (n,)
    prob = logits.softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    return pd.DataFrame({"prob": prob.numpy(), "grad_norm": logit_grad_norm(logits, tokens).numpy()})
