#!/bin/bash
# GPT-3 175B with dtgpt: the arguments of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh.
# Run it once on every node (16 nodes x 8 GPUs by default):
#
#   NUM_NODES=16 NODE_RANK=<0..15> MASTER_ADDR=<node 0> \
#     bash scripts/train_gpt3_175b_distributed.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH \
#          VOCAB_FILE MERGE_FILE DATA_PATH [--section.key=value ...]
#
# DATA_PATH is a prefix (or Megatron's "w1 prefix1 w2 prefix2" blend). Extra arguments are config
# overrides for configs/gpt3_175b.toml. The layout is planned first (scripts/plan.py --check): a
# layout that cannot run, or that does not fit in GPU_MEMORY_GIB, is not launched.
#
# Environment: GPUS_PER_NODE (8), NUM_NODES (16), NODE_RANK (0), MASTER_ADDR (localhost),
# MASTER_PORT (6000), GPU_MEMORY_GIB (80), CONFIG (configs/gpt3_175b.toml), PYTHON (python),
# TORCHRUN (torchrun), DTGPT_DRY_RUN=1 (print the torchrun command instead of running it).
set -euo pipefail

if [ "$#" -lt 5 ]; then
    echo "usage: $0 CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH [--section.key=value ...]" >&2
    exit 2
fi
CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
VOCAB_FILE=$3
MERGE_FILE=$4
DATA_PATH=$5
shift 5

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-16}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
GPU_MEMORY_GIB=${GPU_MEMORY_GIB:-80}
WORLD_SIZE=$((GPUS_PER_NODE * NUM_NODES))

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONFIG=${CONFIG:-$REPO/configs/gpt3_175b.toml}
PYTHON=${PYTHON:-python}
TORCHRUN=${TORCHRUN:-torchrun}

OVERRIDES=(
    --checkpoint.save="$CHECKPOINT_PATH"
    --checkpoint.load="$CHECKPOINT_PATH"
    --logging.tensorboard_dir="$TENSORBOARD_LOGS_PATH"
    --data.vocab_file="$VOCAB_FILE"
    --data.merge_file="$MERGE_FILE"
    --data.data_path="$DATA_PATH"
    "$@"
)

# Plan before taking 128 GPUs: exit 2 = impossible layout, 1 = a rank does not fit.
status=0
"$PYTHON" "$REPO/scripts/plan.py" --config "$CONFIG" --world-size "$WORLD_SIZE" \
    --gpu-memory-gib "$GPU_MEMORY_GIB" --check "${OVERRIDES[@]}" || status=$?
if [ "$status" -ne 0 ]; then
    echo "refusing to launch: the planner rejected this layout on $WORLD_SIZE GPUs (exit $status)" >&2
    exit "$status"
fi

LAUNCH=(
    "$TORCHRUN"
    --nproc-per-node "$GPUS_PER_NODE"
    --nnodes "$NUM_NODES"
    --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
    "$REPO/train.py" --config "$CONFIG" "${OVERRIDES[@]}"
)
if [ "${DTGPT_DRY_RUN:-0}" = "1" ]; then
    printf '%q ' "${LAUNCH[@]}"
    echo
    exit 0
fi
exec "${LAUNCH[@]}"
