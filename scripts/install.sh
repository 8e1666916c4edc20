#!/usr/bin/env bash
# Installs hetcomm and what it needs into the current Python environment.
#   bash scripts/install.sh              what it needs, then hetcomm itself (pip install -e .)
#   bash scripts/install.sh --deps-only  only what it needs (scripts/test.sh builds hetcomm itself)
# torch is pinned: the CPU build of 2.13.0 is what this project is tested with; an unpinned
# `torch` would pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet "torch==2.13.0" numpy scipy pybind11 ninja pytest pytest-benchmark pytest-xdist \
  expecttest matplotlib
if [ "${1:-}" = "--deps-only" ]; then exit 0; fi
# --no-build-isolation: build against the torch installed above, not a fresh one.
python -m pip install --quiet --no-build-isolation -e .
