# %% [markdown]
# # 01 · Why low-probability tokens dominate the gradient
#
# In reinforcement learning of a language model, every sampled response token gets a weight (its advantage, the
# same for every token of a response in GRPO) and the update adds up each token's $\nabla_\theta \log \pi_\theta(o_t)$
# times that weight. Yang et al. (2025) observe that these contributions are far from equal: **tokens the policy
# sampled with low probability send much larger gradients than confident ones**, so a handful of rare tokens decide
# the direction of the update and the many high-probability tokens are barely (or wrongly) moved. This notebook shows
# why, first with one softmax, then with a small policy trained four ways.
#
# **Run time** of a full run (QUICK = False) on a CPU: the last build's, with its machine, is in [docs/numbers.md](../docs/numbers.md).

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

import torch

%matplotlib inline

from IPython.display import display

from lopti_lab import plots, readouts, theory, widgets

# %% [markdown]
# ## One softmax
#
# A token $y$ is drawn from $\pi = \mathrm{softmax}(z)$ over a vocabulary of $N$ tokens. Since
# $\log \pi_y = z_y - \log \sum_k e^{z_k}$, its gradient with respect to the logits is the one-hot vector minus the
# probabilities,
#
# $$ \frac{\partial \log \pi_y}{\partial z} = e_y - \pi, \qquad
#    \|e_y - \pi\|^2 = (1 - \pi_y)^2 + \sum_{k \ne y} \pi_k^2 . $$
#
# The remaining mass $1 - \pi_y$ is spread over the other tokens, so $\sum_{k\ne y}\pi_k^2$ lies between
# $(1-\pi_y)^2/(N-1)$ (spread evenly) and $(1-\pi_y)^2$ (all on one token). Hence the wedge
#
# $$ \sqrt{\tfrac{N}{N-1}}\,(1 - \pi_y) \;\le\; \|e_y - \pi\| \;\le\; \sqrt{2}\,(1 - \pi_y): $$
#
# **the gradient through the logits shrinks linearly to zero as the token's probability goes to one.** A token
# sampled at $\pi = 0.05$ pushes with a norm near 1; one at $\pi = 0.95$ with about 0.05, twenty times less.

# %%
# theory.logit_grad_norm is the closed form; autograd of log_softmax agrees to machine precision.
z = torch.randn(6, 50, dtype=torch.float64, requires_grad=True)
y = torch.randint(50, (6,))
closed = theory.logit_grad_norm(z.detach(), y)
autograd = torch.stack([torch.autograd.grad(z[i].log_softmax(-1)[y[i]], z)[0][i].norm() for i in range(6)])
print("max difference:", (closed - autograd).abs().max().item())
p = z.softmax(-1)[torch.arange(6), y].detach()
lower, upper = theory.grad_norm_bounds(p, 50)
print("inside the wedge:", bool(((lower <= closed + 1e-12) & (closed <= upper + 1e-12)).all()))

# %% [markdown]
# Sampling many tokens from distributions of every sharpness fills exactly that wedge (the paper's Fig. 2a):

# %%
tokens = theory.sampled_tokens(n=1000 if QUICK else 10000, vocab_size=1000)
display(plots.fig2(tokens=tokens, vocab_size=1000))
readouts.wedge(tokens, vocab_size=1000)

# %% [markdown]
# Move the temperature: a hot softmax flattens every probability and every token's gradient is large; a cold one
# makes the top token nearly certain and its gradient vanishes, while the rare tokens keep norms near one.

# %%
explorer = widgets.SoftmaxExplorer()
display(explorer)
readouts.softmax(explorer.frame(), explorer.temperature.value)  # at the temperature the page opens with

# %% [markdown]
# ## Through the network
#
# The logits are the last layer. The paper's proposition carries the wedge down: if every layer's Jacobian has
# singular values in $[c_l, d_l]$, the gradient that token $o_t$ sends to the activations of layer $l$ obeys
#
# $$ \prod_{j>l} c_j \,|w_t|\, \sqrt{\tfrac{N}{N-1}}\,(1-\pi_t) \;\le\; \|\delta_l(o_t)\| \;\le\;
#    \prod_{j>l} d_j \,|w_t|\, \sqrt{2}\,(1-\pi_t), $$
#
# with $w_t$ the token's weight in the policy gradient (its advantage, times the PPO ratio and trust-region
# indicator). Every layer sees the same $1 - \pi_t$ factor. In a real batch most tokens are confident (60% above
# $\pi = 0.75$ in the paper's Qwen2.5-7B on K&K), yet the lowest-probability bin alone carries most of the gradient's
# norm, and updating on it alone moves the high-probability tokens as much as the full update does. Notebook 02
# measures this on a real policy.
#
# ## Two fixes
#
# **Advantage Reweighting (AR)** damps the rare tokens' weight linearly in their probability,
#
# $$ \hat A_t = \big[\alpha\, \pi_{\text{old}}(o_t) + (1 - \alpha)\big] A_t, \qquad \alpha \in [0, 1], $$
#
# so with $\alpha = 0.3$ a token at $\pi = 0.05$ keeps 0.72 of its advantage and one at $\pi = 0.95$ keeps 0.99
# ($\alpha = 0$ is plain GRPO).
#
# **Low-Probability Token Isolation (Lopti)** splits the batch's tokens at a threshold $\eta$ (0.5 by default) and
# updates twice: first on the tokens with $\pi_{\text{old}} < \eta$ only, then on the rest, with the PPO ratio of the
# second stage still measured against the rollout policy. The first stage already moves the confident tokens
# (indirectly, through shared weights); in the second, a confident token that was pushed the wrong way has a larger
# $1-\pi$ and gets corrected, while one already pushed up asks for less.
#
# ## A policy you can train in a second
#
# `toy.simulate` trains a softmax policy over 256 tokens in 64 shared-feature states with GRPO, AR, Lopti and
# AR+Lopti from the same seed, logging each step's reward, the gradient share of every probability bin and how each
# token's probability moved. Flip the methods, alpha, eta and the optimizer, and press Run.

# %%
panel = widgets.ToyPanel(steps=5 if QUICK else 40)
panel.run()
display(panel)
readouts.toy(panel.result)  # what the panel's default run shows; press Run again and rerun this line for yours

# %% [markdown]
# The numbers behind the panel: at the first step (the same batch for every method), the share of tokens and the
# share of the gradient in each probability bin.

# %%
first = panel.result.bins.query("step == 0")
first.pivot_table(index="label", columns="method", values="grad_share", sort=False).round(3).assign(
    token_share=first.query("method == 'GRPO'").set_index("label")["token_share"].round(3)
)

# %% [markdown]
# What to look for: the lowest bin's share of the gradient against its share of the tokens, the 1 - p effect in
# miniature. Which method learns faster depends on the optimizer (under Adam, Lopti's second stage gives the confident
# tokens a full-size step of their own) and on the seed: one seed is no ranking. Notebooks 02 and 04 look at a real
# policy.
