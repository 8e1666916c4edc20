#!/usr/bin/env bash
# How the CUDA staging settings (csrc/common/env.h: HETCOMM_DEVICE_*) change a CUDA allreduce of
# 2 ranks sharing one GPU: one `python -m hetcomm.bench` run per setting, CPU tensors and gloo
# beside them for scale. Needs a GPU and a CUDA build (scripts/gpu_check.sh builds one).
#
#   benchmarks/cuda/staging_sweep.sh OUTFILE
set -uo pipefail
out=${1:?usage: benchmarks/cuda/staging_sweep.sh OUTFILE}
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
echo "# $(date -u +%F) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), 2 ranks on it, float32 sum" >"$out"
echo "# columns: size(B) count type redop | time(us) algbw busbw #wrong [| gloo: same | busbw ratio]" >>"$out"
run() {  # NAME "VAR=VALUE ..." BENCH ARGS...
  local name=$1 vars=$2
  shift 2
  echo "### $name [$vars] python -m hetcomm.bench --nprocs 2 --sizes 1M,4M,16M,64M $*" | tee -a "$out"
  env $vars timeout 120 python3 -m hetcomm.bench --nprocs 2 --sizes 1M,4M,16M,64M --seconds-per-size 0.5 \
    --min-iters 5 --timeout 60 "$@" 2>&1 | grep -E "^ +[0-9]+ |rror|failed" | tee -a "$out"
}
run cpu_tensors "" --backends hetcomm,gloo
run default "" --device cuda --backends hetcomm,gloo
run staged_only "HETCOMM_DEVICE_HOST_REDUCE_BYTES=0" --device cuda --backends hetcomm
run whole_up_to_64m "HETCOMM_DEVICE_HOST_REDUCE_BYTES=67108864" --device cuda --backends hetcomm
run slot_4m "HETCOMM_DEVICE_HOST_REDUCE_BYTES=0 HETCOMM_DEVICE_SLOT_BYTES=4194304" --device cuda --backends hetcomm
run slot_256k "HETCOMM_DEVICE_HOST_REDUCE_BYTES=0 HETCOMM_DEVICE_SLOT_BYTES=262144" --device cuda --backends hetcomm
run poll_5us "HETCOMM_DEVICE_HOST_REDUCE_BYTES=0 HETCOMM_DEVICE_POLL_US=5" --device cuda --backends hetcomm
