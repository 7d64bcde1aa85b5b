# %% [markdown]
# # 03 · Knights and Knaves: the environment
#
# Every experiment in lopti_lab runs on **Knights-and-Knaves (K&K)** puzzles, the benchmark on which Advantage
# Reweighting and Lopti lift GRPO by up to 46% in the paper. On the puzzles' island, knights always tell the truth
# and knaves always lie; each inhabitant makes one statement about who is what, and the task is to name every
# inhabitant's role. This notebook walks through `lopti_lab.kk`: how a puzzle is built, solved, explained, put to a
# model and scored, and checks that our puzzles are indistinguishable in form from the real K&K dataset.
#
# **Run time** of a full run (QUICK = False) on a CPU: the last build's is in [docs/numbers.md](../docs/numbers.md). It needs no
# network in a checkout of lopti_lab.

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

import pandas as pd

%matplotlib inline

from lopti_lab import kk, plots, readouts

# %% [markdown]
# ## A puzzle is a list of statement trees
#
# Person $i$ makes one statement $s_i$, a tree over leaves "$j$ is a knight" / "$j$ is a knave" with at most one
# operator on top (not, and, or, if-then, if-and-only-if), exactly as in the dataset. An assignment
# $k \in \{\text{knight}, \text{knave}\}^n$ is a **solution** when every knight's statement is true and every knave's
# statement is false:
#
# $$ k_i = \text{knight} \iff s_i(k) \text{ is true} \qquad \text{for all } i. $$
#
# The generator draws statements until exactly one of the $2^n$ assignments is a solution.

# %%
puzzle = kk.generate_puzzle(3, seed=7)
print(puzzle.quiz)
puzzle.statements

# %%
# The solver tries all 2^n assignments at once, as the bits of one big integer; here is the naive loop beside it.
from itertools import product

naive = [k for k in product([True, False], repeat=3)
         if all(kk.evaluate(s, k) == k[i] for i, s in enumerate(puzzle.statements))]
print("solver:", kk.solve(puzzle.statements, 3), " naive:", naive)
print(puzzle.solution_text)

# %% [markdown]
# ## How the dataset explains a solution
#
# The K&K records carry a chain of thought from a depth-first search: assume the next person is a knight, check every
# statement whose truth is already decided, and on a contradiction try knave, backtracking when both fail. The next
# person is the first one the last statement mentioned. `kk.solver_trace` reproduces the 700 reference records' chains
# exactly; the lab model learns a compact version of the same search (one short clause per step).

# %%
for line in puzzle.cot_repeat_steps:
    print("-", line)
print()
print("compact:", puzzle.compact_trace())

# %% [markdown]
# ## Prompt and reward
#
# The prompt is Logic-RL's: a system message asking for `<think> ... </think><answer> ... </answer>`, the quiz, and the
# assistant turn opened with `<think>`, so the response starts inside the reasoning. The reward is Logic-RL's too:
#
# | part | rule | score |
# |---|---|---|
# | format | each of the four tags exactly once, in order | +1, else -1 |
# | answer | the last answer block names every role right | +2 |
# | | parsed, some role wrong | -1.5 |
# | | unparseable (wrong count of "knight"/"knave", a person missing) or bad format | -2 |
#
# so a completion scores one of **3, -0.5, -1, -3**. Accuracy in the paper is the share of puzzles scoring 3.

# %%
print(kk.build_prompt(puzzle, "instruct")[-420:])

# %%
def answer(roles):
    return " I reason. </think><answer>" + kk.generate.solution_text_format(puzzle.names, roles) + "</answer>"


right = answer(puzzle.solution)
candidates = {
    "right": right,
    "one role wrong": answer([not puzzle.solution[0], *puzzle.solution[1:]]),
    "'knights' spoils the count": right.replace("</answer>", " All knights!</answer>"),
    "two answer blocks": right + "<answer>x</answer>",
    "no answer": " I am not sure. </think>",
}
rows = []
for name, response in candidates.items():
    reward = kk.score_response(response, puzzle)
    rows.append({"completion": name, "total": reward.total, "format": reward.format_score,
                 "answer": reward.answer_score, "outcome": reward.details["outcome"]})
pd.DataFrame(rows)

# %% [markdown]
# ## The bundled datasets
#
# `data/kk` holds what `lopti-lab data` builds: a test split of 100 puzzles per people count (2-8) and a train split
# of 800 per count (200 for 2 people, which admit only 395 distinct puzzles), with no statement set shared between the
# splits. Harder puzzles have longer quizzes and longer searches with more backtracking.

# %%
limit = 20 if QUICK else None
stats = kk.dataset_stats(kk.load_split("test", range(2, 9), limit=limit))
stats.groupby("people").mean().round(2)

# %%
display(plots.kk_dataset(stats))
readouts.kk_dataset(stats)

# %% [markdown]
# ## Compatibility with the real K&K records
#
# The same code reads the real dataset (Xie et al. 2024, `K-and-K/knights-and-knaves` on the Hugging Face hub). A
# checkout of lopti_lab carries its test split, 100 real records per people count, as test data
# (`tests/fixtures/kk_reference`, under the dataset's CC BY-NC-SA 4.0 licence); this cell reads those, and asks the hub
# only where they are not there (an installed wheel: `kk.load_hf` then needs the network and `datasets`). Three checks
# of our code against the real records: our solver finds each record's unique solution, our solver trace reproduces
# each record's chain of thought word for word, and our generator's puzzles (the bundled test split, which it made)
# have the records' form, people count by people count.

# %%
from pathlib import Path

import lopti_lab

limit = 10 if QUICK else None  # per people count
reference = Path(lopti_lab.__file__).resolve().parents[1] / "tests" / "fixtures" / "kk_reference"
if reference.is_dir():
    real = kk.load_hf("test", range(2, 9), repo=str(reference), limit=limit)
    source = "the real K&K test records (tests/fixtures/kk_reference)"
else:
    real, source = kk.load_hf("test", range(2, 9), limit=limit), "the hub's K&K test split"
same_solution = sum(kk.solve(p.statements, p.n_people) == [p.solution] for p in real)
same_cot = sum(kk.render_cot(kk.solver_trace(p.statements)[0], p.names, p.statements) == list(p.cot_repeat_steps)
               for p in real)
print(f"{len(real)} puzzles from {source}: our solver agrees on {same_solution}, "
      f"our chain of thought is identical on {same_cot}")
form = ["quiz_words", "trace_steps", "backtracks", "knight_share", "kind_leaf", "kind_or"]
generated = kk.dataset_stats(kk.load_split("test", range(2, 9), limit=limit)).groupby("people")[form].mean()
records = kk.dataset_stats(real).groupby("people")[form].mean()
pd.concat({"real records": records, "our generator": generated}, axis=1).swaplevel(axis=1)[form].round(2)

# %% [markdown]
# Each quantity side by side, the real records first: a generator that drifted from the dataset's (longer quizzes,
# another mix of statement kinds, easier searches) would show here as two columns apart.
