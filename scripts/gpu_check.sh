#!/usr/bin/env bash
# Everything hetcomm checks on a machine with a GPU, in one command:
#
#   scripts/gpu_check.sh OUTDIR
#
# 1. builds the extension with CUDA in place (python/hetcomm/_C*.so; no package index needed:
#    torch, numpy, scipy and pytest must already be installed), and the C++ tests and the CUDA
#    kernel benchmark with CMake;
# 2. runs ctest (the CUDA reduce kernels bit for bit against the CPU ones) and the CUDA pytest
#    suite (tests/backend/test_cuda.py, with HETCOMM_REQUIRE_CUDA=1 so that nothing skips
#    silently): every collective, stream semantics, DDP, and every path a CUDA tensor takes (one
#    host through shared memory, TCP and the NCCL inner level; hosts of two through shared memory
#    and NCCL; sites; three levels with NCCL), with fp16/bf16 AVG of large values and the pinned
#    staging memory after a 1 GiB allreduce and after destroy; and DiLoCo with its state on the
#    GPU (tests/train/test_diloco_device.py);
# 3. runs the CUDA benchmarks, 2 ranks on the GPU(s): reduce kernel vs device-to-device copy
#    (bench_reduce); allreduce of CUDA tensors, hetcomm's paths beside torch's NCCL and gloo
#    (python -m hetcomm.bench --device cuda); a DDP training step, hetcomm beside gloo and NCCL
#    (benchmarks/ddp_step_cuda.py); with GPU_CHECK_SWEEP=1 also the staging settings' sweep
#    (benchmarks/cuda/staging_sweep.sh).
#
# Ranks that share a GPU get an NCCL_HOSTID each (the tests and benchmarks set it), so that NCCL
# starts; NCCL's sockets then stay on loopback (NCCL_SOCKET_IFNAME=lo unless set).
#
# OUTDIR receives summary.txt (one line per phase: status, seconds), build.log, tests.log,
# bench.log and the benchmarks' JSON. About 6 minutes on a 16-core H100 machine. Every phase runs
# even if an earlier one failed (except after a failed build); the exit status is the number of
# failed phases. Environment: PYTHON (default python3), GPU_CHECK_ARCH (CUDA architectures,
# default: the GPU's), GPU_CHECK_SWEEP.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
failed=0

record() {  # record NAME RC START_SECONDS
  local status=ok
  if [ "$2" -ne 0 ]; then
    status="FAILED (exit $2$([ "$2" -eq 124 ] && echo ', timed out'))"
    failed=$((failed + 1))
  fi
  printf '%-28s %-30s %5d s\n' "$1" "$status" $((SECONDS - $3)) | tee -a "$OUT/summary.txt"
}

phase() {  # phase NAME LOGFILE TIMEOUT_S COMMAND...
  local name=$1 log=$2 limit=$3 start=$SECONDS
  shift 3
  echo "=== $name: $*" >>"$log"
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  record "$name" $rc $start
  return $rc
}

: >"$OUT/summary.txt"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
  nvcc --version | tail -1 || true
  "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
} >"$OUT/build.log" 2>&1

arch=${GPU_CHECK_ARCH:-$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')}
export TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=${MAX_JOBS:-$(nproc)}
# The C++ tests and the kernel benchmark build with CMake, beside the extension.
torch_prefix=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake_start=$SECONDS
(cmake -S . -B build-gpu -G Ninja -DCMAKE_PREFIX_PATH="$torch_prefix" -DHETCOMM_BUILD_TORCH_CORE=OFF \
   -DHETCOMM_BUILD_CUDA_KERNELS=ON -DCMAKE_CUDA_ARCHITECTURES="${arch/./}" && cmake --build build-gpu) \
  >"$OUT/cmake.log" 2>&1 &
cmake_pid=$!
if ! phase build_extension "$OUT/build.log" 900 "$PY" setup.py build_ext --inplace; then
  echo "build failed: see $OUT/build.log"; tail -40 "$OUT/build.log"; exit 1
fi
objdump -p python/hetcomm/_C*.so | grep NEEDED >>"$OUT/build.log" 2>&1
phase import_with_cuda "$OUT/build.log" 60 "$PY" -c \
  'import hetcomm; assert hetcomm.supported_devices() == ["cpu", "cuda"], hetcomm.supported_devices(); print("hetcomm registers", hetcomm.supported_devices())'
wait $cmake_pid
record cmake_build $? $cmake_start
{ echo "=== cmake (built beside the extension)"; cat "$OUT/cmake.log"; } >>"$OUT/build.log"
rm -f "$OUT/cmake.log"
phase ctest "$OUT/tests.log" 300 ctest --test-dir build-gpu --output-on-failure
phase bench_reduce_kernel "$OUT/bench.log" 300 bash -c "build-gpu/benchmarks/cuda/bench_reduce --mb 256 --iters 50 > '$OUT/reduce_kernel.json'"
# HETCOMM_TEST_START=spawn: every rank a new interpreter, not a fork of the harness's fork server,
# which has the CUDA build of the extension loaded (CUDA must not be initialised before a fork).
# -rP: the staging memory each path held (printed by the tests) goes into the log.
phase pytest_cuda "$OUT/tests.log" 420 env HETCOMM_REQUIRE_CUDA=1 HETCOMM_TEST_START=spawn "$PY" -m pytest -q -rsP \
  -p no:cacheprovider tests/backend/test_cuda.py
# DiLoCo's state on the GPU (state_device): apart, so that a failure there leaves the rest whole.
phase pytest_diloco_cuda "$OUT/tests.log" 240 env HETCOMM_REQUIRE_CUDA=1 HETCOMM_TEST_START=spawn "$PY" -m pytest -q \
  -rs -p no:cacheprovider tests/train/test_diloco_device.py
phase bench_allreduce_cuda "$OUT/bench.log" 300 "$PY" -m hetcomm.bench --device cuda --nprocs 2 \
  --backends nccl,hetcomm,hetcomm-shm-pin,hetcomm-tcp,gloo --sizes 8,1M,16M,64M,256M --seconds-per-size 1.0 --min-iters 5 \
  --timeout 60 --json "$OUT/allreduce_cuda_2ranks_1gpu.json"
phase bench_ddp_step_cuda "$OUT/bench.log" 300 "$PY" benchmarks/ddp_step_cuda.py --nprocs 2 --rounds 5 \
  --backends hetcomm,gloo,nccl --timeout 60 --json "$OUT/ddp_step_cuda_2ranks_1gpu.json"
# NCCL as hetcomm's inner level, apart: a failure there leaves the figures above whole.
phase bench_allreduce_nccl_level "$OUT/bench.log" 300 "$PY" -m hetcomm.bench --device cuda --nprocs 2 \
  --backends hetcomm-nccl,nccl --sizes 8,1M,16M,64M,256M --seconds-per-size 1.0 --min-iters 5 \
  --timeout 60 --json "$OUT/allreduce_cuda_nccl_level_2ranks_1gpu.json"
phase bench_ddp_step_nccl_level "$OUT/bench.log" 300 "$PY" benchmarks/ddp_step_cuda.py --nprocs 2 --rounds 5 \
  --backends hetcomm,hetcomm-nccl,nccl --timeout 60 --json "$OUT/ddp_step_cuda_nccl_level_2ranks_1gpu.json"
if [ "${GPU_CHECK_SWEEP:-0}" = 1 ]; then
  phase bench_staging_sweep "$OUT/bench.log" 300 benchmarks/cuda/staging_sweep.sh "$OUT/staging_sweep.txt"
fi

echo "--- summary ($failed failed)"
cat "$OUT/summary.txt"
exit $failed
