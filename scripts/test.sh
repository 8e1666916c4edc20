#!/usr/bin/env bash
# The test command of the README: installs everything, builds the C++ once, then runs the C++
# unit tests (ctest) and the Python multi-process tests (pytest), printing the 30 slowest.
#
#   bash scripts/test.sh                 everything (what CI runs)
#   bash scripts/test.sh -x              extra arguments are pytest options, given to both passes
#   HETCOMM_TEST_MARK="not slow" bash scripts/test.sh     narrows both passes by marker
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
stamp() { echo "[test.sh] $1 at $(( $(date +%s) - start )) s"; }
# The CUDA kernels are compiled (not run) wherever nvcc is found, on PATH or where CUDA installs
# it, so that a kernel that does not build cannot land even though CI has no GPU.
nvcc_path=$(command -v nvcc || true)
for candidate in "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do
  if [ -z "$nvcc_path" ] && [ -x "$candidate" ]; then nvcc_path=$candidate; fi
done
if [ -n "$nvcc_path" ]; then
  echo "CUDA kernels: compiling with $nvcc_path"
  cuda_args=(-DHETCOMM_BUILD_CUDA_KERNELS=ON "-DCMAKE_CUDA_COMPILER=$nvcc_path")
else
  echo "CUDA kernels: NOT compiled (no nvcc on PATH, in \$CUDA_HOME/bin or /usr/local/cuda*/bin)"
  cuda_args=(-DHETCOMM_BUILD_CUDA_KERNELS=OFF)
fi
# The torch-free core (hetcomm_base), the C++ tests and the CUDA kernels, once: the extension
# below links this hetcomm_base instead of compiling its sources again. It needs neither torch
# nor pip's ninja, so where cmake and ninja are installed already it builds while pip installs
# the dependencies (pip mostly unpacks torch, on one core); its output follows pip's.
build_core() {
  cmake -S . -B build -G Ninja -DHETCOMM_BUILD_TORCH_CORE=OFF "${cuda_args[@]}" > build-cmake.log && cmake --build build
}
core_pid=
# Interrupted (Ctrl-C, a CI cancel): the background build stops with the script, instead of
# writing build/ under the next run. It runs in a process group of its own (set -m) for that.
stop_core() {
  if [ -n "$core_pid" ] && kill -0 "$core_pid" 2> /dev/null; then
    kill -- "-$core_pid" 2> /dev/null || true
    wait "$core_pid" 2> /dev/null || true
  fi
}
trap 'stop_core; trap - INT; kill -INT $$' INT
trap 'stop_core; trap - TERM; kill -TERM $$' TERM
trap 'stop_core' EXIT
if command -v cmake > /dev/null && command -v ninja > /dev/null; then
  set -m
  build_core < /dev/null > build-core.log 2>&1 &
  core_pid=$!
  set +m
fi
deps_status=0
bash scripts/install.sh --deps-only || deps_status=$?
if [ "$deps_status" != 0 ]; then
  # (the core's build is left to end first: it writes build/, which the next run would race)
  [ -z "$core_pid" ] || wait "$core_pid" || true
  echo "[test.sh] installing the dependencies failed (exit $deps_status)"
  exit "$deps_status"
fi
stamp "dependencies installed"
if [ -n "$core_pid" ]; then
  core_status=0
  wait "$core_pid" || core_status=$?
  core_pid=
  cat build-core.log
  [ "$core_status" = 0 ] || { echo "[test.sh] the C++ core's build failed (exit $core_status)"; exit "$core_status"; }
else
  build_core
fi
stamp "C++ core and tests built"
HETCOMM_PREBUILT_BASE="$PWD/build/libhetcomm_base.a" python -m pip install --quiet --no-build-isolation -e .
stamp "extension built"
ctest --test-dir build --output-on-failure
# ctest names the skipped tests (test_reduce_cuda without a GPU) but not why; their programs said why.
grep -h '^\[ SKIP \]' build/Testing/Temporary/LastTest.log || true
stamp "ctest done"
# HETCOMM_REQUIRE_SIM=1: a test that needs the simulator fails instead of skipping where it cannot
# run (CI runs as root with network namespaces), so that nothing is skipped into green; a developer
# without root sets HETCOMM_REQUIRE_SIM=0 to skip them instead.
export HETCOMM_REQUIRE_SIM=${HETCOMM_REQUIRE_SIM:-1}
# Two passes. First the tests that may run beside another, on two workers (pytest-xdist, a file
# at a time per worker, so that a module's shared job runs once): while one test waits -- for a
# timeout, a heartbeat, a round -- the other computes. Then, alone, the simulator's tests (they
# measure shaped rates and CPU shares) and those marked serial (they look at what every job
# shares). Both passes run whatever the first found.
status=0
also=${HETCOMM_TEST_MARK:+ and ($HETCOMM_TEST_MARK)}
python -m pytest -q tests -n 2 --dist loadfile -m "(not sim and not serial)$also" --durations=30 "$@" || status=$?
stamp "pytest (parallel pass) done"
python -m pytest -q tests -m "(sim or serial)$also" --durations=30 "$@" || status=$?
stamp "pytest (serial pass) done"
exit $status
