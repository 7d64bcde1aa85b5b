"""The token-credit instrument on anyone's TRL run: a callback for a stock ``trl.GRPOTrainer`` (or our
``LoptiGRPOTrainer``) that logs, every N optimizer steps and per bin of the rollout probability pi_old, what
``lopti_lab.probes.credit`` defines (token share, advantage mass by sign, gradient share, clipped share, entropy, the
paper's Fig. 3 correct ratio), through the trainer's own logging:

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    TokenCreditCallback(every=1).attach(trainer)   # adds itself to trainer.callback_handler
    trainer.train()                                 # trainer.state.log_history rows carry tokens/share_bin0, ...

TRL's class is not changed. A callback's hooks see no batch, so ``attach`` wraps ``compute_loss`` on this trainer
instance (the public ``Trainer.compute_loss(model, inputs, return_outputs, num_items_in_batch)``): it sees each
micro-step's inputs after TRL prepared them, before the loss forward. Which metric needs which hook:

``compute_loss`` (every micro-step of a measured step, before TRL's forward)  one no-grad forward of the micro-batch
    at the current weights (eval mode, log-probs and entropy from float32 logits, ``rollout.response_logprobs``):
    pi_old to bin by when TRL keeps none (on its single-iteration path the weights are still the rollout's, TRL's
    own reason to skip that forward), the entropy, the ratio against TRL's ``old_per_token_logps`` for the clipped
    share, and Fig. 3's "before". Token and advantage sums read ``inputs`` (``completion_mask`` x ``tool_mask``: the
    tokens the loss covers; ``advantages`` as the loss reads them, AR applied: where our subclass applies AR inside
    the loss forward, here with the same ``objective.reweight_advantages`` of this pi_old). The probe is told the
    bins here.
``GradientProbe`` hooks (the backward TRL runs)  the gradient share, exact position attribution of the real
    gradient, one record per backward (``probes.GradientProbe``; it keeps no layer input beyond what autograd keeps).
``on_step_end`` (after the optimizer step)  Fig. 3's "after": one no-grad forward of the step's A > 0 rows (the
    sequence advantage before AR, as the paper's code); then every sum is added over processes
    (``accelerator.reduce``, one collective) and appended to TRL's per-step metric store (``GRPOTrainer._metrics``),
    which ``GRPOTrainer.log`` averages over the logging window, NaN left out, and hands to ``Trainer.log``:
    log_history, TensorBoard, W&B or trackio, as configured.

What it cannot see, and so leaves out: TRL's fused LM head (``add_fused_lm_head``) projects the output embedding
functionally, not as a module call, so its gradient cannot be split by position: the output head (and an input
embedding tied to it) is not probed, and the gradient share is over every other trainable Linear / Embedding
weight (LoRA's A and B included). Its clipping uses TRL's ``epsilon_low`` / ``epsilon_high`` on the callback's
forward, equal to TRL's own ratio to float rounding. Under Lopti each optimizer step is one stage: its row covers
that stage's tokens (TRL's loss mask), where our trainer's row covers the RL step. A step whose optimizer step was
skipped (fp16 overflow) shows Fig. 3's tokens unmoved.

Cost at every=1: one forward of the step's rows, one of its A > 0 rows, and the probe's split (benchmarks/
bench_trl_callback.py measures the ratio to a plain step side by side). Memory: the probe keeps no layer input beyond
what the step's backward keeps (``GradientProbe``'s bound); the two extra forwards are no-grad, run between TRL's
(never beside its activations), in row chunks of at most ``LOGITS_PER_CHUNK`` logits; the step's A > 0 rows keep
their ids and (k, T) log-probs until the step ends. tests/test_trl_callback_memory.py measures a TRL micro-step's
peak on a Qwen2.5-0.5B shape with LoRA and checkpointing: the same with the callback as without (bound 1.25x).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from transformers import TrainerCallback

from lopti_lab.bins import DEFAULT_BINS, check_bins
from lopti_lab.objective import reweight_advantages
from lopti_lab.probes.credit import CreditSums, fig3_sums, gradient_sums, token_sums
from lopti_lab.probes.float64 import float64_response_logprobs
from lopti_lab.probes.position import GradientProbe, _module_kind
from lopti_lab.rollout import response_logprobs

__all__ = ["PRECISIONS", "TokenCreditCallback", "credit_rows", "probed_params"]

PRECISIONS = ("float32", "float64")
SEQUENCE_ADVANTAGES = "sequence_advantages"  # LoptiGRPOTrainer's (B,) advantages before AR (integrations.trl)
LOGITS_PER_CHUNK = 2**26  # logits of one extra forward: 128 MiB in bfloat16


class TokenCreditCallback(TrainerCallback):
    """Per-bin token credit of every ``every``-th optimizer step, logged through the trainer (module docstring).

    every: measure optimizer steps 1, 1 + every, ...; bins: probability bin edges (default the paper's quarters);
    fig3_precision: "float32" (a forward in the model's dtype, log-probs from float32 logits) or "float64" (the
    exact ``probes.float64`` forward, about 2.5x a float32 one on a CPU, as our trainer's Fig. 3); fig3_rows: at
    most this many A > 0 rows per micro-step for Fig. 3 (None: all).
    """

    def __init__(
        self,
        every: int = 1,
        bins: Sequence[float] = DEFAULT_BINS,
        fig3_precision: str = "float32",
        fig3_rows: int | None = None,
    ):
        if not (isinstance(every, int) and every >= 1):
            raise ValueError(f"TokenCreditCallback.every must be an int >= 1, got {every!r}")
        if fig3_precision not in PRECISIONS:
            raise ValueError(f"TokenCreditCallback.fig3_precision must be one of {PRECISIONS}, got {fig3_precision!r}")
        if fig3_rows is not None and not (isinstance(fig3_rows, int) and fig3_rows >= 1):
            raise ValueError(f"TokenCreditCallback.fig3_rows must be None or an int >= 1, got {fig3_rows!r}")
        self.every, self.bins, self.fig3_precision, self.fig3_rows = every, check_bins(bins), fig3_precision, fig3_rows
        self.trainer = None
        self._original = None
        self._probe: GradientProbe | None = None
        self._active = False
        self._sums: CreditSums | None = None
        self._fig3: list[tuple] = []
        self.last: dict[str, float] = {}  # the metrics of the last measured step (every process has them)
        self.last_local: CreditSums | None = None  # that step's sums on this process, before the reduction

    # --- attaching --------------------------------------------------------------------------------------------------

    def attach(self, trainer) -> TokenCreditCallback:
        """Add this callback to ``trainer`` and wrap its ``compute_loss`` (this instance only) to see each
        micro-step's inputs. Returns self; ``detach()`` undoes both."""
        if self.trainer is not None:
            raise RuntimeError("TokenCreditCallback is already attached to a trainer")
        if not hasattr(trainer, "_metrics"):
            raise TypeError(f"TokenCreditCallback needs a TRL GRPOTrainer, got {type(trainer).__name__}")
        self.trainer, self._original = trainer, trainer.compute_loss
        original = self._original

        @functools.wraps(original)
        def compute_loss(model, inputs, *args, **kwargs):
            if self._active and model.training and torch.is_grad_enabled():
                self._before_loss(model, inputs)
            return original(model, inputs, *args, **kwargs)

        trainer.compute_loss = compute_loss
        trainer.add_callback(self)
        return self

    def detach(self) -> None:
        if self.trainer is None:
            return
        self._stop_probe()
        if self._original == type(self.trainer).compute_loss.__get__(self.trainer):
            del self.trainer.compute_loss  # the class's own method again
        else:
            self.trainer.compute_loss = self._original  # someone else's wrapper, put back
        self.trainer.remove_callback(self)
        self.trainer, self._original = None, None

    # --- the hooks --------------------------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:  # passed as callbacks=[...]: it would see no batch and log nothing
            raise RuntimeError("TokenCreditCallback sees no batch unless attached: call .attach(trainer) instead")

    def on_step_begin(self, args, state, control, **kwargs):
        self._active = self.trainer is not None and state.global_step % self.every == 0
        self._sums, self._fig3 = None, []

    def on_step_end(self, args, state, control, **kwargs):
        if self._active:
            self._active = False
            self.last = self._finish()
            store = self.trainer._metrics["train"]  # GRPOTrainer.log averages and logs these with its own
            for name, value in self.last.items():
                store[name].append(value)

    def on_train_end(self, args, state, control, **kwargs):
        self._stop_probe()

    # --- one micro-step ---------------------------------------------------------------------------------------------

    def _policy(self, model):
        return self.trainer.accelerator.unwrap_model(model)

    def _logprobs(self, policy, ids, attention, mask, with_entropy: bool):
        """(B, T) log-probs (and entropies) of the response tokens at the current weights: no grad, eval mode, in
        row chunks whose logits hold at most ``LOGITS_PER_CHUNK`` elements (TRL's fused head holds none)."""
        temperature = self.trainer.temperature
        head = policy.get_output_embeddings()
        rows = max(1, LOGITS_PER_CHUNK // (mask.shape[1] * head.weight.shape[0]))
        logps, entropies = [], []
        was_training = policy.training
        policy.eval()
        try:
            with torch.no_grad():
                for start in range(0, len(ids), rows):
                    r = slice(start, start + rows)
                    if self.fig3_precision == "float64" and not with_entropy:
                        logp = float64_response_logprobs(policy, ids[r], attention[r], mask[r], temperature)
                        entropy = None
                    else:
                        logp, entropy = response_logprobs(policy, ids[r], attention[r], mask[r], temperature,
                                                          with_entropy=with_entropy)  # fmt: skip
                    logps.append(logp.float())
                    entropies.append(entropy)
        finally:
            policy.train(was_training)
        return torch.cat(logps), torch.cat(entropies) if with_entropy else None

    def _before_loss(self, model, inputs: dict) -> None:
        policy = self._policy(model)
        completion_mask = inputs["completion_mask"]
        mask = completion_mask if inputs.get("tool_mask") is None else completion_mask * inputs["tool_mask"]  # (B, T)
        mask = mask.float()
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)  # (B, P + T)
        attention = torch.cat([inputs["prompt_mask"], completion_mask], 1)  # (B, P + T)
        logp, entropy = self._logprobs(policy, ids, attention, mask, with_entropy=True)  # (B, T) each
        old = inputs.get("old_per_token_logps")  # (B, T) or None: then this forward IS pi_old
        old_logp = logp if old is None else old.detach().float()  # (B, T)
        p_old = old_logp.exp() * mask  # (B, T)
        trainer = self.trainer
        advantages = inputs["advantages"]  # (B,) or (B, T)
        alpha = getattr(trainer.args, "ar_alpha", None)
        if alpha is not None and advantages.dim() == 1:  # LoptiGRPOTrainer applies AR inside this loss's forward
            advantages = reweight_advantages(advantages, old_logp, alpha) * mask  # (B, T), AR Eq. 4
        sums = token_sums(
            p_old, mask, advantages, bins=self.bins, entropy=entropy,
            log_ratio=torch.zeros_like(logp) if old is None else logp - old.float(),
            clip_low=trainer.epsilon_low, clip_high=trainer.epsilon_high,
        )  # fmt: skip
        self._sums = sums if self._sums is None else self._sums + sums

        # Fig. 3: the A > 0 rows (sequence advantage before AR, the paper's code)
        sequence = inputs.get(SEQUENCE_ADVANTAGES, inputs["advantages"])
        positive = sequence > 0 if sequence.dim() == 1 else (sequence * mask > 0).any(1)  # (B,)
        rows = positive.nonzero()[:, 0]
        if self.fig3_rows is not None:
            rows = rows[: self.fig3_rows]
        if len(rows):
            r = rows  # (k,)
            before = (
                logp[r]
                if self.fig3_precision == "float32"
                else self._logprobs(policy, ids[r], attention[r], mask[r], with_entropy=False)[0]
            )
            self._fig3.append((ids[r], attention[r], mask[r], p_old[r], before))  # fmt: skip

        if self._probe is None:
            self._probe = GradientProbe(policy, self.bins, params=probed_params(policy)).attach()
        self._probe.set_tokens(p_old, mask)

    # --- the step's end ---------------------------------------------------------------------------------------------

    def _finish(self) -> dict[str, float]:
        trainer = self.trainer
        sums = self._sums if self._sums is not None else CreditSums(self.bins)
        if self._probe is not None:
            if self._probe.frame().shape[0]:
                sums = sums + gradient_sums(self._probe)
            self._stop_probe()
        policy = self._policy(trainer.model)
        for ids, attention, mask, p_old, before in self._fig3:
            after, _ = self._logprobs(policy, ids, attention, mask, with_entropy=False)
            sums = sums + fig3_sums(before, after, p_old, mask, bins=self.bins, precision=self.fig3_precision)
        self._sums, self._fig3, self.last_local = None, [], sums
        accelerator = trainer.accelerator
        total = sums.reduced(lambda t: accelerator.reduce(t, reduction="sum"), device=accelerator.device)
        total.precision = self.fig3_precision
        return total.metrics()

    def _stop_probe(self) -> None:
        if self._probe is not None:
            self._probe.detach()
            self._probe = None


def probed_params(policy: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable weights the probe can split under TRL: those of Linear / Embedding / Conv1D modules, less the
    output head's (and so a tied input embedding's), which TRL's fused LM head uses outside any module call."""
    head = policy.get_output_embeddings() if hasattr(policy, "get_output_embeddings") else None
    skip = {id(head.weight)} if head is not None and getattr(head, "weight", None) is not None else set()
    chosen, seen = [], set()
    for module in policy.modules():
        if _module_kind(module) is None:
            continue
        for p in module.parameters(recurse=False):
            if p.requires_grad and id(p) not in skip and id(p) not in seen:
                seen.add(id(p))
                chosen.append(p)
    if not chosen:
        raise ValueError("TokenCreditCallback: the policy has no trainable Linear or Embedding weight to probe")
    return chosen


CREDIT_PREFIXES = ("tokens/share_", "adv/", "grad/share_", "clip/", "entropy/mean_", "fig3/")


def credit_rows(log_history: Sequence[dict]) -> list[dict]:
    """The logged rows that carry the callback's metrics, each cut to ``step`` and those keys (the rest is TRL's).

    Example: ``credit_rows([{"step": 1, "loss": 0.1, "tokens/share_bin0": 0.3}])`` -> ``[{"step": 1,
    "tokens/share_bin0": 0.3}]``."""
    return [
        {"step": row["step"], **{k: v for k, v in row.items() if k.startswith(CREDIT_PREFIXES)}}
        for row in log_history
        if "tokens/share_bin0" in row
    ]
