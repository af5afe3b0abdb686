#!/usr/bin/env bash
# Pretrain GPT on several machines through torchrun's c10d rendezvous.  Run this same command on every node:
#
#   MASTER_ADDR=node0.example NNODES=2 NODE_RANK=0 examples/pretrain_gpt_multi_node.sh   # on node 0
#   MASTER_ADDR=node0.example NNODES=2 NODE_RANK=1 examples/pretrain_gpt_multi_node.sh   # on node 1
#
#   MASTER_ADDR     host of the rendezvous (any one node, reachable from all)      required
#   MASTER_PORT     rendezvous port                                               default: 29500
#   NNODES          number of nodes                                               required
#   NODE_RANK       this node's index, 0..NNODES-1                                default: 0
#   NPROC_PER_NODE  processes per node                                            default: GPUs on this node, else 1
#   RDZV_ID         a job id shared by all nodes                                  default: zb-megatron
#
# Ranks are numbered node by node, and tensor parallelism varies fastest (tp-dp-pp order), so with TP up to the
# GPUs per node a tensor-parallel group never leaves a node.  Other settings: examples/gpt_common.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpt_common.sh"
cd "$REPO_ROOT"

: "${MASTER_ADDR:?set MASTER_ADDR to the rendezvous host (one of the nodes)}"
: "${NNODES:?set NNODES to the number of nodes}"
MASTER_PORT="${MASTER_PORT:-29500}"
NODE_RANK="${NODE_RANK:-0}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 1)")
fi

exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-zb-megatron}" \
    pretrain_gpt.py "${GPT_ARGS[@]}" --global-batch-size "$(global_batch_size $(( NNODES * NPROC_PER_NODE )))" \
    "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "$@"
