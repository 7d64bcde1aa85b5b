"""A toy policy that shows low-probability tokens dominating the update, trained by GRPO, AR, Lopti and AR + Lopti.

A softmax sequence policy small enough to train in a second on a CPU, shaped like an LLM's token statistics
(``ToyConfig``); ``simulate`` trains it with each method of ``lopti_lab.methods`` from the same seed and returns tidy
tables of the paper's quantities (Fig. 1a/1d, 2a, 2b). The objective is ``lopti_lab.objective``'s, the same
functions the trainer calls: GRPO's group advantages, AR's weights, Lopti's stage masks and the clipped loss.

Shape legend: B = sequences (prompts x group size G), T = response tokens, V = vocabulary, S = toy states,
D = toy feature dimension, K = probability bins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import pandas as pd
import torch

from lopti_lab.bins import DEFAULT_BINS, bin_index, bin_labels, check_bins
from lopti_lab.methods import METHODS, PAPER, Method
from lopti_lab.objective import group_advantages, lopti_stages, policy_loss, reweight_advantages
from lopti_lab.probes.shift import shift_summary

DTYPE = torch.float32  # the toy's dtype: half float64's time, and AR(alpha=0) == GRPO holds bit for bit anyway


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


@dataclass
class _Policy:
    """The toy policy: logits prior + W phi_s, with the frozen prior (S, V) and state features (S, D) of `_world` and
    the trainable head W (V, D)."""

    prior: torch.Tensor
    phi: torch.Tensor
    W: torch.Tensor

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return self.prior[states] + self.phi[states] @ self.W.T  # (..., V)

    def logp(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.logits(states).log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)  # (B, T)

    def in_every_state(self) -> torch.Tensor:
        return (self.prior + self.phi @ self.W.T).softmax(-1)  # (S, V)


@dataclass
class _Batch:
    """One step's sampled responses under the old policy, scored, with what the update and the tables read."""

    states: torch.Tensor  # (B, T)
    tokens: torch.Tensor  # (B, T)
    p_old: torch.Tensor  # (B, T): pi_old of the sampled token
    old_logp: torch.Tensor  # (B, T)
    rewards: torch.Tensor  # (B,)
    adv: torch.Tensor  # (B, T): GRPO's group advantage of the response, at each of its tokens
    weight: torch.Tensor  # (B, T): the advantage after AR
    bin_of: torch.Tensor  # (B, T): the probability bin of p_old
    e_minus_p: torch.Tensor  # (B, T, V): e_y - pi, the gradient of log pi_y with respect to the logits
    norms: torch.Tensor  # (B, T): ||e_y - pi||, as logit_grad_norm computes it

    @property
    def n(self) -> int:
        """The token-mean denominator: every response token, in every Lopti stage (docs/paper.md §4)."""
        return self.tokens.numel()


@torch.no_grad()
def _sample(config: ToyConfig, method: Method, policy: _Policy, target: torch.Tensor, gen: torch.Generator) -> _Batch:
    """G responses to each of a step's prompts (a prompt: T random states), their rewards, advantages and AR weights."""
    B, T, V = config.n_prompts * config.group_size, config.seq_len, config.vocab_size
    prompts = torch.randint(config.n_states, (config.n_prompts, T), generator=gen)  # (prompts, T)
    states = prompts.repeat_interleave(config.group_size, 0)  # (B, T): each prompt G times
    logits = policy.logits(states)  # (B, T, V)
    # Gumbel-max sampling: argmax(z + Gumbel noise) ~ softmax(z), and much faster than multinomial
    u = torch.rand(B, T, V, generator=gen, dtype=DTYPE).clamp_min(torch.finfo(DTYPE).tiny)
    tokens = (logits - (-u.log()).log()).argmax(-1)  # (B, T)
    pi = logits.softmax(-1)  # (B, T, V)
    p_old = pi.gather(-1, tokens[..., None]).squeeze(-1)  # (B, T)
    old_logp = p_old.log()
    rewards = (tokens == target[states]).to(DTYPE).mean(-1)  # (B,)
    adv = group_advantages(rewards, config.group_size)[:, None].expand(B, T)  # (B, T)
    weight = reweight_advantages(adv, old_logp, method.ar_alpha or 0.0)  # AR, docs/paper.md §3
    e_minus_p = -pi
    e_minus_p.scatter_add_(-1, tokens[..., None], torch.ones_like(pi[..., :1]))  # (B, T, V)
    bin_of = bin_index(p_old, config.bins)  # (B, T)
    return _Batch(states, tokens, p_old, old_logp, rewards, adv, weight, bin_of, e_minus_p, e_minus_p.norm(dim=-1))


@torch.no_grad()
def _policy_stats(policy: _Policy, target: torch.Tensor, batch: _Batch) -> tuple[torch.Tensor, ...]:
    """The batch's mean reward, and over every state the policy's mean probability of the target and the number of
    states whose greedy token is the target."""
    pi_all = policy.in_every_state()  # (S, V)
    return batch.rewards.mean(), pi_all[torch.arange(len(target)), target].mean(), (pi_all.argmax(-1) == target).sum()


@torch.no_grad()
def _bin_gradients(config: ToyConfig, policy: _Policy, batch: _Batch) -> torch.Tensor:
    """Fig. 1d at the start of the step (ratio = 1), per bin (K, 4): its token count, the norm of its tokens' gradient
    -(1/n) sum_t w_t (e_y - pi_t) phi_t^T, that gradient's share <g_bin, g> / ||g||^2 and its mean ||e_y - pi||."""
    K, V, D, n = len(config.bins) - 1, config.vocab_size, config.feature_dim, batch.n
    per_bin = torch.nn.functional.one_hot(batch.bin_of, K).to(DTYPE) * (-batch.weight / n)[..., None]  # (B, T, K)
    coef_phi = (per_bin[..., None] * policy.phi[batch.states][..., None, :]).view(n, K * D)  # (B*T, K*D)
    g_bins = (batch.e_minus_p.view(n, V).T @ coef_phi).view(V, K, D).transpose(0, 1)  # (K, V, D)
    g_all = g_bins.sum(0)
    counts = torch.bincount(batch.bin_of.view(-1), minlength=K)  # (K,)
    norm_sums = torch.zeros(K, dtype=DTYPE).index_add_(0, batch.bin_of.view(-1), batch.norms.view(-1))  # (K,)
    shares = (g_bins * g_all).flatten(1).sum(-1) / g_all.square().sum().clamp_min(torch.finfo(DTYPE).tiny)
    return torch.stack([counts.to(DTYPE), g_bins.flatten(1).norm(dim=-1), shares, norm_sums / counts.clamp_min(1)], -1)


def _update(config: ToyConfig, method: Method, policy: _Policy, step_W, batch: _Batch) -> None:
    """The step's update of W: one step of the clipped loss on every token, or Lopti's two (docs/paper.md §4)."""
    every, eps = torch.ones_like(batch.p_old), config.clip_eps  # the toy clips symmetrically
    stages = [("all", every)] if method.lopti_eta is None else lopti_stages(batch.old_logp, every, method.lopti_eta)
    for _name, stage in stages:  # Lopti: low-probability tokens first, then the rest
        logp = policy.logp(batch.states, batch.tokens)  # (B, T); pi_old stays the sampling policy's in both stages
        loss, _ = policy_loss(logp, batch.old_logp, batch.weight, stage, clip_low=eps, clip_high=eps, denom=batch.n)
        (grad,) = torch.autograd.grad(loss, policy.W)
        step_W(grad)


@torch.no_grad()
def _token_columns(policy: _Policy, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's row after the update: (state, token, bin) (B*T, 3) and (p_old, ||e_y - pi||, advantage,
    weight, p_new, new - old log-prob) (B*T, 6)."""
    new_logp = policy.logp(batch.states, batch.tokens)  # (B, T)
    ints = torch.stack([batch.states, batch.tokens, batch.bin_of]).view(3, batch.n).T  # (B*T, 3)
    # the move's direction from the log-probs (shift_summary): exp() of a probability near 1 can hide it
    moves = [batch.p_old, batch.norms, batch.adv, batch.weight, new_logp.exp(), new_logp - batch.old_logp]
    return ints, torch.stack(moves).view(len(moves), batch.n).T  # (B*T, 6)


def _run(config: ToyConfig, method: Method) -> dict[str, pd.DataFrame]:
    """Train the toy with one method from the config's seed: its steps, bins and tokens tables (`ToyResult`'s)."""
    gen = torch.Generator().manual_seed(config.seed)
    prior, phi, target = _world(config, gen)
    policy = _Policy(prior, phi, torch.zeros(config.vocab_size, config.feature_dim, dtype=DTYPE, requires_grad=True))
    step_W = _Adam(policy.W, config.lr) if config.optimizer == "adam" else _SGD(policy.W, config.lr)
    steps, bins, int_cols, float_cols = [], [], [], []
    for _ in range(config.steps):
        batch = _sample(config, method, policy, target, gen)
        steps.append(_policy_stats(policy, target, batch))
        bins.append(_bin_gradients(config, policy, batch))
        _update(config, method, policy, step_W, batch)
        ints, floats = _token_columns(policy, batch)
        int_cols.append(ints)
        float_cols.append(floats)
    return {
        "steps": _steps_table(config, method, steps),
        "bins": _bins_table(config, method, torch.stack(bins)),
        "tokens": _tokens_table(config, method, torch.cat(int_cols), torch.cat(float_cols)),
    }


def _steps_table(config: ToyConfig, method: Method, steps: list[tuple]) -> pd.DataFrame:
    step_stats = torch.tensor([[r, p, a / config.n_states] for r, p, a in steps], dtype=torch.float64).numpy()
    return pd.DataFrame(
        {
            "step": np.arange(config.steps),
            "method": method.label,
            "reward": step_stats[:, 0],
            "p_target": step_stats[:, 1],
            "accuracy": step_stats[:, 2],
        }
    )


def _bins_table(config: ToyConfig, method: Method, bins: torch.Tensor) -> pd.DataFrame:
    K, n = len(config.bins) - 1, config.n_prompts * config.group_size * config.seq_len
    per_bin = bins.double().numpy()  # (steps, K, 4)
    return pd.DataFrame(
        {
            "step": np.repeat(np.arange(config.steps), K),
            "method": method.label,
            "bin": np.tile(np.arange(K), config.steps),
            "label": np.tile(bin_labels(config.bins), config.steps),
            "n_tokens": per_bin[..., 0].reshape(-1).astype(int),
            "token_share": per_bin[..., 0].reshape(-1) / n,
            "grad_norm": per_bin[..., 1].reshape(-1),
            "grad_share": per_bin[..., 2].reshape(-1),
            "token_grad_norm": np.where(per_bin[..., 0] > 0, per_bin[..., 3], np.nan).reshape(-1),
        }
    )


def _tokens_table(config: ToyConfig, method: Method, ints: torch.Tensor, floats: torch.Tensor) -> pd.DataFrame:
    B, T = config.n_prompts * config.group_size, config.seq_len
    seq, pos = torch.meshgrid(torch.arange(B), torch.arange(T), indexing="ij")
    ints, floats = ints.numpy(), floats.double().numpy()  # (steps*B*T, 3), (steps*B*T, 6)
    return pd.DataFrame(
        {
            "step": np.repeat(np.arange(config.steps), B * T),
            "method": method.label,
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


def simulate(
    config: ToyConfig | None = None, methods: Sequence[Method] = tuple(METHODS[m] for m in PAPER)
) -> ToyResult:
    """Train the toy policy of `ToyConfig` with each method from the same seed and return tidy tables.

    Every method starts from the same world and the same first batch (the sampling generator is reseeded per method),
    so step 0's tables differ only by what the method does with that batch, and `Method("GRPO+AR", ar_alpha=0)`
    reproduces GRPO exactly.

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
    names = [m.label for m in methods]
    others = [m.label for m in methods if not m.is_papers]
    if others:
        raise ValueError(f"the toy trains the paper's methods (AR and Lopti on the clipped loss), not {others}")
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
