"""Kill-anywhere soak: SIGKILL `lopti-lab train` and `lopti-lab demo --quick` at random moments, resume after each
kill, and compare what the interrupted run leaves with a straight run of the same seed.

    .venv/bin/python benchmarks/soak_kill.py --kills 30 --demo-kills 5 --json soak.json   # the recorded run
    .venv/bin/python benchmarks/soak_kill.py --kills 3 --demo-kills 0 --steps 4 --no-eval   # tests/test_soak.py

Each kill is one of four kinds, drawn at random:

    outside      the parent's SIGKILL after a random delay (startup, rollouts, updates, evaluation and I/O alike);
                 --slow-io widens the I/O windows
    append       inside the metrics append of a step still to come, torn at a random byte
    checkpoint   inside one of a checkpoint's writes or renames (weights, optimizer, RNG, state.json, the folder
                 rename, the `latest` pointer), at a random byte
    repair       inside a resume's cut of metrics.jsonl back to its checkpoint (when the folder needs one)

Kill k of N aims at the k/N point of the straight run's durable calls (``paced``): a hook kill picks a call of
its kind between the resume point and there, an outside kill a delay uniform over the startup plus the straight
run's time for that stretch (killing at once if the child gets past it), so the kills spread over the whole run.
The hook kills run through benchmarks/kill_shim.py, which wraps lopti_lab.durable (every durable byte of a run
folder). After each kill the parent checks the folder (resume.check_resume) and continues with
`lopti-lab train --run-dir run --resume` (plain `lopti-lab train` if the kill came before config.json existed: a
folder that holds no run) or reruns `lopti-lab demo --quick`. When the kills are spent the run finishes, and its
metrics.jsonl must equal the straight run's record for record (timings aside: no step missing, doubled or changed),
its final checkpoint files the straight run's byte for byte, and the demo's report files the straight demo's (wall
times aside). Children run on one thread (OMP_NUM_THREADS=1), as do the test workers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lopti_lab import runs
from lopti_lab.resume import check_resume

HERE = Path(__file__).resolve().parent
SHIM = HERE / "kill_shim.py"
KINDS = ("outside", "append", "checkpoint", "repair")
CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "state.json", "latest")
CHECKPOINT_EVENTS = {("write", name) for name in CHECKPOINT_FILES} | {("replace", "step_dir"), ("replace", "latest")}


def train_command(steps: int, save_every: int, seed: int, evaluate: bool) -> list[str]:
    """`lopti-lab train` on the lab model with tiny settings (one step is under a second on one CPU thread)."""
    command = ["train", "--model", "lab", "--lora-r", "none", "--train-people", "3", "--prompts-per-step", "2",
               "--group-size", "2", "--minibatch-size", "2", "--max-new-tokens", "16",
               "--kl-coef", "0", "--lr", "1e-4", "--steps", str(steps), "--save-every", str(save_every),
               "--seed", str(seed), "--run-dir", "run", "--no-progress"]  # fmt: skip
    if evaluate:  # evaluation records (greedy, 2 puzzles) and gradient probes every 3 steps
        return [*command, "--eval-people", "3", "--eval-size", "2", "--eval-modes", "greedy", "--eval-every", "3",
                "--probe-every", "3"]  # fmt: skip
    return [*command, "--eval-people"]


# --- one child ------------------------------------------------------------------------------------------------------


class Child:
    """One `lopti-lab` process under the shim, in folder ``cwd``, tracing into ``cwd/trace-{n}.log``."""

    def __init__(
        self, cwd: Path, command: list[str], n: int, slow: float, target: dict | None = None, stall: dict | None = None
    ):
        self.trace = cwd / f"trace-{n}.log"
        plan = cwd / f"plan-{n}.json"
        plan.write_text(json.dumps({"trace": str(self.trace), "slow": slow, "target": target, "stall": stall}))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.log = (cwd / f"child-{n}.log").open("w")
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, str(SHIM), str(plan), "--", *command], cwd=cwd, env=env, stdout=self.log, stderr=self.log
        )

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            rc = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self.seconds = time.monotonic() - self.started
        self.log.close()
        return rc

    def wait_or_kill(self, delay: float, guard: dict) -> int:
        """SIGKILL after ``delay`` seconds, or earlier, when the trace shows the ``guard`` call beginning (the
        straight run's last record: a run must not finish before its kill); the exit code if it ends first."""
        deadline = self.started + delay
        while time.monotonic() < deadline:
            rc = self.process.poll()
            if rc is not None:
                return self.wait()
            if any(what == "begin" and event == guard for _, what, event in self.events()):
                break
            time.sleep(0.02)
        return self.kill()

    def kill(self) -> int:
        self.process.send_signal(signal.SIGKILL)
        rc = self.process.wait()  # not -SIGKILL if it exited just before the signal
        self.seconds = time.monotonic() - self.started
        self.log.close()
        return rc

    def events(self) -> list[tuple[float, str, dict]]:
        if not self.trace.is_file():
            return []
        out = []
        for line in self.trace.read_text().splitlines():
            t, what, event = line.split(" ", 2)
            out.append((float(t), what, json.loads(event)))
        return out

    def landed(self) -> str:
        """Where the process died: inside which durable call, or between them."""
        open_calls = {}
        for _, what, event in self.events():
            key = json.dumps(event, sort_keys=True)
            if what == "begin":
                open_calls[key] = event
            elif what == "end":
                open_calls.pop(key, None)
        if not open_calls:
            return "between writes"
        event = list(open_calls.values())[-1]
        step = f" (step {event['step']})" if event.get("step") is not None else ""
        return f"inside {event['op']} {event['name']}{step}"


# --- what the folder looks like between kills ------------------------------------------------------------------------


def run_folders(root: Path, demo: bool) -> list[Path]:
    return sorted((root / "demo" / "runs").glob("*")) if demo else [root / "run"]


def folder_state(folder: Path) -> dict:
    """Per run folder: does it hold a run, where would it resume, does the resume need to cut metrics.jsonl back."""
    if not (folder / runs.CONFIG).is_file():
        return {"run": folder.name, "exists": False, "resume": 0, "needs_repair": False}
    point = check_resume(folder)  # raises (and the soak fails) if a kill left a folder that cannot resume
    metrics = folder / runs.METRICS
    needs = metrics.is_file() and metrics.read_bytes() != point.kept
    return {"run": folder.name, "exists": True, "resume": point.step, "needs_repair": needs}


def recurring(events: list[dict], states: dict[str, dict], finished: set[str]) -> list[int]:
    """Indexes of the straight run's durable calls that the next child makes again: those of unfinished runs whose
    step lies after the run's resume point (config writes, with no step, recur at every start)."""
    out = []
    for i, event in enumerate(events):
        resume = states.get(event["run"], {"resume": 0})["resume"]
        if event["run"] not in finished and (event["step"] is None or event["step"] > resume):
            out.append(i)
    return out


def paced(indexes: list[int], aim: int) -> list[int]:
    """The recurring calls up to call number ``aim`` of the straight run (at least the next one): kill k of N aims
    at the k/N point of the run, so the kills spread over it instead of piling up at its end."""
    return [i for i in indexes if i <= max(aim, indexes[0])]


def choose_target(
    kind: str, candidates: list[dict], states: dict[str, dict], rng: random.Random, last_commit: dict
) -> dict | None:
    """A kill target for a hook kind, or None when no call of that kind is still to come."""
    if kind == "repair":
        needy = [name for name, s in states.items() if s["needs_repair"]]
        return {"op": "write", "name": "metrics.jsonl", "run": rng.choice(needy)} if needy else None
    if kind == "append":
        pool = [e for e in candidates if e["op"] == "append"]
    else:
        pool = [e for e in candidates if (e["op"], e["name"]) in CHECKPOINT_EVENTS]
    if not pool:
        return None
    event = rng.choice(pool)
    cut = rng.random() * (0.5 if event == last_commit else 1.0)  # a kill after the last commit would be no kill
    return {**event, "cut": round(cut, 3)}


# --- the soak ---------------------------------------------------------------------------------------------------------


def straight_run(root: Path, command: list[str], slow: float) -> tuple[float, list[tuple[float, dict]]]:
    root.mkdir(parents=True)
    child = Child(root, command, 0, slow)
    rc = child.wait()
    if rc != 0:
        raise SystemExit(f"the straight run failed (exit {rc}); see {child.log.name}")
    begins = [(t, event) for t, what, event in child.events() if what == "begin"]
    return child.seconds, begins


def soak(
    kind: str,
    kills: int,
    command: list[str],
    workdir: Path,
    *,
    seed: int,
    slow: float,
    finished_step: int,
    kinds: tuple[str, ...] = KINDS,
) -> dict:
    """Straight run, then ``kills`` kills with a resume after each, then the comparison; a dict of figures."""
    demo = kind == "demo"
    rng = random.Random(seed)
    schedule = [kinds[i % len(kinds)] for i in range(kills)]
    rng.shuffle(schedule)  # every kind about equally often, in a random order
    total, timeline = straight_run(workdir / "straight", command, slow)
    straight_events = [event for _, event in timeline]
    last_commit = [e for e in straight_events if (e["op"], e["name"]) == ("replace", "latest")][-1]
    last_record = [e for e in straight_events if e["op"] == "append"][-1]
    startup = min(t for t, e in timeline if e["op"] == "append")  # to the first record: imports, loading, step 1
    root = workdir / "killed"
    root.mkdir()
    log, n = [], 0
    while len(log) < kills:
        states = {f.name: folder_state(f) for f in run_folders(root, demo)}
        finished = {name for name, s in states.items() if s["exists"] and s["resume"] >= finished_step}
        upcoming = recurring(straight_events, states, finished)
        if not upcoming:
            break  # finished: nothing left to interrupt
        window = paced(upcoming, math.ceil((len(log) + 1) * len(straight_events) / kills) - 1)
        candidates = [straight_events[i] for i in window]
        kill_kind = schedule[len(log)]
        target = None if kill_kind == "outside" else choose_target(kill_kind, candidates, states, rng, last_commit)
        if kill_kind != "outside" and target is None:
            target = choose_target("append", candidates, states, rng, last_commit)
            kill_kind = "append" if target else "outside"
        n += 1
        stall = last_commit if kill_kind == "outside" else None  # an outside kill always comes before the end
        child = Child(root, _resume_command(command, root, demo), n, slow, target, stall)
        if kill_kind == "outside":  # uniform over startup and the straight run's time for the window's calls
            span = timeline[window[-1]][0] - timeline[window[0]][0]
            later = [straight_events[i] for i in upcoming if i > window[-1]]
            rc = child.wait_or_kill(rng.uniform(0.0, startup + span), later[0] if later else last_record)
        else:
            rc = child.wait()
        if rc != -signal.SIGKILL:
            log.append({"kind": kill_kind, "missed": True, "exit": rc})
            break  # the run ended before the kill: nothing left to interrupt
        log.append(
            {
                "kind": kill_kind,
                "target": target,
                "landed": child.landed(),
                "seconds": round(child.seconds, 2),
                "resume_from": {name: s["resume"] for name, s in states.items()},
            }
        )
    final = Child(root, _resume_command(command, root, demo), n + 1, 0.0)
    if final.wait() != 0:
        raise SystemExit(f"the final resume failed; see {final.log.name}")
    result = {"what": kind, "kills": sum(not k.get("missed") for k in log), "straight_seconds": round(total, 1),
              "kinds": {k: sum(e["kind"] == k and not e.get("missed") for e in log) for k in KINDS},
              "log": log}  # fmt: skip
    result.update(compare_runs(workdir / "straight", root, demo))
    if demo:
        result.update(compare_reports(workdir / "straight" / "demo", root / "demo"))
    return result


def _resume_command(command: list[str], root: Path, demo: bool) -> list[str]:
    if demo or not (root / "run" / runs.CONFIG).is_file():
        return command  # the demo resumes by itself; a folder without config.json holds no run yet
    return ["train", "--run-dir", "run", "--resume", "--no-progress"]


# --- comparison -------------------------------------------------------------------------------------------------------


def _steady(record: dict) -> str:
    return json.dumps({k: v for k, v in record.items() if not k.startswith("time/")}, sort_keys=True)


def compare_runs(straight: Path, killed: Path, demo: bool) -> dict:
    """Per run folder: the metrics records (timings aside) and the final checkpoint's files."""
    records = steps_ok = files = same_files = 0
    mismatches = []
    for a in run_folders(straight, demo):
        b = killed / a.relative_to(straight)
        ra, rb = runs.load_metrics(a), runs.load_metrics(b)
        records += len(ra)
        steps = [r["step"] for r in rb]
        steps_ok += steps == list(range(1, len(ra) + 1))
        mismatches += [f"{b.name} step {x['step']}" for x, y in zip(ra, rb) if _steady(x) != _steady(y)]
        mismatches += [f"{b.name}: {len(rb)} records, straight {len(ra)}"] * (len(ra) != len(rb))
        ma = json.loads((runs.latest_checkpoint(a) / "state.json").read_text())["files"]
        mb = json.loads((runs.latest_checkpoint(b) / "state.json").read_text())["files"]
        files += len(ma)
        same_files += sum(mb.get(name) == meta for name, meta in ma.items())
    return {"records": records, "identical": not mismatches, "mismatches": mismatches,
            "steps_exactly_once": steps_ok == len(run_folders(straight, demo)),
            "checkpoint_files": files, "checkpoint_files_identical": same_files}  # fmt: skip


def compare_reports(straight: Path, killed: Path) -> dict:
    """The demo's report folder, file by file: wall times (report.md's minutes, summary.json's "minutes",
    metrics.csv's time/* rows) aside, every file must be byte-identical."""
    names = sorted(p.name for p in straight.iterdir() if p.is_file())
    differ = [name for name in names if _report_bytes(straight / name) != _report_bytes(killed / name)]
    return {"report_files": len(names), "report_files_identical": len(names) - len(differ), "report_differ": differ}


def _report_bytes(file: Path) -> bytes:
    if not file.is_file():
        return b"<missing>"
    if file.name == "summary.json":
        summary = json.loads(file.read_text())
        summary.pop("minutes", None)
        return json.dumps(summary, sort_keys=True).encode()
    if file.name == "report.md":
        return re.sub(r"[\d.]+ minutes in all", "<minutes> in all", file.read_text()).encode()
    if file.name == "metrics.csv":
        return "".join(line for line in file.open() if ",time/" not in line).encode()
    return file.read_bytes()


# --- command line -----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=30, help="SIGKILLs of `lopti-lab train` (default 30)")
    parser.add_argument(
        "--demo-kills", type=int, default=5, help="SIGKILLs of `lopti-lab demo --quick` (0: skip; default 5)"
    )
    parser.add_argument("--steps", type=int, default=12, help="RL steps of the train run (default 12)")
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--no-eval", action="store_true", help="no evaluation or probes in the train run")
    parser.add_argument("--slow-io", type=float, default=0.02, help="seconds each durable write sleeps halfway")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule (the run uses seed 0)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"kill kinds to use (default {','.join(KINDS)})")
    parser.add_argument("--workdir", help="keep the run folders here (default: a temporary folder)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        work = Path(args.workdir or tmp)
        start = time.monotonic()
        kinds = tuple(args.kinds.split(","))
        if args.kills:
            command = train_command(args.steps, args.save_every, 0, not args.no_eval)
            results.append(soak("train", args.kills, command, work / "train", seed=args.seed, slow=args.slow_io,
                                finished_step=args.steps, kinds=kinds))  # fmt: skip
        if args.demo_kills:
            # one process: the kill shim traces this process's writes (worker processes: tests/test_demo.py)
            demo = ["demo", "--quick", "--out", "demo", "--threads", "1", "--workers", "1"]
            results.append(soak("demo", args.demo_kills, demo, work / "demo", seed=args.seed + 1, slow=args.slow_io,
                                finished_step=2, kinds=kinds))  # fmt: skip
        seconds = time.monotonic() - start
    for r in results:
        print(f"{r['what']}: {r['kills']} kills {r['kinds']}, {r['records']} records, identical: {r['identical']}, "
              f"steps exactly once: {r['steps_exactly_once']}, final checkpoint files identical: "
              f"{r['checkpoint_files_identical']}/{r['checkpoint_files']}"
              + (f", report files identical: {r['report_files_identical']}/{r['report_files']}" if "report_files"
                 in r else ""))  # fmt: skip
        for k in r["log"]:
            print(f"  {k['kind']:10s} {k.get('landed', 'missed')}")
    print(f"{seconds:.0f} s wall in all (load: {os.getloadavg()[0]:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"seconds": seconds, "results": results}, indent=1) + "\n")
    ok = all(r["identical"] and r["steps_exactly_once"] and r["kills"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
