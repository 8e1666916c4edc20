#!/usr/bin/env bash
# What CI does, on this machine: clone the repository fresh, make a virtual environment without
# torch, run .ci/run (the README's test command) and report its exit status and seconds.
# Usage: bash scripts/fresh_clone_test.sh [N]   (clone in /tmp/ciN, log in /tmp/ciN.log)
set -u
n=${1:-1}
repo=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "/tmp/ci$n" "/tmp/venv$n"
git clone -q "$repo" "/tmp/ci$n"
python3 -m venv "/tmp/venv$n"
# shellcheck disable=SC1090
source "/tmp/venv$n/bin/activate"
cd "/tmp/ci$n" || exit 1
start=$(date +%s)
bash .ci/run > "/tmp/ci$n.log" 2>&1
rc=$?
echo "fresh clone run $n: exit $rc in $(( $(date +%s) - start )) s (log /tmp/ci$n.log)" | tee -a "/tmp/ci$n.log"
exit $rc
