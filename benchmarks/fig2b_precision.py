"""Fig. 2b on a frozen batch, measured two ways: the old float32 path and the exact one (issue 10, item 1).

    .venv/bin/python benchmarks/fig2b_precision.py                       # the demo's frozen batch and update
    .venv/bin/python benchmarks/fig2b_precision.py --puzzles 6 --temperature 1.0 --optimizer sgd --lr 1e-3

One rollout of the lab model on 3-person training puzzles (``counterfactual.frozen_batch``), then each method's update
from the same weights (``counterfactual.counterfactual``, which restores them). Per method, bin and advantage sign:

- old: delta_p = exp(new) - exp(old) from float32 forwards, and "did not move" counted as moved the wrong way (what
  the demo reported before): ``correct_old``;
- exact: the direction of the float64 log-prob change, unmoved tokens counted apart: ``unmoved`` share and
  ``correct`` among the tokens that moved (what ``probes.probability_shift`` now reports).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
import pandas as pd
import torch

from lopti_lab.bins import DEFAULT_BINS, bin_index
from lopti_lab.counterfactual import frozen_batch, whole_batch_update
from lopti_lab.kk import load_split
from lopti_lab.methods import METHODS
from lopti_lab.models import load_policy
from lopti_lab.probes.shift import float64_logprobs
from lopti_lab.rollout import response_logprobs
from lopti_lab.update import advantages_and_stages, update_policy


def measure(model, batch, lr: float, optimizer: str) -> pd.DataFrame:
    rollout = batch.rollout
    mask = rollout.response_mask.bool()
    args = (rollout.input_ids, rollout.attention_mask, rollout.response_mask, batch.temperature)
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    base = whole_batch_update(batch)
    with torch.no_grad():
        old32 = response_logprobs(model, *args)[0]
    old64 = float64_logprobs(model, *args)
    adv = batch.advantages[:, None].expand_as(mask).double()  # (B, T)
    bins = bin_index(old64.exp(), DEFAULT_BINS)
    rows = []
    for name, method in METHODS.items():
        spec = replace(base, objective=replace(base.objective, method=method))
        opt = torch.optim.SGD(params, lr=lr) if optimizer == "sgd" else torch.optim.AdamW(params, lr=lr, weight_decay=0)
        weighted, stages, _ = advantages_and_stages(rollout, batch.advantages, spec.objective)
        update_policy(model, opt, rollout, weighted, stages, spec)
        with torch.no_grad():
            new32 = response_logprobs(model, *args)[0]
        new64 = float64_logprobs(model, *args)
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
        dp_old = new32.exp() - old32.exp()  # the old float32 path
        step = new64 - old64  # the exact direction
        for k in range(len(DEFAULT_BINS) - 1):
            for sign, asked in (("pos", adv > 0), ("neg", adv < 0)):
                cell = mask & asked & (bins == k)
                n = int(cell.sum())
                want = 1 if sign == "pos" else -1
                moved = cell & (step != 0)
                rows.append(
                    {
                        "method": name,
                        "bin": k,
                        "sign": sign,
                        "n_tokens": n,
                        "old_dp_zero": float((cell & (dp_old == 0)).sum() / max(n, 1)),
                        "correct_old": float((cell & (torch.sign(dp_old) == want)).sum() / max(n, 1)),
                        "unmoved": float(1 - moved.sum() / max(n, 1)),
                        "correct": float((moved & (torch.sign(step) == want)).sum() / max(int(moved.sum()), 1)),
                        "p_old_median": float(old64.exp()[cell].median()) if n else np.nan,
                    }
                )
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--puzzles", type=int, default=16, help="3-person training puzzles (the demo: 16)")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.7, help="rollout temperature (the demo: 0.7)")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="adamw", help="the demo: adamw")
    parser.add_argument("--lr", type=float, default=1e-4, help="the demo: 1e-4")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy("lab", lora=None)
    puzzles = load_split("train", 3, limit=args.puzzles)
    batch = frozen_batch(
        model, tokenizer, puzzles, args.group, temperature=args.temperature, max_new_tokens=args.max_new_tokens
    )
    table = measure(model, batch, args.lr, args.optimizer)
    pd.set_option("display.width", 200)
    print(f"{len(batch.rollout)} rollouts, {int(batch.rollout.response_mask.sum())} response tokens, {vars(args)}")
    print(table[table["sign"] == "pos"].round(3).to_string(index=False))
    print(table[table["sign"] == "neg"].round(3).to_string(index=False))


if __name__ == "__main__":
    main()
