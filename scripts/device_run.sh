#!/usr/bin/env bash
# On a lent CUDA machine (no network; python3 with torch and CUDA): installs
# the wheels scripts/device_wheels.sh fetched, then runs the GPU checks with
# that python3, logging to $OUT when set. The device call carries .whl:
#
#   bash scripts/device_run.sh [versions|tests|gemm|profile|worker|transfer|pd|offload|all] ...
#
# Each step gets STEP_TIMEOUT seconds (default 150), so one hung step leaves
# the lease to the others; the figures (JSON) land in $OUT beside the log.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export RESULTS=${OUT:-bench-results} STEP_TIMEOUT=${STEP_TIMEOUT:-150}
log=${OUT:-/tmp}/gpu_checks.log
bash scripts/gpu_checks.sh python3 "$@" 2>&1 | tee "$log"
