# Shared settings for the example launch scripts (sourced, not run).  Every value can be overridden from the
# environment, and extra Megatron flags can be appended on the command line of the calling script.
#
#   MODEL_CONFIG   named size (gpt-tiny ... gpt-13b) or a YAML file        default: gpt-tiny
#   TP, PP         --tensor-model-parallel-size / --pipeline-model-parallel-size      default: 1 / 1
#   MBS            --micro-batch-size                                      default: 2
#   GBS            --global-batch-size      default: MBS x data-parallel size x MICROBATCHES (global_batch_size)
#   MICROBATCHES   microbatches per data-parallel replica per iteration    default: 2 x PP, at least 4
#   SEQ_LENGTH     --seq-length                                            default: 128
#   TRAIN_ITERS    --train-iters                                           default: 50
#   DATA_PATH      a preprocessed corpus prefix (tools/preprocess_data.py); unset: --mock-data
#   TOKENIZER_TYPE, VOCAB_FILE, MERGE_FILE, TOKENIZER_MODEL   tokenizer flags when DATA_PATH is set
#   SAVE, LOAD     checkpoint directories (optional)
#   PYTHON         the interpreter with the project installed          default: .venv/bin/python, else python3
#
# The world size is tp x pp x dp: the launcher's process count must be a multiple of TP * PP.

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

GPT_ARGS=(
    --model-config "${MODEL_CONFIG:-gpt-tiny}"
    --seq-length "${SEQ_LENGTH:-128}"
    --max-position-embeddings "${MAX_POSITION_EMBEDDINGS:-${SEQ_LENGTH:-128}}"
    --tensor-model-parallel-size "${TP:-1}"
    --pipeline-model-parallel-size "${PP:-1}"
    --micro-batch-size "${MBS:-2}"
    --train-iters "${TRAIN_ITERS:-50}"
    --lr "${LR:-1e-3}"
    --min-lr "${MIN_LR:-1e-4}"
    --lr-decay-style cosine
    --lr-warmup-iters "${WARMUP_ITERS:-5}"
    --weight-decay 0.1
    --clip-grad 1.0
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.02
    --seed "${SEED:-1234}"
    --log-interval "${LOG_INTERVAL:-5}"
    --eval-interval "${EVAL_INTERVAL:-25}"
    --eval-iters "${EVAL_ITERS:-2}"
    --distributed-timeout-minutes "${TIMEOUT_MINUTES:-10}"
)

if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split "${SPLIT:-949,50,1}" --tokenizer-type "${TOKENIZER_TYPE:-GPT2BPETokenizer}")
    [[ -n "${VOCAB_FILE:-}" ]] && DATA_ARGS+=(--vocab-file "$VOCAB_FILE")
    [[ -n "${MERGE_FILE:-}" ]] && DATA_ARGS+=(--merge-file "$MERGE_FILE")
    [[ -n "${TOKENIZER_MODEL:-}" ]] && DATA_ARGS+=(--tokenizer-model "$TOKENIZER_MODEL")
else
    DATA_ARGS=(--mock-data)
fi

# The global batch for WORLD ranks ($1): GBS if set, else one that divides on this layout -- MBS x dp x
# MICROBATCHES, with 2 x PP microbatches per replica (at least 4) so zero-bubble plans have m >= 2p.
global_batch_size() {
    local dp=$(( $1 / (${TP:-1} * ${PP:-1}) ))
    (( dp >= 1 )) || dp=1
    local pp=${PP:-1}
    local m=${MICROBATCHES:-$(( 2 * pp > 4 ? 2 * pp : 4 ))}
    echo "${GBS:-$(( ${MBS:-2} * dp * m ))}"
}

CKPT_ARGS=()
[[ -n "${SAVE:-}" ]] && CKPT_ARGS+=(--save "$SAVE" --save-interval "${SAVE_INTERVAL:-1000}")
[[ -n "${LOAD:-}" ]] && CKPT_ARGS+=(--load "$LOAD")
true
