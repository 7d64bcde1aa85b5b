"""Gradient probes: how much of an update each probability bin of response tokens carries, on any HF causal LM.

Shape legend: B = sequences (prompts x group size), L = input length (prompt + response), T = response tokens,
V = vocabulary, K = probability bins, G = K + 1 position groups (bins + `context`), N = B * L flattened positions.

Layout (the trainer's contract). ``input_ids`` (B, L) is [left-padded prompt | right-padded response of T tokens], so
the response is the LAST T input positions and the logits at input position L - T - 1 + t predict response token t.
Per-token tensors are (B, T) over response tokens: ``logp``, ``old_logp``, ``response_mask`` (bool or 0/1) and
``per_token_loss``. The probabilities that pick a token's bin are the rollout's, ``old_logp.exp()`` (docs/paper.md §5);
bins are edges as `bins.check_bins` takes them (default [0, .25), [.25, .5), [.5, .75), [.75, 1]).

What it measures. The paper's claim is about the size of the gradient each token sends (its Fig. 1d). Two exact
attributions split the gradient g of sum_t mask_t per_token_loss_t into per-bin parts g_k that add up to g:

* ``attribution="loss"``: g_k = d(sum of the losses of bin k's tokens) / d theta, the whole effect of those tokens'
  losses wherever it flows. K vector-Jacobian products: ONE batched backward (``torch.autograd.grad`` with
  ``is_grads_batched``, K gradients in memory), or with ``batched=False`` one backward for g and one per bin but the
  largest (g minus the others), norms taken in parameter hooks. Exact for every parameter; costs about K backwards.
* ``attribution="position"``: a Linear weight's gradient is a sum over input positions, dW = sum_t g_t a_t^T (g_t the
  gradient at its output at position t, a_t its input); g_k keeps the terms of the positions that PREDICT a bin-k
  token, and the positions that predict no response token (prompt, padding, the last one) form the `context` row, so
  bins + context = g. Hooks capture a_t and g_t during the ordinary backward and no per-token gradient is ever formed:
  a matmul per group of positions, or the Gram identity ||sum_t g_t a_t^T||^2 = sum_{t,s} (g_t.g_s)(a_t.a_s) when the
  batch is short, whichever is cheaper. Splits Linear weights and biases (LoRA's A and B are Linears), Embedding
  weights (tied lm_heads included) and GPT-2's Conv1D; not norms. Costs a fraction of one backward.

The two differ because attention carries token t's loss to other positions: g_t at an early layer holds gradient from
every later token's loss, so a position's row mixes the losses of many tokens, while a loss row follows one set of
losses through every position. After the last attention (final MLP, lm_head) the network is position-wise and the two
agree exactly; tests/test_probes.py checks both facts.

Tables have one row per (scope, bin): scope "model" (all probed parameters), and per layer or per parameter with
``level=``; rows for the bins, `context` (position only) and `all` (g itself). Columns: `attribution`, `scope`, `bin`
(Int64, <NA> for context/all), `label`, `n_tokens`, `token_share`, `grad_norm` = ||g_k||, `grad_share` =
<g_k, g> / ||g||^2 (adds up to 1 over the rows; negative when a bin pulls against the rest), `norm_ratio` =
||g_k|| / ||g||, `cosine`, `n_params`.

For the trainer, every k steps, around its real forward + backward (cheap, "position"):

    with GradientProbe(policy, bins=(0, .25, .5, .75, 1)) as probe:  # hooks on; params=None: all it can split
        for mb in minibatches:
            probe.set_tokens(mb.old_logp.exp(), mb.response_mask)    # (B, T) each, BEFORE the forward
            logits = policy(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            loss = objective.policy_loss(...)                        # any loss of these response tokens
            loss.backward()                                          # one record per backward; grads untouched
            optimizer.step(); optimizer.zero_grad()
    metrics.update(probe.metrics())  # {"grad/norm_bin0": .., "grad/share_bin0": .., "tokens/share_bin0": .., ...}
    table = probe.summary()          # the per-bin table averaged over the records (probe.frame(): every record)

and occasionally, on one minibatch, the exact loss attribution (about K backwards; ``accumulate=True`` leaves the full
gradient in .grad as loss.backward() would, so the call can replace that minibatch's backward):

    table = bin_gradient_norms(policy, per_token_loss, old_logp.exp(), response_mask, accumulate=True)
    metrics.update(to_metrics(table, prefix="loss_attr/"))

Once detached (the ``with`` block ends) the probe has removed every hook and costs nothing.
"""

from lopti_lab.probes._common import summarize, to_metrics
from lopti_lab.probes.loss_attribution import bin_gradient_norms, bin_gradients
from lopti_lab.probes.position import GradientProbe
from lopti_lab.probes.shift import (
    ProbabilityShift,
    SelectiveUpdate,
    probability_shift,
    selective_sweep,
    selective_update,
    selective_updates,
    shift_summary,
)
from lopti_lab.probes.token_stats import TokenStats, token_stats
from lopti_lab.probes.update_shift import fig3_metrics, positive_rows, update_logprobs

__all__ = [
    "GradientProbe",
    "ProbabilityShift",
    "SelectiveUpdate",
    "TokenStats",
    "bin_gradient_norms",
    "bin_gradients",
    "fig3_metrics",
    "positive_rows",
    "probability_shift",
    "selective_sweep",
    "selective_update",
    "selective_updates",
    "shift_summary",
    "summarize",
    "to_metrics",
    "token_stats",
    "update_logprobs",
]
