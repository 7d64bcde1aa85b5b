"""Run folders: what a training run leaves on disk, and how to read runs back as pandas DataFrames.

A run folder (``TrainConfig.run_dir``) holds everything needed to reload, compare or resume the run:

    config.json                      the TrainConfig, as JSON
    metrics.jsonl                    one JSON object per completed step, appended and flushed each step
    checkpoints/step_{k}/            adapter/ (PEFT save_pretrained) or model.safetensors (full fine-tuning),
                                     optimizer.pt, rng.pt (python, numpy, torch and CUDA RNG states), state.json
    checkpoints/latest               the name of the newest complete checkpoint ("step_{k}")

    df = load_run("runs/ar")                  # one row per step, one column per metric; df.attrs["config"]
    long = compare(["runs/grpo", "runs/ar"])  # tidy: run, method, step, metric, value

Metric keys (plain floats; plots and widgets read these names, whatever produced the run):

    step                          the RL step, 1-based
    reward/mean, reward/std       Logic-RL reward (3 / -0.5 / -1 / -3) over the step's B = prompts x G completions
    acc/all, acc/{n}ppl           share of completions with reward 3, overall and per people count in the batch
    format/error_rate             share with a format error (format score < 0)
    len/response_mean, len/response_max, len/truncated_share   response tokens; share that hit max_new_tokens
    groups/zero_var_share         share of prompts whose G rewards are all equal (zero advantage, no signal)
    adv/abs_mean                  mean |advantage| over response tokens, after AR when it is on
    ar/weight_mean                mean AR weight alpha * pi_old + 1 - alpha over response tokens (AR runs only)
    lopti/low_share               share of response tokens with pi_old < eta (Lopti runs only)
    policy/entropy                mean entropy of the rollout policy over response tokens (at the temperature)
    policy/approx_kl              k3 estimate of KL(pi_old || pi) during the update (token mean over updates)
    policy/clip_frac_low          share of tokens with ratio < 1 - clip_low and A < 0 (clipped from below)
    policy/clip_frac_high         share of tokens with ratio > 1 + clip_high and A > 0 (clipped from above)
    policy/dual_clip_frac         share of tokens with A < 0 and ratio > dual_clip
    policy/kl                     k3 KL to the reference policy (0 when kl_coef is 0)
    loss/policy                   the clipped loss per minibatch (Lopti: its two stages summed), mean over minibatches
    grad/norm                     gradient norm before clipping, mean over the step's optimizer steps
    update/optimizer_steps        optimizer steps taken this step (minibatches x epochs x stages)
    skipped/nonfinite             1 when a non-finite loss or gradient stopped the step's updates, else 0
    every probe_every steps, from probes.GradientProbe on the step's real backward passes ("position"
    attribution, averaged over the step's backward passes; bins by pi_old, TrainConfig.probe_bins):
    tokens/share_bin{i}           share of response tokens in probability bin i
    grad/norm_bin{i}              norm of the gradient part of the positions that predict bin i's tokens
    grad/share_bin{i}             <g_i, g> / ||g||^2, bin i's share of the gradient (with the context row, sums to 1)
    grad/norm_context, grad/share_context   the same for prompt and padding positions
    grad/norm_probed              norm of the probed (LoRA / Linear and Embedding) gradient
    shift/correct_pos_bin{i}      after the step's update, share of bin i's A > 0 tokens whose probability rose
    shift/correct_neg_bin{i}      ... and of its A < 0 tokens whose probability fell (the paper's Fig. 2b)
    shift/n_pos_bin{i}, shift/n_neg_bin{i}, shift/dp_mean_bin{i}   their token counts and bin i's mean delta p
    time/generate, time/logprob, time/score, time/update, time/eval, time/step     seconds (logprob: the rollout's
                                  old_logp / entropy / reference forward; step: all of it, evaluation included)
    eval/{greedy,sample}/acc_{n}ppl   test accuracy per people count (every eval_every steps and at the end)
    eval/{greedy,sample}/acc_all      mean of the per-people accuracies (the paper's "avg" column)
    eval/{greedy,sample}/format_error_rate, eval/{greedy,sample}/len_mean
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path

import pandas as pd

__all__ = [
    "RunFolder",
    "compare",
    "latest_checkpoint",
    "load_checkpoint",
    "load_config",
    "load_metrics",
    "load_run",
    "method_label",
    "save_checkpoint",
]

CONFIG, METRICS, CHECKPOINTS, LATEST = "config.json", "metrics.jsonl", "checkpoints", "latest"


def method_label(config: Mapping | object) -> str:
    """ "GRPO", "GRPO+AR", "GRPO+Lopti" or "GRPO+AR+Lopti" from a config (dict or dataclass).

    AR counts as on when ar_alpha is set and > 0 (alpha = 0 is GRPO exactly); Lopti with order "high_first" (the
    paper's ablation) reads "GRPO+Lopti(high-first)".
    """
    cfg = asdict(config) if is_dataclass(config) else dict(config)
    label = "GRPO"
    if cfg.get("ar_alpha"):
        label += "+AR"
    if cfg.get("lopti_eta"):
        label += "+Lopti" + ("(high-first)" if cfg.get("lopti_order") == "high_first" else "")
    return label


class RunFolder:
    """Writes a run folder: config once, one metrics line per step (flushed), checkpoints."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS

    def exists(self) -> bool:
        return (self.path / CONFIG).exists() or self.metrics_path.exists()

    def write_config(self, config: Mapping) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.path / CONFIG, json.dumps(dict(config), indent=2, sort_keys=False) + "\n")

    def log(self, record: Mapping) -> None:
        """Append one step's record and flush it to disk, so an interrupted run keeps every completed step."""
        with self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(_plain(record), allow_nan=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def truncate(self, step: int) -> None:
        """Keep only the records of steps <= ``step`` (resume: the steps after the checkpoint are redone)."""
        kept = [r for r in load_metrics(self.path) if r.get("step", 0) <= step]
        _atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))


def load_config(path: str | Path) -> dict:
    file = Path(path) / CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"no {CONFIG} in run folder {path}")
    return json.loads(file.read_text(encoding="utf-8"))


def load_metrics(path: str | Path) -> list[dict]:
    """The metrics records of a run; a torn last line (a run killed mid-write) is ignored."""
    file = Path(path) / METRICS
    if not file.is_file():
        return []
    records = []
    for line in file.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def load_run(path: str | Path) -> pd.DataFrame:
    """One row per step, one column per metric (NaN where a step did not log it), sorted by step.

    ``df.attrs`` holds ``config`` (dict), ``method`` (``method_label``), ``run`` (the folder name) and ``path``.
    """
    path = Path(path)
    config = load_config(path)
    df = pd.DataFrame.from_records(load_metrics(path))
    if df.empty:
        df = pd.DataFrame({"step": pd.Series(dtype="int64")})
    df = df.sort_values("step").reset_index(drop=True)
    df.attrs.update(config=config, method=method_label(config), run=path.name, path=str(path))
    return df


def compare(paths: Iterable[str | Path], metrics: Iterable[str] | None = None) -> pd.DataFrame:
    """Tidy long table over runs: columns run, method, step, metric, value (one row per logged number).

    ``metrics`` keeps only those keys. Runs with the same folder name are told apart by their parent folder.
    """
    paths = list(paths)
    frames = []
    for path in paths:
        wide = load_run(path)
        long = wide.melt(id_vars="step", var_name="metric", value_name="value").dropna(subset=["value"])
        if metrics is not None:
            long = long[long["metric"].isin(list(metrics))]
        long.insert(0, "method", wide.attrs["method"])
        long.insert(0, "run", str(path) if _name_clash(paths, path) else wide.attrs["run"])
        frames.append(long)
    if not frames:
        return pd.DataFrame(columns=["run", "method", "step", "metric", "value"])
    out = pd.concat(frames, ignore_index=True)
    out["value"] = out["value"].astype(float)
    return out.sort_values(["run", "metric", "step"], kind="stable").reset_index(drop=True)


# --- checkpoints ---------------------------------------------------------------------------------------------------


def latest_checkpoint(path: str | Path) -> Path | None:
    """The newest complete checkpoint folder of a run, or None."""
    pointer = Path(path) / CHECKPOINTS / LATEST
    if not pointer.is_file():
        return None
    folder = Path(path) / CHECKPOINTS / pointer.read_text(encoding="utf-8").strip()
    return folder if folder.is_dir() else None


def save_checkpoint(path: str | Path, step: int, model, optimizer=None, tokenizer=None) -> Path:
    """Save the trainable weights, optimizer state and RNG states after ``step``; point ``latest`` at it last, so
    a crash mid-save leaves the previous checkpoint as the latest."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from lopti_lab.models import is_peft, trainable_state_dict

    folder = Path(path) / CHECKPOINTS / f"step_{step}"
    folder.mkdir(parents=True, exist_ok=True)
    if is_peft(model):
        model.save_pretrained(folder / "adapter")  # loadable with peft.PeftModel.from_pretrained(base, folder)
    else:
        save_file(trainable_state_dict(model), folder / "model.safetensors")
        if tokenizer is not None:
            tokenizer.save_pretrained(folder / "tokenizer")
    if optimizer is not None:
        torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, folder / "rng.pt")
    _atomic_write(folder / "state.json", json.dumps({"step": step}) + "\n")
    _atomic_write(Path(path) / CHECKPOINTS / LATEST, folder.name + "\n")
    return folder


def load_checkpoint(folder: str | Path, model, optimizer=None, restore_rng: bool = True) -> int:
    """Load a checkpoint folder into ``model`` (and ``optimizer``), restore the RNG states; returns its step."""
    import numpy as np
    import torch

    from lopti_lab.models import is_peft

    folder = Path(folder)
    if not (folder / "state.json").is_file():
        raise FileNotFoundError(f"not a complete checkpoint (no state.json): {folder}")
    if is_peft(model):
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights

        result = set_peft_model_state_dict(model, load_peft_weights(str(folder / "adapter"), device="cpu"))
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"{folder}: adapter does not match the model ({result.unexpected_keys[:3]} ...)")
    else:
        from safetensors.torch import load_file

        state = load_file(folder / "model.safetensors")
        params = dict(model.named_parameters())
        if set(state) != {n for n, p in params.items() if p.requires_grad}:
            raise ValueError(f"{folder}/model.safetensors does not match the model's trainable parameters")
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=False))
    if restore_rng:
        rng = torch.load(folder / "rng.pt", weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return int(json.loads((folder / "state.json").read_text(encoding="utf-8"))["step"])


# --- helpers -------------------------------------------------------------------------------------------------------


def _atomic_write(file: Path, text: str) -> None:
    tmp = file.with_name(file.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, file)


def _plain(record: Mapping) -> dict:
    """JSON-ready: tensors and numpy scalars become Python floats/ints."""
    out = {}
    for key, value in record.items():
        if hasattr(value, "item"):
            value = value.item()
        out[key] = value
    return out


def _name_clash(paths, path) -> bool:
    names = [Path(p).name for p in paths]
    return names.count(Path(path).name) > 1
