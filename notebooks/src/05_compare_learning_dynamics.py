# %% [markdown]
# # 05 · Comparing learning dynamics
#
# Pick runs (from notebook 04, `lopti-lab train` or `lopti-lab demo`) and compare how they learned: reward and
# accuracy over steps, final test accuracy by people count in the paper's layout, how much of the gradient each
# probability bin carried, and whether the high-probability tokens moved the way their advantage asked.
#
# **Run time** of a full run (QUICK = False): with runs already there (from notebook 04 or `lopti-lab demo`), about 5
# s on a laptop CPU (measured: 4.8 s of one core, one run); with none, a cell first runs the demo, which took
# 10.5-11.5 min on this project's 2-core machine on 2026-12-02, two runs at a time (README, "The demo"); on one
# GPU: not measured.

# %%
# Setup (run first). QUICK = True makes every heavy cell take seconds (the tests run it that way).
QUICK = False

import sys

if "google.colab" in sys.modules:  # on Colab: install lopti_lab's wheel and turn on the widget manager
    from pathlib import Path

    from google.colab import output

    # lopti_lab is not on PyPI: upload the wheel that `pip wheel --no-deps -w dist .` builds in a checkout to Colab's
    # Files panel (README, "Colab"), or, where you host a copy of the repository, %pip install "lopti-lab @ git+<URL>"
    wheels = sorted(Path.cwd().glob("lopti_lab-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"no lopti_lab-*.whl in {Path.cwd()}: upload it first (see the comment above)")
    wheel = wheels[-1]
    %pip install -q {wheel}

    output.enable_custom_widget_manager()

from pathlib import Path

%matplotlib inline

from lopti_lab import experiments, plots, runs, widgets

# %% [markdown]
# If there are no runs yet, this cell makes some: the lab demo trains GRPO, GRPO+AR, GRPO+Lopti and GRPO+AR+Lopti on
# the same data and seeds, two runs at a time in processes of their own (10.5-11.5 minutes on a 2-core CPU; seconds in
# QUICK mode).

# %%
root = Path("runs")
if not widgets.find_runs(root):
    report = experiments.run_demo(experiments.DemoConfig(quick=QUICK, out="reports/notebook05"))
    root = report / "runs"
print("runs under", root, ":", [p.name for p in widgets.find_runs(root)])

# %%
panel = widgets.ComparePanel(root=root)
panel.show()
panel

# %% [markdown]
# ## Final accuracy, in the paper's layout
#
# Accuracy is the share of test completions that score 3 (sampled at temperature 1.0), by number of people, and its
# mean ("avg"). Below it, the paper's own numbers for Qwen2.5-3B-Instruct and 7B-Instruct-1M (PAPER.md §6).

# %%
long = runs.compare(widgets.find_runs(root))
widgets.final_accuracy(long)

# %%
experiments.PAPER_TABLE

# %% [markdown]
# ## Where the gradient went, and which way the tokens moved
#
# Left: each probability bin's share of the response tokens and of the gradient, averaged over the probed steps
# (the paper's Fig. 1a vs 1d). Right: after each probed update, the share of positive-advantage tokens whose
# probability went up, per bin (the paper's Fig. 2b, during training). GRPO's weakness, in the paper, is the top bin:
# its correct ratio falls toward 0.5 there, while AR and Lopti keep it up.

# %%
plots.gradient_share(long)

# %%
plots.correct_ratio(long)

# %% [markdown]
# ## What differs by scale
#
# The paper trains Qwen2.5-3B and 7B with full fine-tuning, 64 puzzles x 8 responses per step for about 350 steps,
# on responses up to 4096 tokens; its GRPO gets to 0.39 (3B) and 0.77 (7B) average accuracy, and AR + Lopti adds
# 0.18 and 0.14. The lab model has a few million parameters, a vocabulary of under a thousand tokens and compact
# traces of a few hundred tokens, and trains for ten steps on a CPU. Its token statistics differ (a small
# vocabulary makes $\|e_y - \pi\|$ hug the upper bound less), and whether AR or Lopti helps it is a separate
# experiment: read the spread across seeds before reading a difference.
#
# Measured in this project (README, "The demo"; `lopti-lab demo --seeds 5`, 49 min on a 2-core CPU): in 10 steps
# GRPO lifted the lab model's sampled accuracy on 2-3-person puzzles from 0.63 to 0.87 (+23.6 ± 2.8 points, 95%
# interval over 5 seeds; every seed above +21). AR, Lopti and AR + Lopti ended within a few points of GRPO, every
# paired difference inside its interval (Lopti +2.1 ± 3.6). The gradient imbalance itself is plain: under GRPO the
# 12-15% of tokens sampled below p = 0.25 carry half the gradient and the 71% above 0.75 carry 1-2%, and Lopti
# shifts that balance as designed. Treat the accuracy comparison as a rehearsal of the method at this scale, not a
# test of the paper's claim.
