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


def _run(config: ToyConfig, method: Method) -> dict[str, pd.DataFrame]:
    gen = torch.Generator().manual_seed(config.seed)
    prior, phi, target = _world(config, gen)
    S, V, D, T = config.n_states, config.vocab_size, config.feature_dim, config.seq_len
    B = config.n_prompts * config.group_size
    n = B * T  # token-mean denominator: every response token, in every Lopti stage (docs/paper.md §4)
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
            weight = reweight_advantages(adv, old_logp, method.ar_alpha or 0.0)  # AR, docs/paper.md §3
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

        every = torch.ones_like(p_old)
        stages = [("all", every)] if method.lopti_eta is None else lopti_stages(old_logp, every, method.lopti_eta)
        for _name, stage in stages:  # Lopti (§4): low-probability tokens first, then the rest
            loss, _ = policy_loss(  # pi_old is not recomputed between Lopti's stages
                logp_of(states, tokens), old_logp, weight, stage, config.clip_eps, config.clip_eps, denom=n
            )
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
    step_stats = torch.tensor([[r, p, a / S] for r, p, a in steps], dtype=torch.float64).numpy()
    steps_frame = pd.DataFrame(
        {
            "step": np.arange(config.steps),
            "method": method.label,
            "reward": step_stats[:, 0],
            "p_target": step_stats[:, 1],
            "accuracy": step_stats[:, 2],
        }
    )
    per_bin = torch.stack(bins).double().numpy()  # (steps, K, 4)
    bins_frame = pd.DataFrame(
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
    return {"steps": steps_frame, "bins": bins_frame, "tokens": tokens}


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
