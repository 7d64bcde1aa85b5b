#!/usr/bin/env bash
# Create .venv and install lopti_lab with its test and trl extras. Used by the README's commands and by CI.
#   TORCH_SPEC   the torch requirement to install first (default torch==2.13.0; on a GPU machine pick the build
#                matching your CUDA, e.g. TORCH_SPEC="torch" with the right --index-url in PIP_EXTRA_INDEX_URL)
#   EXTRAS       the package extras (default "test,trl": the tests cover the TRL integration too)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "lopti_lab needs Python 3.11+"'
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build on a CPU-only machine.
.venv/bin/python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install --quiet -e ".[${EXTRAS:-test,trl}]"
.venv/bin/python -c 'import torch, transformers, peft, lopti_lab; print("lopti_lab ready: torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'
