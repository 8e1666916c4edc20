#!/usr/bin/env bash
# The main job of the README: installs everything, then benchmarks allreduce on a local cluster
# of 4 ranks, hetcomm beside gloo in the same run. Extra arguments go to `python -m hetcomm.bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python -m hetcomm.bench "$@"
