#!/usr/bin/env bash
# The GPU checks, one step or all, with the python given (the .venv's here,
# a CUDA machine's own python3 there: see scripts/device_run.sh):
#
#   scripts/gpu_checks.sh PYTHON [versions|tests|gemm|profile|worker|transfer|pd|offload|all] ...
#
# Each step runs even when an earlier one failed (a device lease is short),
# within STEP_TIMEOUT seconds when that is set; the exit status says whether
# any failed. Figures (JSON) land in RESULTS (default bench-results/).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${1:?usage: $0 PYTHON [versions|tests|gemm|profile|worker|transfer|pd|offload|all] ...}
shift
steps=("${@:-all}")
[[ ${steps[0]} == all ]] && steps=(versions tests gemm worker profile pd transfer offload)
results=${RESULTS:-bench-results}
mkdir -p "$results"
limit=(); [[ -n ${STEP_TIMEOUT:-} ]] && limit=(timeout "$STEP_TIMEOUT")
failed=()
for step in "${steps[@]}"; do
    echo "=== $step"
    case $step in
        versions) "$python" -c 'import inspect, sys, torch
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
from torch.nn.attention.varlen import varlen_attn
print("varlen_attn", inspect.signature(varlen_attn))
import triton; print("triton", triton.__version__)' ;;
        tests) "${limit[@]}" "$python" -m pytest -q -rs -m gpu tests/gpu_worker ;;
        # fixed_gemm (whole invariant steps' matmul) against cuBLAS.
        gemm) "${limit[@]}" "$python" -m bench.fixed_gemm_bench --json "$results/gpu-gemm.json" ;;
        # The batched step (invariant whole with and without CUDA graphs, plain)
        # against dense torch on 1,024-token prompts, its kernels and launches
        # per step and where its time goes.
        worker) "${limit[@]}" "$python" -m bench.worker_bench --model llama-1b --device cuda \
                --batches 1,16,64 --modes batched,batched-eager,batched-fast --prompt-len 1024 \
                --repeat 2 \
                --count-ops --top-ops 12 --json "$results/gpu-worker.json" ;;
        transfer) "${limit[@]}" "$python" -m bench.kv_transfer_bench --device cuda \
                --json "$results/gpu-transfer.json" ;;
        # 4096 blocks of 16 tokens per worker: the 32 requests' prompts and
        # outputs fit, so the run measures P/D, not preemption.
        pd) "${limit[@]}" "$python" -m bench.pd_bench --model llama-1b --device cuda \
                --num-blocks 4096 --max-prompt-tokens 1024 --max-tokens 128 \
                --json "$results/gpu-pd.json" ;;
        # kvstash sim's cost profile of this GPU: $results/gpu-profile.json.
        profile) dir=$(mktemp -d) \
                && "$python" -m bench.worker_bench --write-checkpoint "$dir/llama-1b" \
                       --model llama-1b --dtype bfloat16 \
                && "${limit[@]}" "$python" -m kvstash.launch.cli calibrate "$results/gpu-profile.json" \
                       --model "$dir/llama-1b" --device cuda --prefill-chunks 64,256,512,2048,8192 \
                       --name "Llama-3.2-1B shape, bf16, $("$python" -c \
                           'import torch; print(torch.cuda.get_device_name())')"; rc=$? \
                ; rm -rf "$dir"; (exit $rc) ;;
        # Offload + restore against recompute of one request's KV on this GPU,
        # by context length: the offload-vs-recompute table's GPU figures.
        offload) dir=$(mktemp -d) \
                && "$python" -m bench.worker_bench --write-checkpoint "$dir/llama-1b" \
                       --model llama-1b --dtype bfloat16 \
                && "${limit[@]}" "$python" -m bench.offload_vs_recompute --model "$dir/llama-1b" \
                       --device cuda --lengths 256,1024,4096,16384 --repeat 3 \
                       --json "$results/gpu-offload.json"; rc=$? \
                ; rm -rf "$dir"; (exit $rc) ;;
        *) echo "unknown step $step" >&2; false ;;
    esac || failed+=("$step")
done
if (( ${#failed[@]} )); then
    echo "=== failed: ${failed[*]}" >&2
    exit 1
fi
