"""The paper's published numbers, for drawing the lab's measurements beside them (docs/paper.md §7 has the context).

KK_ACCURACY.loc["+ GRPO + AR"]       # Qwen2.5-3B-Instruct with GRPO + AR: accuracy per people count and avg
"""

from __future__ import annotations

import pandas as pd

__all__ = ["FIG1_GRAD_NORM", "FIG1_GRAD_NORM_ALL", "FIG1_TOKEN_SHARE", "FIG3_AR_LOPTI", "FIG3_GRPO", "KK_ACCURACY"]

KK_ACCURACY = pd.DataFrame(
    [
        ("Qwen2.5-3B-Instruct", 0.09, 0.10, 0.03, 0.05, 0.02, 0.06),
        ("+ GRPO", 0.60, 0.45, 0.33, 0.34, 0.23, 0.39),
        ("+ GRPO + AR", 0.67, 0.62, 0.53, 0.44, 0.37, 0.53),
        ("+ GRPO + Lopti", 0.74, 0.67, 0.56, 0.42, 0.30, 0.54),
        ("+ GRPO + AR + Lopti", 0.72, 0.66, 0.55, 0.52, 0.40, 0.57),
        ("Qwen2.5-7B-Instruct-1M", 0.22, 0.15, 0.08, 0.10, 0.02, 0.11),
        ("+ GRPO", 0.91, 0.91, 0.77, 0.65, 0.61, 0.77),
        ("+ GRPO + AR", 0.97, 0.98, 0.89, 0.83, 0.80, 0.89),
        ("+ GRPO + Lopti", 0.95, 0.94, 0.84, 0.80, 0.76, 0.86),
        ("+ GRPO + AR + Lopti", 0.95, 0.94, 0.91, 0.87, 0.87, 0.91),
    ],
    columns=["model", "3ppl", "4ppl", "5ppl", "6ppl", "7ppl", "avg"],
).set_index("model")
"""The paper's K&K accuracy table (docs/paper.md §7): share of test puzzles with reward 3, by people count."""

FIG1_TOKEN_SHARE = (0.192, 0.102, 0.101, 0.605)
"""Fig. 1a: share of the response tokens in each probability quarter (Qwen2.5-7B-Instruct-1M on K&K)."""
FIG1_GRAD_NORM = (0.71, 0.36, 0.23, 0.15)
"""Fig. 1d: the gradient norm when only one quarter's tokens are updated, lowest to highest (about; as read off the
paper's figure)."""
FIG1_GRAD_NORM_ALL = 0.82
"""Fig. 1d: the gradient norm when every token is updated (about)."""
FIG3_GRPO = {"p <= 0.75": 0.53, "p > 0.75": "below 0.50"}
"""Fig. 3, GRPO: the correct ratio of positive-advantage tokens is about 0.53 in the lower bins and falls below 0.50
for p > 0.75 (the paper gives no exact value for the top bin: drawn as a bound, not a point)."""
FIG3_AR_LOPTI = (0.52, 0.53)
"""Fig. 3, with AR or with Lopti: the correct ratio stays flat at about 0.52-0.53 across the bins."""
