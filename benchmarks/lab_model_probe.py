"""Short warm-start probes for the lab model: train a candidate for a few minutes, then measure what RL needs.

    .venv/bin/python benchmarks/lab_model_probe.py --name base --minutes 20 --set steps=3000
    .venv/bin/python benchmarks/lab_model_probe.py --name wide --minutes 20 --set spec.hidden_size=320 trace.slip=0.02
    .venv/bin/python benchmarks/lab_model_probe.py --ideal      # no training: what a perfect learner would show
    .venv/bin/python benchmarks/lab_model_probe.py --audit reports/lab_probes/base   # re-read a probe's traces
    .venv/bin/python benchmarks/lab_model_probe.py --targets data/lab_model --people 2 3 --more-people 4 5 6

Each probe runs `lab.pretrain.pretrain` on lab.trace's traces (`lab.trace.RL_TRACE`, 4 length buckets, evaluations up to
896 new tokens) with the overrides given (``field=value``, nested fields with a dot; values are
Python literals), then reports the targets of the RL-ready lab model (issue 11) on the bundled test split: greedy and
sampled accuracy at 2 and 3 people, format errors, and the token-probability profile of its own rollouts (3-person
training puzzles, 8 samples each at the rollout temperature), and an audit of its greedy traces
(`lab.evaluate.audit_greedy`: transcription, copy and logic errors, slips; 40 test puzzles per people count). Results go
to reports/lab_probes/<name>/probe.json.

``--targets DIR`` trains nothing: the four warm-start targets of issue 11 for a saved lab model, on the test split's
``--people`` counts (its recorded final evaluation: greedy, 4 samples at T = 1.0, format errors) and the token profile
of its own rollouts on the training mix of those counts at ``--temperature``, each beside its target; greedy accuracy
at ``--more-people`` too (responses capped by the model's context).

``--ideal`` trains nothing: for the trace style (with the --set trace overrides) it prints what a model that samples
exactly the traces' distribution would show at T = 1.0, the ceiling of a warm start: the token profile
(`lab.trace.ideal_profile`, with the tokenizer the pretrain would build), the share of sampled traces whose answer is
right (slips included) at slip rates around the style's, and the mean trace length in tokens, per people count.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import time
from dataclasses import asdict, replace
from pathlib import Path

from lopti_lab.lab.evaluate import audit_greedy, rollout_profile
from lopti_lab.lab.pretrain import PretrainConfig, pretrain
from lopti_lab.lab.tokenizer import build_tokenizer, lab_response
from lopti_lab.lab.trace import RL_TRACE, TraceStyle, ideal_profile, lab_trace_with_stats, prompt_style
from lopti_lab.models import load_policy, prompt_style_of


def parse_overrides(items: list[str]) -> dict:
    out: dict = {}
    for item in items:
        key, _, text = item.partition("=")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def ideal(style: TraceStyle, people: list[int], size: int) -> dict:
    from lopti_lab.kk import generate_puzzle

    tokenizer = build_tokenizer(style=style)
    out = {}
    for n in people:
        puzzles = [generate_puzzle(n, 90_000 + i) for i in range(size)]
        shares = ideal_profile(puzzles, style, tokenizer)
        lengths = [len(tokenizer(lab_response(p, random.Random(i), style))["input_ids"])
                   for i, p in enumerate(puzzles)]  # fmt: skip
        correct = {}
        for slip in sorted({0.01, 0.02, 0.03, 0.04, 0.05, style.slip}):
            varied = replace(style, slip=slip)
            right = [lab_trace_with_stats(p, random.Random(i), varied)[1].correct for i, p in enumerate(puzzles)]
            correct[f"slip {slip:g}"] = sum(right) / len(right)
        out[f"{n} people"] = {
            "profile [0,.25) [.25,.5) [.5,.75) [.75,1]": [round(x, 3) for x in shares],
            "below 0.75": round(sum(shares[:3]), 3),
            "below 0.25": round(shares[0], 3),
            "answer right when sampled": correct,
            "mean response tokens": sum(lengths) / len(lengths),
        }
    return out


TARGETS = {"greedy": 0.80, "gap": 0.25, "below_075": 0.25, "below_025": 0.10, "format_errors": 0.02}
"""Issue 11's warm-start targets: greedy accuracy >= 0.80, sampled at least 0.25 below it, >= 25% of rollout tokens
below p = 0.75 and >= 10% below 0.25, format errors < 2%."""


def targets(folder: str, people: list[int], more_people: list[int], temperature: float) -> dict:
    """The targets measured on a saved lab model (its recorded final evaluation for ``people``, a fresh rollout
    profile on their training mix, fresh greedy accuracy for ``more_people``)."""
    from lopti_lab.evaluate import evaluate
    from lopti_lab.kk import load_split

    model, tokenizer = load_policy(folder, lora=None)
    summary = json.loads((Path(folder) / "lab_model.json").read_text())
    final, style = summary["final_eval"], prompt_style_of(folder)
    if style is None:  # a folder saved before config.json named its prompt style: the one its trace reads
        style = prompt_style(PretrainConfig(trace=summary.get("config", {}).get("trace")).trace)
    missing = [n for n in people if f"test/greedy/acc_{n}ppl" not in final]
    if missing:
        raise SystemExit(f"{folder}/lab_model.json has no final evaluation at {missing} people")
    greedy = sum(final[f"test/greedy/acc_{n}ppl"] for n in people) / len(people)
    sampled = sum(final[f"test/sample/acc_{n}ppl"] for n in people) / len(people)
    profile = rollout_profile(model, tokenizer, people=people, temperature=temperature, prompt_style=style,
                              max_new_tokens=640)  # fmt: skip
    shares = [profile[f"share_bin{i}"] for i in range(4)]
    measured = {
        "greedy": greedy,
        "gap": greedy - sampled,
        "below_075": sum(shares[:3]),
        "below_025": shares[0],
        "format_errors": final["test/sample/format_error_rate"],
    }
    context = model.config.max_position_embeddings - 128  # the longest quiz prompt at 6 people is under 128 tokens
    more = evaluate(model, tokenizer, load_split("test", more_people), prompt_style=style,
                    max_new_tokens=context, modes=("greedy",), prefix="test") if more_people else {}  # fmt: skip
    return {
        "people": people,
        "per_people": {n: {m: final[f"test/{m}/acc_{n}ppl"] for m in ("greedy", "sample")} for n in people},
        "more_people_greedy": {n: more[f"test/greedy/acc_{n}ppl"] for n in more_people},
        "more_people_len_mean": more.get("test/greedy/len_mean"),
        "profile [0,.25) [.25,.5) [.5,.75) [.75,1]": shares,
        "profile_tokens": profile["tokens"],
        "measured": measured,
        "met": {k: (v < TARGETS[k] if k == "format_errors" else v >= TARGETS[k]) for k, v in measured.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="probe")
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], help="PretrainConfig overrides field=value")
    parser.add_argument("--people", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--size", type=int, default=100, help="test puzzles per people count")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--ideal", action="store_true", help="no training: the traces' own profile and accuracy")
    parser.add_argument("--audit", metavar="DIR", help="no training: audit the greedy traces of a saved lab model")
    parser.add_argument("--targets", metavar="DIR", help="no training: issue 11's targets for a saved lab model")
    parser.add_argument("--more-people", type=int, nargs="*", default=[], help="with --targets: greedy only")
    args = parser.parse_args()
    if args.targets:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(targets(args.targets, args.people, args.more_people, args.temperature), indent=1))
        return
    if args.audit:
        import torch

        torch.set_num_threads(args.threads)
        model, tokenizer = load_policy(args.audit, lora=None)
        trace = json.loads((Path(args.audit) / "lab_model.json").read_text())["config"]["trace"]
        style = PretrainConfig(trace=trace).trace  # the JSON dict, read as the pretrain reads it
        print(json.dumps([audit_greedy(model, tokenizer, style, n) for n in args.people], indent=1))
        return
    if args.ideal:
        trace = {**asdict(RL_TRACE), **parse_overrides(args.set).get("trace", {})}
        print(json.dumps(ideal(TraceStyle(**trace), args.people, args.size), indent=1))
        return

    out = Path("reports/lab_probes") / args.name
    overrides = parse_overrides(args.set)
    base = asdict(PretrainConfig())  # the RL trace under study, cut by length, with room for its length:
    base.update(trace=asdict(RL_TRACE), length_buckets=4, max_new_tokens=896)
    for key, value in overrides.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) else value
    base.update(max_minutes=args.minutes, threads=args.threads, final_people=tuple(args.people), final_size=args.size)
    config = PretrainConfig(**base)
    start = time.perf_counter()
    summary = pretrain(config, out)
    model, tokenizer = load_policy(str(out), lora=None)
    style = prompt_style(config.trace)
    profile = rollout_profile(model, tokenizer, people=3, temperature=args.temperature, prompt_style=style)
    audit = [audit_greedy(model, tokenizer, config.trace, n) for n in args.people]
    result = {
        "name": args.name,
        "overrides": overrides,
        "steps_done": summary["steps_done"],
        "train_minutes": summary["minutes"],
        "parameters": summary["parameters"],
        "final_eval": summary["final_eval"],
        "profile": profile,
        "audit": audit,
        "last_loss": sum(r["loss"] for r in summary["log"][-50:]) / max(1, len(summary["log"][-50:])),
        "wall_minutes": (time.perf_counter() - start) / 60,
    }
    (out / "probe.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "overrides"}, indent=1))


if __name__ == "__main__":
    main()
