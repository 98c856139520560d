#!/bin/bash
# Indexing on two GPUs from ONE process (a model replica per GPU, commit groups round robin, committed in
# order: qrag.index.pipeline.index_groups(replicas=...)): 10M tokens on one GPU against two, alternating,
# then 100M tokens indexed on both and served with shard s on GPU s % 2, the serving path timed.
# Run (2-GPU machine, repository root, carrying .carry/idx, see bench/index_contention.sh):
#   QRAG_COMMIT=<sha> OUT=$OUT bash bench/index_two_gpus.sh
# Results: $OUT/<run>.json (+ err.txt); current: bench/results/index_two_gpus_h100x2/, index_100m_two_gpus_h200x2/.
OUT=${OUT:-/tmp/index_two_gpus}
ARGS="--corpus $PWD/.carry/idx/novels --encoder $PWD/.carry/idx/minilm16 --random-weights --writer process --no-lanes"
source "$(dirname "$0")/index_runs.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run index_10m_1gpu --tokens 10000000 --index-only --devices cuda:0
run index_10m_2gpus --tokens 10000000 --index-only --devices cuda:0,cuda:1
run serve_scale_100m_2gpus --tokens 100000000 --devices cuda:0,cuda:1 --variants optimized --batches 1,8,32,64
