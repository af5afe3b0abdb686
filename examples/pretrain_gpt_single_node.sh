#!/usr/bin/env bash
# Pretrain GPT on one machine: NPROC processes through torchrun --standalone (a free rendezvous port is picked).
#
#   examples/pretrain_gpt_single_node.sh                       # 4 CPU ranks: tp 2 x dp 2, tiny model, mock data
#   NPROC=8 TP=2 PP=2 MODEL_CONFIG=gpt-125m examples/pretrain_gpt_single_node.sh --sequence-parallel
#
# Defaults: NPROC = number of GPUs if any, else 4; TP = 2.  Other settings: see examples/gpt_common.sh.
# Extra arguments are passed to pretrain_gpt.py (later flags override earlier ones).
set -euo pipefail
TP="${TP:-2}"
source "$(dirname "${BASH_SOURCE[0]}")/gpt_common.sh"
cd "$REPO_ROOT"

if [[ -z "${NPROC:-}" ]]; then
    NPROC=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 4)")
fi

exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    pretrain_gpt.py "${GPT_ARGS[@]}" --global-batch-size "$(global_batch_size "$NPROC")" \
    "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "$@"
