"""Which number a coded lab model writes after each name in its transcription (probe p8_coded, benchmarks/README.md).

    .venv/bin/python benchmarks/lab_number_binding.py reports/lab_probes/p8_coded --people 2 --size 60

For each leaf of each restated statement (the greedy traces of the first ``size`` test puzzles): the speaker's
number, the leaf person's true number, the number written. A model that matches the name against the roster writes
the true number; one that guesses from the speaker writes the same number whatever the name.
"""

import argparse
import json
from collections import Counter
from itertools import pairwise
from pathlib import Path

import torch

from lopti_lab.kk import build_prompt, load_split
from lopti_lab.lab.pretrain import PretrainConfig
from lopti_lab.lab.trace import prompt_style
from lopti_lab.models import load_policy
from lopti_lab.rollout import sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a saved lab model folder with a coded trace")
    parser.add_argument("--people", type=int, default=2)
    parser.add_argument("--size", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy(args.model, lora=None)
    trace = json.loads((Path(args.model) / "lab_model.json").read_text())["config"]["trace"]
    style = PretrainConfig(trace=trace).trace
    puzzles = load_split("test", args.people, limit=args.size)
    prompts = [build_prompt(p, prompt_style(style), tokenizer) for p in puzzles]
    texts = sample(model, tokenizer, prompts, greedy=True, max_new_tokens=60 * args.people + 40).texts
    written = Counter()  # (speaker's number, leaf's true number, number written)
    for p, text in zip(puzzles, texts, strict=True):
        sentences = [s.split() for s in text.partition("</think>")[0].split(" .") if s.strip()]
        for words in sentences[1 : 1 + args.people]:  # after the roster: the restated statements
            if len(words) < 2 or words[0] not in p.names:
                continue
            for name, number in pairwise(words[2:]):
                if name in p.names and number.isdigit():
                    written[(p.names.index(words[0]) + 1, p.names.index(name) + 1, int(number))] += 1
    self_right = sum(v for (s, t, w), v in written.items() if s == t == w)
    self_all = sum(v for (s, t, _), v in written.items() if s == t)
    other_right = sum(v for (s, t, w), v in written.items() if s != t and t == w)
    other_all = sum(v for (s, t, _), v in written.items() if s != t)
    print(json.dumps({"speaker, true, written": {str(k): v for k, v in sorted(written.items())}}, indent=1))
    print(f"own number on a reference to oneself: {self_right} of {self_all}; on another: {other_right} of {other_all}")


if __name__ == "__main__":
    main()
