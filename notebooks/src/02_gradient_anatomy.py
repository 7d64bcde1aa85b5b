# %% [markdown]
# # 02 · Gradient anatomy of a real policy
#
# Notebook 01 showed the 1 - p law on one softmax. Here we measure it on a language-model policy answering K&K
# puzzles: sample responses, look at every response token's probability, split the policy gradient by probability
# bin, and reproduce the paper's Fig. 1 and Fig. 2 with our probes. At the end, one frozen batch is updated four
# ways (GRPO, GRPO+AR, GRPO+Lopti, GRPO+AR+Lopti) from the same weights to see what each fix changes.
#
# **Run time** of a full run (QUICK = False) on a CPU with the lab model: the last build's, with its machine, is in
# [docs/numbers.md](../docs/numbers.md).

# %%
# Setup (run first). QUICK = True makes every heavy cell take seconds (the tests run it that way).
QUICK = False

import sys

if "google.colab" in sys.modules:  # on Colab: install lopti_lab's wheel and turn on the widget manager
    from pathlib import Path

    from google.colab import output

    # lopti_lab is not on PyPI: build its wheel in a checkout (`pip wheel --no-deps -w dist .`) and upload it to
    # Colab's Files panel, or beside this notebook into dist/ (README, "Colab"); the newest one found is installed
    wheels = sorted([*Path.cwd().glob("lopti_lab-*.whl"), *Path.cwd().glob("dist/lopti_lab-*.whl")],
                    key=lambda path: path.stat().st_mtime)  # fmt: skip
    if not wheels:
        raise FileNotFoundError(f"no lopti_lab-*.whl in {Path.cwd()} or its dist/: upload one (see the comment above)")
    %pip install -q "{wheels[-1]}"

    output.enable_custom_widget_manager()

from IPython.display import HTML

%matplotlib inline

from lopti_lab import counterfactual, kk, models, notebook, plots, probes, readouts, widgets

env = notebook.setup(quick=QUICK)
env

# %%
lora = None if env.lora_r is None else models.LoraSpec(r=env.lora_r)
model, tokenizer = models.load_policy(env.model, lora=lora, device=env.device)
puzzles = kk.load_split("train", [3], limit=2 if QUICK else 4)
batch = counterfactual.frozen_batch(model, tokenizer, puzzles, group_size=4 if QUICK else 6,
                                 prompt_style=env.prompt_style, temperature=1.0,
                                 max_new_tokens=640 if env.model == "lab" else 1024)
rollout = batch.rollout
print(f"{len(rollout)} responses, {int(rollout.response_mask.sum())} response tokens, "
      f"rewards {sorted(batch.rewards.tolist())}")

# %% [markdown]
# ## Every token, coloured by its probability
#
# Red tokens were sampled against the policy's odds, green ones were near certain. Most of a response is green;
# the red ones are where the gradient will come from.

# %%
row = int(batch.rewards.argmax())
n = int(rollout.response_mask[row].sum())
pieces = [tokenizer.decode([i]) for i in rollout.response_ids[row, :n].tolist()]
HTML(plots.token_html(pieces, rollout.old_logp[row, :n].exp().tolist()))

# %% [markdown]
# ## The wedge on real tokens (Fig. 2a)
#
# `probes.token_stats` computes every response token's probability and the exact norm of
# $\partial \log \pi(o_t) / \partial z_t = e_{o_t} - \pi_t$ at its logits, without a backward pass.

# %%
stats = probes.token_stats(model, rollout.input_ids, rollout.attention_mask, rollout.response_mask,
                           temperature=batch.temperature)
tokens = stats.to_frame()
print(tokens.groupby("bin")[["prob", "grad_norm"]].agg(["count", "mean"]).round(3))
display(plots.fig2(tokens=tokens, vocab_size=stats.vocab_size))
readouts.wedge(tokens, vocab_size=stats.vocab_size)

# %% [markdown]
# ## Which bin carries the update (Fig. 1)
#
# `probes.selective_sweep` takes one SGD step (lr $10^{-3}$, as the paper) on the policy-gradient loss of all tokens,
# then of each probability bin alone, measures the gradient norm and how every token's probability moved, and
# restores the weights each time. Panels: (a) share of tokens per bin, (b) their advantages, (c) probability change
# after the update on all tokens, (d) gradient norm of each bin alone vs all, (e) the change when updating only the
# lowest bin, (f) only the highest bin. Panels (c), (e) and (f) each have their own scale: compare their axes, or the
# read-out below the figure, which puts the three side by side.

# %%
sweep_tokens, sweep_grads = probes.selective_sweep(model, rollout.input_ids, rollout.attention_mask,
                                                   rollout.response_mask, batch.advantages,
                                                   temperature=batch.temperature)
display(plots.fig1(sweep_tokens, sweep_grads))
readouts.fig1(sweep_tokens, sweep_grads)

# %% [markdown]
# ## Two exact attributions
#
# The policy gradient is a sum over tokens, so it splits exactly into one part per probability bin, in two ways.
# **loss**: the gradient of the summed losses of a bin's tokens, through the whole network. **position**: every
# weight gradient is $\sum_t g_t a_t^\top$ over input positions; keep the positions that predict a bin's tokens
# (the prompt's positions form the `context` row). They differ because attention carries one token's loss to other
# positions. `grad_share` is $\langle g_k, g\rangle / \|g\|^2$: it adds up to one over the rows.

# %%
tables = counterfactual.attribution_tables(model, batch)
tables.query("scope == 'model'").pivot_table(index="label", columns="attribution",
                                              values=["token_share", "grad_share", "grad_norm"], sort=False).round(3)

# %% [markdown]
# ## The same batch, four updates (Fig. 2b)
#
# Each method's update (its optimizer steps for one RL step, exactly as the trainer takes them) is applied to this
# frozen batch from the same weights; then we count, per probability bin, the share of positive-advantage tokens whose
# probability went up (the "correct ratio"). In the paper, over training, GRPO's ratio falls below 0.5 in the top bin
# while AR and Lopti hold it up; one small SGD step need not show that (the read-out says what it shows, and why).
# The moves are measured between float64 forwards: a token near p = 1 moves by 1e-5 to 1e-8 in one small update,
# below a float32 log-prob's rounding, and a token whose log-prob did not move at all is counted apart (the light bars
# on the right axis: the unmoved share), not as moved the wrong way. A small batch makes these ratios noisy: QUICK mode
# only checks that the machinery runs.

# %%
shift = counterfactual.counterfactual(model, batch, lr=1e-3 if env.model == "lab" else 1e-4, optimizer="sgd")
display(shift.updates)
display(plots.fig2(shift=shift.bins))
readouts.correct_ratios(shift.bins, optimizer="sgd")

# %% [markdown]
# ## Fig. 3 during training, and why the optimizer decides it
#
# The paper measures its Fig. 3 inside training: at every step the real update runs (both Lopti stages), the
# log-probs are recomputed on the same batch, and the share of positive-advantage tokens whose probability rose is
# counted per probability bin. `lopti-lab mechanism` does that for the four methods under three optimizer settings
# (the paper's SGD at lr $10^{-3}$, AdamW at $\epsilon = 10^{-8}$, the demo's AdamW at $\epsilon = 10^{-3}$), in
# float64 and in bf16 as the paper's code computes it (solid: among the tokens that moved; dashed: an unmoved token
# counted as not up); the grey band and the dotted line are the paper's values. The table read here is your own
# `reports/mechanism` if you ran the command, else the study recorded with lopti_lab (docs/mechanism.md).
#
# The switch picks the optimizer; below the figure, this notebook's frozen batch measured live under that optimizer's
# first step: the correct ratio of the top bin's A > 0 tokens when every token is updated, when only the top bin is,
# and when only the other bins are, and how much of the all-token move lies along the other bins' move
# (`from_rest`). Under SGD the update is the sum of the bins' updates; under AdamW's sign-like first step it is not
# (`additivity`).

# %%
from lopti_lab.studies.mechanism import fig3_source
from lopti_lab.paths import shown

table, source = fig3_source()
print("Fig. 3 table from", shown(source))
panel = widgets.MechanismPanel(table, model, batch)
display(panel)
readouts.mechanism(table, panel.parts)

# %% [markdown]
# ## Where GRPO's top bin does fall below one half: the mechanism map
#
# The paper's premise is that GRPO pushes the top bin's A > 0 tokens the wrong way (correct ratio below 0.5 for
# p > 0.75). The mechanism map looks for where that happens: one frozen batch per seed, updated once by each method
# from the same weights, over the learning rate (SGD and AdamW), the batch size, the warm start and the model width,
# the correct ratio counted in float64 among the top bin's A > 0 tokens. The table is the map recorded with lopti_lab
# (`data/mechanism/map_summary.csv`; docs/mechanism.md gives the commands and what each axis holds). It is
# exploratory: the later axes were chosen after the learning-rate axis had been seen. Filled markers are SGD, open
# ones AdamW; the grey band is the paper's AR and Lopti (0.52-0.53), the line is one half.

# %%
import pandas as pd

from lopti_lab.paths import data_dir
from lopti_lab.studies.mechanism_map import plot_map

map_table = pd.read_csv(data_dir() / "mechanism" / "map_summary.csv")
display(plot_map(map_table))
readouts.mechanism_map(map_table)
