# %% [markdown]
# # 04 · GRPO with Advantage Reweighting and Lopti
#
# Train a K&K policy with GRPO and flip the paper's two fixes on and off. On a GPU the policy is a Qwen2.5 Instruct
# model with a LoRA adapter; on a CPU it is the bundled lab model (a few million parameters, fully fine-tuned). Same
# code either way: `lopti_lab.trainer`, which the `lopti-lab train` command also runs.
#
# ## One RL step
#
# 1. Draw $P$ puzzles, sample $G$ responses to each at the rollout temperature, and keep every sampled token's
#    log-probability under the rollout policy, $\log \pi_{\text{old}}(o_t)$.
# 2. Score each response with the Logic-RL reward $r \in \{3, -0.5, -1, -3\}$ and compare it with its group:
#    $A = (r - \operatorname{mean}_G r) / (\operatorname{std}_G r + \epsilon)$.
# 3. **AR** (optional) rescales every token's advantage: $\hat A_t = [\alpha\,\pi_{\text{old}}(o_t) + 1 - \alpha]\,A$.
# 4. Minimise the clipped surrogate, averaged over all response tokens of the minibatch,
#
# $$ \mathcal{L} = \frac{1}{\sum_t m_t} \sum_t m_t \Big[ -\min\big(\rho_t \hat A_t,\;
#    \operatorname{clip}(\rho_t, 1-\epsilon_{\text{low}}, 1+\epsilon_{\text{high}})\,\hat A_t\big)
#    + \beta\, \mathrm{KL}_t \Big], \qquad \rho_t = \frac{\pi_\theta(o_t)}{\pi_{\text{old}}(o_t)}, $$
#
#    with a dual clip on negative advantages and the k3 estimate of the KL to the reference policy.
# 5. **Lopti** (optional) runs step 4 twice: first with the mask $m_t$ restricted to tokens with
#    $\pi_{\text{old}}(o_t) < \eta$, then to the others, with $\pi_{\text{old}}$ and the denominator unchanged, so the
#    second stage's ratio sees the first stage's drift.
#
# Every few steps the trainer also measures, per probability bin, the share of the gradient (`grad/share_bin*`) and
# how the update moved the tokens' probabilities (`shift/correct_pos_bin*`).
#
# **Run time** of a full run (QUICK = False) on a CPU: the last build's, with its machine, is in [docs/numbers.md](../docs/numbers.md); nearly all of it is the panel's default run, which the cell below starts.
#
# On a CPU the panel's default is the demo's GRPO run (10 steps of 8 puzzles x 8 samples on the lab model) with test
# evaluations at steps 5 and 10; what the demo's runs gave is in docs/demo.md.

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

%matplotlib inline

from lopti_lab import notebook, plots, readouts, runs, widgets

env = notebook.setup(quick=QUICK)  # notebook.setup(model="Qwen/Qwen2.5-3B-Instruct") to choose another policy
env

# %% [markdown]
# ## The training panel
#
# Tick **Advantage Reweighting** and/or **Lopti**, set alpha, eta and the order (the paper's ablation, high first,
# is there to be tried), the steps, learning rate and batch shape, then press **Run**. The plots refresh after each
# step; **Stop** ends the run after the current step, keeping every finished step's record and a checkpoint
# (`lopti-lab train --run-dir <folder> --resume` continues it). Every run lands in its own folder under `runs/`.
#
# The **preset** picker sets the switches to any registered method, the paper's four and the token-level methods
# that followed it (docs/methods.md): **forking tokens** (only the top-rho entropy tokens carry the gradient),
# an **entropy advantage** (a capped entropy bonus on every token's advantage), and the **loss**: CISPO (the
# importance weight clipped, never the token), Clip-Cov or KL-Cov (a few high-covariance tokens' gradient dropped or
# penalised). They combine with AR and Lopti where the combination is defined; the others (e.g. Clip-Cov inside
# Lopti's stages) are refused with the reason when you press Run.

#
# On a CPU, the **regime** picker sets every setting for one of the lab's two regimes: **demo lab**, the demo's
# (the bundled lab model already solves its puzzles; RL removes its slips within about 10 steps), and **hard lab**
# (docs/hard_lab.md: `lab-hard`, which misreads 'or', 'if' and 'iff' as 'and', so RL has a skill to learn; 60 steps
# of 4 puzzles x 8 at lr 1e-4, test evaluations at 2, 3 and 4 people every 10 steps, about 15 minutes on a core).
# The switches stay free on top of either.

# %%
base = notebook.training_defaults(env)
panel = widgets.TrainPanel(base=base, env=env, regimes=notebook.lab_regimes(env))
panel

# %% [markdown]
# The next cell presses Run itself with the panel's settings and waits for the run to end, so that "Run all" gives
# a run and its figures (QUICK: 2 steps). Set `RUN_HERE = False` to drive the panel yourself; while this cell waits,
# interrupt the kernel to end the run early (it stops after the current step, with a checkpoint).

# %%
RUN_HERE = True
if RUN_HERE:
    panel.run(block=True)
    print(panel.status.value)

# %% [markdown]
# ## What the run left on disk
#
# A run folder holds `config.json`, `metrics.jsonl` (one line per step, written as the step ends) and
# `checkpoints/`. `runs.load_run` reads it back as a DataFrame, one row per step. `acc/all` is the training batch's
# accuracy (the share of the step's sampled responses that score 3, on the puzzles it trains on); `eval/*/acc_all` is
# the test split's, sampled at the rollout temperature or greedy, at the steps the run evaluates.

# %%
if panel.result is not None:
    frame = runs.load_run(panel.result.run_dir)
    shown = ["step", "reward/mean", "acc/all", "eval/sample/acc_all", "eval/greedy/acc_all", "len/response_mean",
             "policy/entropy", "grad/norm", "time/step"]
    table = frame[[c for c in shown if c in frame.columns]].round(3).tail(10)
    display(table.rename(columns={"acc/all": "acc/all (training batch)"}))

# %% [markdown]
# Its learning curves: the training batch's reward and accuracy, then the test accuracy, sampled and greedy, at the
# evaluated steps (notebook 05 puts several runs side by side).

# %%
if panel.result is not None:
    display(plots.learning_curves(runs.compare([panel.result.run_dir]),
                                  ["reward/mean", "acc/all", "eval/sample/acc_all", "eval/greedy/acc_all"]))
    display(readouts.training_run(frame))

# %% [markdown]
# The same run from a terminal:
#
# ```bash
# lopti-lab train --model lab --lora-r none --ar 0.3 --lopti 0.5 --steps 10 \
#     --train-people 2 3 --prompts-per-step 8 --group-size 8 --minibatch-size 32 --max-new-tokens 640 \
#     --temperature 1.0 --lr 5e-4 --adam-eps 1e-3 --kl-coef 0 --run-dir runs/ar_lopti
# lopti-lab eval --run runs/ar_lopti --people 2 3
# ```
#
# The hard lab's four methods with 5 seeds each, its learning curves and paired differences to GRPO in a report
# folder (about 3 hours on two cores; notebook 05 draws them): `lopti-lab hardlab --threads 2`.
#
# The prompt style comes from the model's config (the lab model's own). On one GPU with Qwen2.5-3B-Instruct, the
# paper's settings are `--model Qwen/Qwen2.5-3B-Instruct --lora-r 16 --lr 2e-5 --temperature 0.7 --max-new-tokens 4096
# --gradient-checkpointing` (LoRA wants a larger learning rate than the paper's full fine-tuning at 1e-6).
