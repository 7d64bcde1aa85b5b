"""Do two checkouts compute the same thing? Greedy test completions, one demo RL step's rollout and the weights
after its update, saved by each checkout and compared.

    PYTHONPATH=<before> .venv/bin/python benchmarks/same_outputs.py --save /tmp/before.pt
    PYTHONPATH=<after>  .venv/bin/python benchmarks/same_outputs.py --save /tmp/after.pt
    .venv/bin/python benchmarks/same_outputs.py --compare /tmp/before.pt /tmp/after.pt

Saved: the lean decoder's greedy completions of ``--puzzles`` test puzzles per people count (2 and 3; 640 new
tokens) with their log-probs; one `trainer.train_step` at the demo's settings on its first 8 training puzzles from
the bundled lab model under torch seed 1000 (the rollout's tokens and log-probs, and every weight after the update).
Compared: tokens equal or not, the largest log-prob difference, and the largest weight difference against the
smallest move the update made to any weight tensor (its largest element's move).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

if not os.environ.get("PYTHONPATH"):  # this checkout, unless PYTHONPATH names another
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lopti_lab.trainer as trainer
from lopti_lab.kk import build_prompt, load_split
from lopti_lab.models import load_policy
from lopti_lab.rollout import sample
from lopti_lab.studies.config import DemoConfig


def save(path: str, per_people: int) -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_policy("lab", lora=None)
    style = model.config.kk_prompt_style
    test = load_split("test", (2, 3))
    puzzles = [p for n in (2, 3) for p in [q for q in test if q.n_people == n][:per_people]]
    torch.manual_seed(0)
    greedy = sample(model, tokenizer, [build_prompt(p, style, tokenizer) for p in puzzles], 1, greedy=True,
                    max_new_tokens=640, fast_path="lean")  # fmt: skip
    start = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = replace(DemoConfig().train_config("GRPO", 0, Path("unused")), probe_every=0, eval_people=(), shift_every=0,
                  fast_path="lean")  # fmt: skip
    seen, original = {}, trainer.sample

    def keep(*args, **kwargs):
        seen["rollout"] = original(*args, **kwargs)
        return seen["rollout"]

    trainer.sample = keep
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        torch.manual_seed(1000)
        trainer.train_step(model, tokenizer, optimizer, load_split("train", cfg.train_people)[:8], cfg)
    finally:
        trainer.sample = original
    rollout = seen["rollout"]
    torch.save({"greedy": (greedy.response_ids, greedy.old_logp), "rollout": (rollout.response_ids, rollout.old_logp),
                "start": start, "after": model.state_dict()}, path)  # fmt: skip
    print(f"saved {path}: {len(puzzles)} greedy completions, a {len(rollout)}-row rollout and its update")


def compare(a_path: str, b_path: str) -> None:
    a, b = (torch.load(p, weights_only=False) for p in (a_path, b_path))
    for name in ("greedy", "rollout"):
        (ids_a, logp_a), (ids_b, logp_b) = a[name], b[name]
        same = ids_a.shape == ids_b.shape and torch.equal(ids_a, ids_b)
        gap = (logp_a - logp_b).abs().max().item() if same else float("nan")
        print(f"{name}: {len(ids_a)} rows, tokens {'equal' if same else 'DIFFER'}, log-probs max |diff| {gap:.3g}")
    diff = max((a["after"][k] - b["after"][k]).abs().max().item() for k in a["after"])
    moved = min((a["after"][k] - a["start"][k]).abs().max().item() for k in a["after"])
    print(f"update: weights max |diff| {diff:.3g}; the update's smallest move of a tensor (its max |move|) {moved:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", help="file to save this checkout's outputs to")
    parser.add_argument("--compare", nargs=2, help="two saved files")
    parser.add_argument("--puzzles", type=int, default=100, help="greedy test puzzles per people count")
    args = parser.parse_args()
    if bool(args.save) == bool(args.compare):
        parser.error("give --save FILE or --compare A B")
    if args.save:
        save(args.save, args.puzzles)
    else:
        compare(*args.compare)


if __name__ == "__main__":
    main()
