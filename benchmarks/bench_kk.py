"""How fast is the K&K environment? Generation of 1,000 puzzles per people count, solving and scoring.

.venv/bin/python benchmarks/bench_kk.py
"""

from __future__ import annotations

import time

from lopti_lab.kk import generate_puzzle, score, solve


def main() -> None:
    for n in (3, 5, 8):
        start = time.perf_counter()
        puzzles = [generate_puzzle(n, seed) for seed in range(1000)]
        gen = time.perf_counter() - start
        start = time.perf_counter()
        for p in puzzles:
            solve(p.statements, n)
        solve_s = time.perf_counter() - start
        completions = [f"<think> x </think><answer>{p.solution_text_format}</answer>" for p in puzzles]
        start = time.perf_counter()
        assert all(score(c, p).total == 3 for c, p in zip(completions, puzzles, strict=True))
        score_s = time.perf_counter() - start
        print(f"{n} people: generate 1,000 in {gen:.2f} s, solve 1,000 in {solve_s * 1e3:.0f} ms, "
              f"score 1,000 in {score_s * 1e3:.0f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
