"""The Knights-and-Knaves environment: puzzles in, rewards out. No torch here.

logic     statement trees, truth evaluation, brute-force solver, solver trace
generate  puzzle sampler, the dataset's English, chains of thought, the Puzzle record
reward    prompt formats, answer parsing, the Logic-RL reward
data      datasets on disk (JSONL), the HF loader, Logic-RL/verl parquet export
"""

from lopti_lab.kk.data import (
    build_dataset,
    dataset_stats,
    export_parquet,
    load_hf,
    load_jsonl,
    load_split,
    read_parquet,
    save_jsonl,
    to_logic_rl_rows,
)
from lopti_lab.kk.generate import (
    NAMES,
    TEMPLATES,
    Puzzle,
    generate_puzzle,
    render_compact_trace,
    render_cot,
    render_quiz,
    render_statement,
)
from lopti_lab.kk.logic import TraceStep, evaluate, parse_statements, solve, solver_trace
from lopti_lab.kk.reward import (
    PROMPT_STYLES,
    RESPONSE_PREFIX,
    TOTALS,
    Reward,
    base_prompt,
    build_prompt,
    chat_messages,
    check_format,
    instruct_prompt,
    parse_answer,
    score,
    score_response,
)

__all__ = [
    "NAMES",
    "PROMPT_STYLES",
    "RESPONSE_PREFIX",
    "TEMPLATES",
    "TOTALS",
    "Puzzle",
    "Reward",
    "TraceStep",
    "base_prompt",
    "build_dataset",
    "build_prompt",
    "chat_messages",
    "check_format",
    "dataset_stats",
    "evaluate",
    "export_parquet",
    "generate_puzzle",
    "instruct_prompt",
    "load_hf",
    "load_jsonl",
    "load_split",
    "parse_answer",
    "parse_statements",
    "read_parquet",
    "render_compact_trace",
    "render_cot",
    "render_quiz",
    "render_statement",
    "save_jsonl",
    "score",
    "score_response",
    "solve",
    "solver_trace",
    "to_logic_rl_rows",
]  # fmt: skip
