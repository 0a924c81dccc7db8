#!/bin/bash
# Runs the "175B" parameter model: Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh,
# with dtgpt's train.py in place of pretrain_gpt.py and the same argument arrays. train.py reads
# Megatron's flags itself (docs/megatron_flags.md: the dtgpt key each one sets). Run it once on
# every node (16 nodes x 8 GPUs: tp 8 x pp 16):
#
#   NUM_NODES=16 NODE_RANK=<0..15> MASTER_ADDR=<node 0> \
#     bash scripts/train_gpt3_175b_distributed.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH \
#          VOCAB_FILE MERGE_FILE DATA_PATH [more flags ...]
#
# DATA_PATH is a prefix, or Megatron's blend "0.3 prefix1 0.7 prefix2". More flags (Megatron's or
# --section.key=value) follow the arrays; one that gives an array's flag another value is refused.
# Before taking the GPUs the layout is planned (scripts/plan.py --check): a layout that cannot
# run, or that does not fit in GPU_MEMORY_GIB, is not launched.
#
# Environment: GPUS_PER_NODE (8), NUM_NODES (16), NODE_RANK (0), MASTER_ADDR (localhost),
# MASTER_PORT (6000), GPU_MEMORY_GIB (80), PYTHON (python), TORCHRUN (torchrun),
# DTGPT_DRY_RUN=1 (print the torchrun command instead of running it).
set -euo pipefail

export CUDA_DEVICE_MAX_CONNECTIONS=1

if [ "$#" -lt 5 ]; then
    echo "usage: $0 CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH [more flags ...]" >&2
    exit 2
fi

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NUM_NODES=${NUM_NODES:-16}
NODE_RANK=${NODE_RANK:-0}
WORLD_SIZE=$((GPUS_PER_NODE * NUM_NODES))
GPU_MEMORY_GIB=${GPU_MEMORY_GIB:-80}

CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
VOCAB_FILE=$3   # gpt2-vocab.json
MERGE_FILE=$4   # gpt2-merges.txt
DATA_PATH=$5    # <path and file prefix>_text_document, or a "weight prefix ..." blend
shift 5
read -r -a DATA_PATHS <<< "$DATA_PATH"  # a blend is several words, as Megatron's unquoted $DATA_PATH

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
TORCHRUN=${TORCHRUN:-torchrun}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NUM_NODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

GPT_MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
    --attention-backend auto  # a Megatron kernel choice: dtgpt notes it and uses PyTorch's SDPA
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1536
    # Megatron's current example ramps the batch in token steps instead:
    #   --step-batch-size-schedule "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"
    # (training.step_batch_size_schedule); the linear ramp-up below is its earlier form.
    --rampup-batch-size 16 16 5859375
    --train-iters 500000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --lr 6.0e-5
    --lr-decay-style cosine
    --min-lr 6.0e-6
    --lr-warmup-fraction .001
    --lr-decay-iters 430000
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 16
    # Not in Megatron's example (configs/gpt3_175b.toml sets it too): sequence parallelism shards
    # the norm and dropout activations over tp at no extra communication volume.
    --sequence-parallel
)

DATA_ARGS=(
    --data-path "${DATA_PATHS[@]}"
    --vocab-file "$VOCAB_FILE"
    --merge-file "$MERGE_FILE"
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 100
    --save-interval 10000
    --eval-interval 1000
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --eval-iters 10
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

TRAIN_ARGS=(
    "${GPT_MODEL_ARGS[@]}"
    "${TRAINING_ARGS[@]}"
    "${MODEL_PARALLEL_ARGS[@]}"
    "${DATA_ARGS[@]}"
    "${EVAL_AND_LOGGING_ARGS[@]}"
    "$@"
)

# The vocabulary: no --make-vocab-size-divisible-by here, so Megatron's default 128 x tp 8 = 1024
# pads GPT-2's 50,257 tokens to 51,200 rows, as Megatron and configs/gpt3_175b.toml do.

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "error: $PYTHON cannot import torch: activate the project's environment (make setup creates .venv; then PYTHON=.venv/bin/python TORCHRUN=.venv/bin/torchrun)" >&2
    exit 2
fi

# Plan before taking 128 GPUs: exit 2 = impossible layout, 1 = a rank does not fit.
status=0
"$PYTHON" "$REPO/scripts/plan.py" --world-size "$WORLD_SIZE" --gpu-memory-gib "$GPU_MEMORY_GIB" \
    --check "${TRAIN_ARGS[@]}" || status=$?
if [ "$status" -ne 0 ]; then
    echo "refusing to launch: the planner rejected this layout on $WORLD_SIZE GPUs (exit $status)" >&2
    exit "$status"
fi

LAUNCH=("$TORCHRUN" "${DISTRIBUTED_ARGS[@]}" "$REPO/train.py" "${TRAIN_ARGS[@]}")
if [ "${DTGPT_DRY_RUN:-0}" = "1" ]; then
    printf '%q ' "${LAUNCH[@]}"
    echo
    exit 0
fi
exec "${LAUNCH[@]}"
