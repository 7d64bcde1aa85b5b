# %% [markdown]
# # 05 · Comparing learning dynamics
#
# Pick runs (from notebook 04, `lopti-lab train` or `lopti-lab demo`) and compare how they learned: reward and
# accuracy over steps, final test accuracy by people count in the paper's layout, how much of the gradient each
# probability bin carried, and whether the high-probability tokens moved the way their advantage asked.
#
# **Run time** of a full run (QUICK = False) on a CPU with no runs there: the last build's, with its machine, is in [docs/numbers.md](../docs/numbers.md); nearly all of it is the demo that the next cell runs first. With runs there it skips the demo and only reads them.

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

from pathlib import Path

from IPython.display import Markdown

%matplotlib inline

from lopti_lab import methods, paper, plots, plots_methods, readouts, runs, widgets
from lopti_lab.counterfactual import recorded_method_probes
from lopti_lab.studies.config import DemoConfig
from lopti_lab.studies.curves import last_evaluations, model_name, paired_over_steps, recorded_study, seed_bands
from lopti_lab.studies.primary import primary_markdown, primary_table
from lopti_lab.studies.tables import paired_intervals, paired_per_seed, recorded_comparison
from lopti_lab.studies.run import run_demo
from lopti_lab.paths import shown

# %% [markdown]
# If there are no runs yet, this cell makes some: the lab demo trains GRPO, GRPO+AR, GRPO+Lopti and GRPO+AR+Lopti on
# the same data and seeds, two runs at a time in processes of their own (docs/demo.md; seconds in QUICK mode).

# %%
root = Path("runs")
if not widgets.find_runs(root):
    report = run_demo(DemoConfig(quick=QUICK, out="reports/notebook05"))
    root = report / "runs"
print("runs under", root, ":", [p.name for p in widgets.find_runs(root)])

# %%
panel = widgets.ComparePanel(root=root)  # the training batch's reward and accuracy, then the test accuracy
panel.show()
panel

# %% [markdown]
# ## Final accuracy, in the paper's layout
#
# Accuracy is the share of test completions that score 3 (sampled at temperature 1.0), by number of people, and its
# mean ("avg"). A run made here is one seed per method: the read-out below the table sets its gaps against the spread
# across seeds that the recorded comparison at the same settings measured (docs/demo.md). Below it, the paper's own
# numbers for Qwen2.5-3B-Instruct and 7B-Instruct-1M (docs/paper.md §7), from other models, data and step counts.

# %%
long = runs.compare(widgets.find_runs(root))
final = widgets.final_accuracy(long)
display(final)
recorded, _ = recorded_comparison()
spread = paired_intervals(paired_per_seed(recorded, ["avg"]))
readouts.final_accuracy(final, spread[spread["model"].isin([model_name(m) for m in methods.PAPER])])

# %%
paper.KK_ACCURACY

# %% [markdown]
# ## Where the gradient went, and which way the tokens moved
#
# Left: each probability bin's share of the response tokens and of the gradient, averaged over the probed steps
# (the paper's Fig. 1a vs 1d). Right: after each probed update, the share of positive-advantage tokens whose
# probability went up, per bin (the paper's Fig. 2b, during training). GRPO's weakness, in the paper, is the top bin:
# its correct ratio falls toward 0.5 there, while AR and Lopti keep it up. Each figure's read-out says whether these
# runs show it.

# %%
display(plots.gradient_share(long))
readouts.gradient_share(long)

# %%
display(plots.correct_ratio(long))
readouts.correct_ratio_runs(long)

# %% [markdown]
# ## Beyond the paper: where each token-level method puts the update
#
# The same measurements for the methods that followed the paper (docs/methods.md), on one frozen batch of the lab
# model updated by each method from the same weights: each bin's share of the update's gradient and the share of its
# A > 0 tokens that went up, by rollout-probability bin (where AR and Lopti act) and by the batch's entropy quartiles
# (where forking tokens, the entropy advantage and Clip-Cov / KL-Cov act). Read from `benchmarks/method_probes.py`'s
# output when you ran it, else from the run recorded with lopti_lab. Runs of these methods (`lopti-lab demo
# --methods GRPO GRPO+Forking ...`, or notebook 04's preset picker) show in the panel above like any other.

# %%
probe_table, probe_source = recorded_method_probes()
print("read", shown(probe_source))
plots_methods.method_probes(probe_table)

# %% [markdown]
# ## The token-credit comparison: each method against GRPO, seed by seed
#
# The eleven methods trained under the same settings with three seeds (docs/methods.md: the settings were fixed on
# GRPO alone before the others ran). Each dot is one seed's sampled test accuracy minus GRPO's at the same seed (same
# puzzles, same warm start, same evaluation sampling seed); the bar is the mean and its 95% interval over the seeds.
# An interval that crosses 0 is a method this comparison cannot tell from GRPO. Read from `reports/methods` if you
# ran the comparison's command, else from the comparison recorded with lopti_lab.

# %%
accuracy, source = recorded_comparison()
print("read", shown(source))
diffs = paired_per_seed(accuracy, [c for c in accuracy.columns if c.endswith("ppl") or c == "avg"])
intervals = paired_intervals(diffs)
display(intervals.query("column == 'avg'").drop(columns="column").set_index("model").round(3))
plots_methods.paired_differences(diffs, intervals)

# %% [markdown]
# ## The hard lab: learning curves where RL must learn a skill
#
# In the demo every method reaches the warm start's ceiling within 10 steps, so its four curves look alike. The hard
# lab (docs/hard_lab.md) starts from `lab-hard`, a lab model that misreads 'or', 'if' and 'iff' as 'and' 60% of the
# time: the right value there is a token of probability 0.4, greedy decoding gets those puzzles wrong, and RL has a
# skill to learn over 60 steps. `lopti-lab hardlab` trains the four methods with 5 seeds each (about 3 hours on
# two CPU cores) and evaluates every run on the test split every 10 steps, at 2 and 3 people (the trained counts) and
# 4 (beyond them). Below, read from `reports/hard_lab` if you ran it, else from the study recorded with lopti_lab.
#
# Top row: each method's sampled test accuracy over training, the mean over seeds with its 95% interval as a band
# (step 0 is the warm start). Bottom row: each method minus GRPO at the same seed and step, with its 95% interval;
# a band that stays clear of 0 is a difference this study can see.

# %%
study, study_source = recorded_study()
print("read", shown(study_source))
sampled = study["curves_sample"]
plots_methods.study_curves(seed_bands(sampled), paired_over_steps(sampled), ylabel="test accuracy (T = 1.0)")

# %% [markdown]
# The paper's measure, the mean of each run's last 3 evaluations, as each method's difference to GRPO paired by
# seed (mean, 95% interval, n seeds), per people count; the study's primary measure is the 3-person row. Then
# greedy decoding's curves, where the misreading shows most plainly (a greedy model makes it every time).

# %%
last3 = last_evaluations(sampled)
columns = [c for c in last3.columns if c.endswith("ppl") or c == "avg"]
paired = paired_intervals(paired_per_seed(last3, columns))
paired["method - GRPO"] = paired["mean"].map("{:+.3f}".format) + " ± " + paired["ci95"].map("{:.3f}".format)
display(paired.pivot(index="model", columns="column", values="method - GRPO")[columns])

# %% [markdown]
# In the study recorded with lopti_lab (docs/hard_lab.md, pre-registered on GRPO alone), GRPO gains 27 points at 3
# people in 60 steps and is still rising; at 3 people no fix separates from it after Holm's correction over the three
# primaries: Lopti +0.002 ± 0.063, AR+Lopti -0.009 ± 0.055, AR -0.054 ± 0.051 (p 0.04 uncorrected, Holm 0.12; level
# with GRPO at step 60). Lopti's +0.068 ± 0.061 at 2 people is a secondary measure: a lead for a longer run, not a
# finding. No method learns 4 people.

# %%
greedy = study["curves_greedy"]
plots_methods.study_curves(seed_bands(greedy), paired_over_steps(greedy), ylabel="test accuracy (greedy)")

# %% [markdown]
# The mechanism over the study's training, every 10 steps (mean over seeds): each probability bin's share of the
# response tokens and of the gradient, and the paper's Fig. 3 correct ratio, the share of the A > 0 tokens whose
# probability the step's update raised, measured in float64 (docs/mechanism.md).

# %%
plots.mechanism_by_step(study["mechanism"], {"token_share": "share of tokens", "grad_share": "share of the gradient",
                                             "fig3_correct": "Fig. 3 correct ratio (A > 0)"})

# %% [markdown]
# ## The confirmatory study: ten fresh seeds, three comparisons fixed beforehand
#
# The study above had too few seeds and too small an evaluation to see a 5-point difference, so a second one was
# pre-registered (docs/hard_lab.md, "Confirmatory study: pre-registration") and committed before its first run:
# GRPO, GRPO+AR and GRPO+Lopti with the same training, on seeds 5-14 (none of the first study's), evaluated at 2 and 3
# people on all 100 test puzzles per count. Steps 40, 50 and 60 score 8 samples per puzzle (1,600 answers per run
# and step), steps 0-30 two (400), so the bands narrow at step 40 partly because each point is measured more finely.
# `lopti-lab confirm --threads 2` reruns it; below, read from `reports/hard_lab_confirm` if you did, else from the
# study recorded with lopti_lab.
#
# Top row: each method's sampled test accuracy, the mean over the 10 seeds with its 95% interval as a band. Bottom
# row: each fix minus GRPO at the same seed and step, with its 95% interval (uncorrected, per step: these are
# secondary measures).

# %%
confirm, confirm_source = recorded_study("reports/hard_lab_confirm", bundled="hard_lab_confirm")
print("read", shown(confirm_source))
confirm_sampled = confirm["curves_sample"]
people = ["2ppl", "3ppl"]
plots_methods.study_curves(seed_bands(confirm_sampled, people), paired_over_steps(confirm_sampled, people),
                           ylabel="test accuracy (T = 1.0)")  # fmt: skip

# %% [markdown]
# The primary analysis, as pre-registered: a run's measure is its mean sampled accuracy over steps 40, 50 and 60;
# each comparison is the per-seed difference to GRPO, tested by a paired t-test, with Holm's correction over the
# three. "Detectable" is the smallest true difference this many seeds would find 4 times in 5 at Holm's strictest
# level, from the observed spread (and from the first study's, which the plan was sized on).

# %%
primary = primary_table(confirm_sampled)
display(Markdown(primary_markdown(primary)))
readouts.confirmatory(primary, confirm_sampled)

# %% [markdown]
# ## What differs by scale
#
# The paper trains Qwen2.5-3B and 7B with full fine-tuning, 64 puzzles x 8 responses per step for about 350 steps,
# on responses up to 4096 tokens; its GRPO gets to 0.39 (3B) and 0.77 (7B) average accuracy, and AR + Lopti adds
# 0.18 and 0.14. The lab model has a few million parameters, a vocabulary of about a thousand tokens and
# traces of a few hundred tokens, and trains for 10 (the demo) or 60 steps (the hard lab) on a CPU. Its token
# statistics differ (a small vocabulary makes $\|e_y - \pi\|$ hug the upper bound less), and whether AR or Lopti
# helps it is a separate experiment: read the spread across seeds before reading a difference.
#
# What the lab demo measured (accuracy with its spread across seeds, paired differences to GRPO, the gradient share
# per bin) is in docs/demo.md, for the current lab model and the previous one. Treat the accuracy comparison as a rehearsal of the method
# at this scale, not a test of the paper's claim.
