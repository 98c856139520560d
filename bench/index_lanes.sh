#!/bin/bash
# Indexing 10M tokens on a 2-GPU machine (issue 14, item 2: close to linear in GPUs), one call, one
# tree: the one-process pipeline on one GPU (the bench default: 16 tokenising workers, writer
# process) against lanes (qrag.index.lanes: a process per GPU with its own 12 tokenising workers,
# GPU feeding and file writes; this process commits in order) on one GPU and on two, alternating.
# Carry .carry/idx (see bench/index_contention.sh). On the GPU machine, from the repository root:
#   QRAG_COMMIT=<sha> OUT=$OUT bash bench/index_lanes.sh
OUT=${OUT:-/tmp/index_lanes}
ARGS="--corpus $PWD/.carry/idx/novels --encoder $PWD/.carry/idx/minilm16 --random-weights --tokens ${TOKENS:-10000000} --index-only"
source "$(dirname "$0")/index_runs.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run one_process_1gpu --devices cuda:0
run lanes_1gpu --lanes --lane-workers 12 --devices cuda:0
run lanes_2gpus --lanes --lane-workers 12 --devices cuda:0,cuda:1
run one_process_1gpu_b --devices cuda:0
run lanes_2gpus_b --lanes --lane-workers 12 --devices cuda:0,cuda:1
run lanes_1gpu_b --lanes --lane-workers 12 --devices cuda:0
