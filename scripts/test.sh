#!/usr/bin/env bash
# The test command of the README: installs everything, then runs the C++ unit tests (ctest) and
# the Python multi-process tests (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
torch_prefix=$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S . -B build -G Ninja -DCMAKE_PREFIX_PATH="$torch_prefix" -DHETCOMM_BUILD_TORCH_CORE=OFF > build-cmake.log
cmake --build build
ctest --test-dir build --output-on-failure
python -m pytest -q tests
