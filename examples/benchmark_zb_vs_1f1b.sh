#!/usr/bin/env bash
# Zero-bubble schedules against 1F1B on the GPUs of one node (or several): same GPT blocks, same memory budget,
# every schedule; tokens/s with a bootstrap 95% interval of the ratio to 1F1B, the simulator's prediction from the
# profiled costs, and the peak activation memory per rank (measured and predicted).
#
#   examples/benchmark_zb_vs_1f1b.sh                 # all GPUs of this node: pp = number of GPUs
#   NPROC=4 RUNS=20 examples/benchmark_zb_vs_1f1b.sh --microbatches 8 16
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 examples/benchmark_zb_vs_1f1b.sh   # on each node
#
#   NPROC        processes (GPUs) per node                  default: all visible GPUs, else 2 CPU ranks
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT            multi-node rendezvous (torchrun's static mode)
#   RUNS         alternated timed runs per schedule         default: 10
#   OUT          result directory                           default: bench/results
#   QUICK=1      the small model and 3 runs (a smoke test; what the repository's tests run on CPU)
# Extra arguments go to tools/bench_pipeline.py (e.g. --microbatches 8 16). Results: $OUT/pipeline_torchrun.{md,json}.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

if [[ -z "${NPROC:-}" ]]; then
    NPROC="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 2)')"
fi
if (( NPROC < 2 )); then
    echo "benchmark_zb_vs_1f1b.sh: needs at least 2 processes for a pipeline (NPROC=$NPROC)" >&2
    exit 2
fi

ARGS=(--launcher torchrun --out "${OUT:-$REPO_ROOT/bench/results}" --runs "${RUNS:-10}")
if [[ "${QUICK:-0}" == "1" ]]; then ARGS+=(--quick --runs "${RUNS:-3}"); fi

cd "$REPO_ROOT"
exec "$PYTHON" -m torch.distributed.run \
    --nproc-per-node "$NPROC" \
    --nnodes "${NNODES:-1}" \
    --node-rank "${NODE_RANK:-0}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" \
    --master-port "${MASTER_PORT:-29512}" \
    tools/bench_pipeline.py "${ARGS[@]}" "$@"
