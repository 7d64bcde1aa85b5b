#!/usr/bin/env bash
# Create .venv and install lopti_lab with its test and trl extras, plus the browser the tests drive. Used by the
# README's commands and by CI.
#   TORCH_SPEC   the torch requirement to install first (default torch==2.13.0; on a GPU machine pick the build
#                matching your CUDA, e.g. TORCH_SPEC="torch" with the right --index-url in PIP_EXTRA_INDEX_URL)
#   EXTRAS       the package extras (default "test,trl": the tests cover the TRL integration too)
#   LOPTI_LAB_NO_BROWSER=1   do not install Chromium (the browser tests then need LOPTI_LAB_SKIP_BROWSER=1)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "lopti_lab needs Python 3.11+"'
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build on a CPU-only machine.
.venv/bin/python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install --quiet -e ".[${EXTRAS:-test,trl}]"
# verl's own code, which tests/test_token_credit.py runs beside ours (verl itself cannot be installed next to
# transformers 5: only its wheel is kept, unpacked by the test)
[ -n "$(ls .venv/reference/verl-0.9.1-*.whl 2>/dev/null)" ] || .venv/bin/python -m pip download --quiet --no-deps \
  -d .venv/reference verl==0.9.1 || echo "setup.sh: could not download verl's wheel; tests/test_token_credit.py will skip its verl parity" >&2
# The browser tests (tests/test_browser.py) drive the system's Chromium through Playwright, which never downloads
# one. Debian's package is installed here when this runs as root; elsewhere, install it with your package manager.
if [ "${LOPTI_LAB_NO_BROWSER:-0}" != 1 ] && ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core fonts-liberation >/dev/null
  else
    echo "setup.sh: no Chromium found; the browser tests need one (Debian/Ubuntu: sudo apt-get install chromium" \
      "fonts-dejavu-core; macOS: brew install --cask chromium), or set LOPTI_LAB_SKIP_BROWSER=1 to skip them" >&2
  fi
fi
.venv/bin/python -c 'import torch, transformers, peft, lopti_lab; print("lopti_lab ready: torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'
