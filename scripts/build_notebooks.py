"""Write notebooks/*.ipynb from the cell lists in notebooks/src/*.py (the notebooks' source of truth).

    .venv/bin/python scripts/build_notebooks.py          # rewrite every notebook (outputs stripped)
    .venv/bin/python scripts/build_notebooks.py --check  # exit 1 if a committed notebook differs from its source

A source file is plain Python split into cells by ``# %%`` lines (``# %% [markdown]`` for a markdown cell whose
lines are comments), the "percent" format that Jupytext, VS Code and Spyder read. The tests execute the .ipynb files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "notebooks" / "src"
KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}


def parse_cells(text: str) -> list[tuple[str, str]]:
    """[("markdown" | "code", source)] from percent-format text."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# %%"):
            cells.append(("markdown" if "[markdown]" in line else "code", []))
        elif cells:
            cells[-1][1].append(line)
    out = []
    for kind, lines in cells:
        if kind == "markdown":
            lines = [line[2:] if line.startswith("# ") else line.lstrip("#") for line in lines]
        source = "\n".join(lines).strip("\n")
        if source:
            out.append((kind, source))
    return out


def build(source: Path) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = KERNEL
    nb.metadata["language_info"] = {"name": "python"}
    for i, (kind, text) in enumerate(parse_cells(source.read_text(encoding="utf-8"))):
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        cell = make(text)
        cell["id"] = f"{source.stem[:2]}-{i:02d}"  # stable ids keep diffs small
        nb.cells.append(cell)
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, do not write")
    args = parser.parse_args(argv)
    stale = []
    for source in sorted(SOURCES.glob("*.py")):
        target = ROOT / "notebooks" / f"{source.stem}.ipynb"
        text = nbformat.writes(build(source)) + "\n"
        if args.check:
            if not target.is_file() or target.read_text(encoding="utf-8") != text:
                stale.append(target.name)
        else:
            target.write_text(text, encoding="utf-8")
            print(f"wrote {target.relative_to(ROOT)}")
    if stale:
        print(f"out of date (run scripts/build_notebooks.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
