"""The child side of the kill-anywhere soak (soak_kill.py): run a `lopti-lab` command with its durable I/O traced,
optionally slowed, and optionally killed from inside one chosen write.

    python benchmarks/kill_shim.py PLAN.json -- train --run-dir runs/x --resume

PLAN.json: {"trace": "trace.log", "slow": 0.02, "target": {"op": "append", "name": "metrics.jsonl", "step": 3,
"run": "x", "cut": 0.4}, "stall": {...}} (target and stall optional). Every call of lopti_lab.durable.write / append /
replace (all the durable bytes a run folder gets, runs.py and resume.py) is logged to the trace as a "begin" line and an
"end" line, so the parent can tell where an outside SIGKILL landed. ``slow`` sleeps that many seconds in the middle of
each call (half the bytes written, then the rest), widening those windows for random outside kills. When a call matches
the target, the shim writes the first ``cut`` share of its bytes (a write or append torn there; for a rename: before it
if cut < 0.5, after it otherwise), then SIGKILLs its own process: a power cut at that byte, as far as the run folder can
tell. A rename matching ``stall`` waits (for the parent's outside kill) instead of happening.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

from lopti_lab import durable

_STEP = re.compile(r"step_(\d+)")


def describe(op: str, path: Path, data: bytes | None) -> dict:
    """What a durable call is about: {"op", "name", "step", "run"}; e.g. append of metrics.jsonl with the record of
    step 3 -> {"op": "append", "name": "metrics.jsonl", "step": 3, "run": "<run folder name>"}."""
    path = Path(path)
    name, step, run = path.name.removesuffix(durable.TMP), None, path.parent.name
    if op == "append":
        step = json.loads(data)["step"] if data else None
    parent = _STEP.fullmatch(path.parent.name.split(".")[0])
    if parent:  # a file inside checkpoints/step_k.partial/
        step, run = int(parent.group(1)), path.parents[2].name
    if _STEP.fullmatch(name):  # the rename of step_k.partial to step_k
        step, name, run = int(name.split("_")[1]), "step_dir", path.parents[1].name
    if name == "latest":
        run = path.parents[1].name
        if data:
            step = int(data.decode().strip().split("_")[1])
    return {"op": op, "name": name, "step": step, "run": run}


def matches(event: dict, target: dict | None) -> bool:
    return target is not None and all(event.get(k) == v for k, v in target.items() if k != "cut")


class Shim:
    """Wraps lopti_lab.durable's write, append and replace (module attributes: runs.py and resume.py call them through
    the module, so the wrappers see every call)."""

    def __init__(self, plan: dict):
        self.trace = os.open(plan["trace"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.slow, self.target, self.stall = float(plan.get("slow", 0.0)), plan.get("target"), plan.get("stall")
        self.t0 = time.monotonic()
        self.real = {"write": durable.write, "append": durable.append, "replace": durable.replace}

    def log(self, what: str, event: dict) -> None:
        line = f"{time.monotonic() - self.t0:.4f} {what} {json.dumps(event, sort_keys=True)}\n"
        os.write(self.trace, line.encode())  # unbuffered: survives the SIGKILL

    def install(self) -> None:
        durable.write = lambda path, data: self.bytes_call("write", path, data)
        durable.append = lambda path, data: self.bytes_call("append", path, data)
        durable.replace = self.replace_call

    def bytes_call(self, op: str, path, data: bytes) -> None:
        event = describe(op, path, data)
        self.log("begin", event)
        real = self.real[op]
        if matches(event, self.target):
            cut = int(len(data) * float(self.target.get("cut", 0.5)))
            if op == "write" or cut:
                real(path, data[:cut])
            self.die(event)
        if self.slow and op == "append":  # two appends: a reader (or a kill) can see the first half alone
            half = len(data) // 2
            real(path, data[:half])
            time.sleep(self.slow)
            real(path, data[half:])
        else:
            real(path, data)
            time.sleep(self.slow)
        self.log("end", event)

    def replace_call(self, src, dst) -> None:
        pointer = Path(dst).name == "latest"
        event = describe("replace", dst, Path(src).read_bytes() if pointer else None)
        self.log("begin", event)
        if matches(event, self.stall):  # wait here for the parent's SIGKILL: the run must not finish before it
            self.log("stall", event)
            time.sleep(3600)
        if matches(event, self.target) and float(self.target.get("cut", 0.0)) < 0.5:
            self.die(event)
        self.real["replace"](src, dst)
        if matches(event, self.target):
            self.die(event)
        time.sleep(self.slow)
        self.log("end", event)

    def die(self, event: dict) -> None:
        self.log("kill", event)
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    plan_file, sep, *command = argv
    if sep != "--":
        raise SystemExit("usage: kill_shim.py PLAN.json -- <lopti-lab arguments>")
    Shim(json.loads(Path(plan_file).read_text())).install()
    from lopti_lab.cli import main as lopti_lab

    return lopti_lab(command)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
