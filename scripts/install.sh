#!/usr/bin/env bash
# Installs hetcomm and what it needs into the current Python environment.
# torch is pinned: the CPU build of 2.13.0 is what this project is tested with; an unpinned
# `torch` would pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet "torch==2.13.0" numpy scipy pybind11 ninja pytest pytest-benchmark expecttest matplotlib
# --no-build-isolation: build against the torch installed above, not a fresh one.
python -m pip install --quiet --no-build-isolation -e .
