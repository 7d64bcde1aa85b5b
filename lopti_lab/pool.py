"""Runs trained side by side, each in a process of its own, with one progress bar over all their steps (the demo's
and the mechanism study's).

    pool = RunPool([config_a, config_b, ...], workers=2, threads=1)    # the runs start now (TrainConfigs, run_dir set)
    ...                                                               # other work meanwhile
    pool.wait()                                                       # every run finished

Why processes: the lab model is small, so a torch op on two threads spends much of its time handing work between
them; two one-thread processes get more done on two cores (benchmarks/README.md, "Demo wall time"). Each run is a
function of its TrainConfig alone (seeded, one thread), so a run trained here equals the same run trained in the
calling process at one thread, record for record (tests/test_demo.py). A run that fails raises its error
from ``wait`` and stops the other processes; the runs that finished are kept, and the demo called again trains the
rest.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import torch
from tqdm.auto import tqdm

from lopti_lab import runs
from lopti_lab.train_config import TrainConfig
from lopti_lab.trainer import train

__all__ = ["RunPool", "finished", "train_or_resume", "train_while"]

T = TypeVar("T")

POLL_SECONDS = 2.0
"""How often the progress bar reads the runs' step counts."""


class RunPool:
    """Train ``configs`` (TrainConfigs, each with its ``run_dir``) in ``workers`` processes of ``threads`` torch threads
    each, the longest runs first (a Lopti run updates twice per step), so the last to finish are short. A run whose
    folder holds an unfinished run of it resumes."""

    def __init__(self, configs: Sequence[TrainConfig], workers: int, threads: int):
        order = sorted(configs, key=lambda c: -c.steps * (1 if c.lopti_eta is None else 2))
        self.steps, self.dirs = [c.steps for c in order], [Path(c.run_dir) for c in order]
        self.workers = min(workers, len(order))
        context = multiprocessing.get_context("spawn")  # no forked copy of this process's torch threads
        self._pool = context.Pool(self.workers, initializer=_start_worker, initargs=(threads, os.getpid()))
        self._results = [self._pool.apply_async(_train_run, (config,)) for config in order]

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids."""
        return [process.pid for process in self._pool._pool]

    def wait(self) -> None:
        """Block until every run has finished, then end the processes. The first run to fail raises its error here,
        and an error or an interrupt stops every process (``stop``): the runs that finished are kept, and the demo
        called again reuses them and trains the rest."""
        bar = tqdm(
            total=sum(self.steps),
            initial=self._logged(),
            desc=f"{len(self.dirs)} runs, {self.workers} at a time",
            unit="step",
        )
        try:
            pending = list(self._results)
            while pending:
                pending[0].wait(POLL_SECONDS)
                bar.update(self._logged() - bar.n)
                for result in [r for r in pending if r.ready()]:
                    result.get()  # a run's exception, raised in this process
                    pending.remove(result)
        except BaseException:
            self.stop()
            raise
        finally:
            bar.close()
        self._pool.close()
        self._pool.join()

    def stop(self) -> None:
        """End every process now, runs in progress included."""
        self._pool.terminate()
        self._pool.join()

    def _logged(self) -> int:
        """Steps the runs have written so far (lines of their metrics.jsonl)."""
        total = 0
        for run_dir, steps in zip(self.dirs, self.steps, strict=True):
            metrics = run_dir / runs.METRICS
            if metrics.is_file():
                total += min(steps, metrics.read_bytes().count(b"\n"))
        return total


def _start_worker(threads: int, parent: int) -> None:
    """A worker's set-up: its torch threads, and a watch that ends it within a second of its parent's death (a
    SIGKILLed demo must not leave a run half-trained by an orphan while the demo called again resumes that run)."""
    torch.set_num_threads(threads)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def train_or_resume(config: TrainConfig) -> None:
    """Train one run, resuming its folder when that holds an unfinished run of it."""
    train(config, resume=runs.RunFolder(config.run_dir).exists())


def finished(config: TrainConfig) -> bool:
    """Whether a run's folder holds the complete run: its final checkpoint is committed (runs.py: its records are
    then on disk too). A run killed before that resumes (``train_or_resume``) and redoes what was not saved."""
    checkpoint = runs.latest_checkpoint(config.run_dir)
    return checkpoint is not None and checkpoint.name == f"step_{config.steps}"


def _train_run(config: TrainConfig) -> None:
    """One run in a worker process, without a progress bar of its own (``RunPool.wait`` draws one for all)."""
    train_or_resume(replace(config, progress=False))


def train_while(configs: Sequence[TrainConfig], workers: int, meanwhile: Callable[[], T]) -> T:
    """Train ``configs`` while ``meanwhile()`` runs in this process, and return what it returns: in ``workers``
    processes sharing this process's torch threads (``RunPool``), or, with one worker, one after another here once
    ``meanwhile`` is done. An error or an interrupt in ``meanwhile`` stops the workers; finished runs are kept."""
    pool, threads_before = None, torch.get_num_threads()
    if workers > 1 and configs:
        torch.set_num_threads(max(1, threads_before // workers))
        pool = RunPool(configs, workers, torch.get_num_threads())
    try:
        value = meanwhile()
    except BaseException:
        if pool is not None:
            pool.stop()
        raise
    finally:
        torch.set_num_threads(threads_before)
    if pool is None:
        for config in configs:
            train_or_resume(config)
    else:
        pool.wait()
    return value
