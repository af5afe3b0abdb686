#!/usr/bin/env bash
# Pretrain GPT under SLURM: one torchrun per node (srun), the first node of the allocation hosts the rendezvous.
#
#   sbatch examples/pretrain_gpt_slurm.sh                              # uses the #SBATCH lines below
#   sbatch --nodes 4 examples/pretrain_gpt_slurm.sh --sequence-parallel
#   TP=8 PP=4 MODEL_CONFIG=gpt-13b sbatch --nodes 16 examples/pretrain_gpt_slurm.sh
#
# One task per node (a torchrun that starts one process per GPU); --gpus-per-node asks SLURM for the GPUs.
# GPUS_PER_NODE defaults to the GPUs SLURM gave this node (else 1).  Other settings: examples/gpt_common.sh.
#SBATCH --job-name=zb-megatron-gpt
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=01:00:00
#SBATCH --output=zb-megatron-%j.log
set -euo pipefail
# sbatch runs a copy of this script from a spool directory: find the repository from the submit directory.
SCRIPT_DIR="${SLURM_SUBMIT_DIR:-$(dirname "${BASH_SOURCE[0]}")}"
[[ -f "$SCRIPT_DIR/examples/gpt_common.sh" ]] && SCRIPT_DIR="$SCRIPT_DIR/examples"
source "$SCRIPT_DIR/gpt_common.sh"
cd "$REPO_ROOT"

: "${SLURM_JOB_ID:?run this through sbatch (or salloc + this script)}"
MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}"
MASTER_PORT="${MASTER_PORT:-29500}"
NNODES="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
    GPUS_PER_NODE="${SLURM_GPUS_ON_NODE:-$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 1)")}"
fi
echo "[slurm] job $SLURM_JOB_ID: $NNODES nodes x $GPUS_PER_NODE processes, rendezvous $MASTER_ADDR:$MASTER_PORT"

# One launcher per node; SLURM_NODEID is evaluated on each node (hence the single quotes around it).
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c '
    exec "$0" -m torch.distributed.run \
        --nnodes "$1" --node-rank "$SLURM_NODEID" --nproc-per-node "$2" \
        --rdzv-backend c10d --rdzv-endpoint "$3" --rdzv-id "$4" \
        "${@:5}"
' "$PYTHON" "$NNODES" "$GPUS_PER_NODE" "$MASTER_ADDR:$MASTER_PORT" "$SLURM_JOB_ID" \
    pretrain_gpt.py "${GPT_ARGS[@]}" --global-batch-size "$(global_batch_size $(( NNODES * GPUS_PER_NODE )))" \
    "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}" "$@"
