#!/bin/bash
# Indexing 10M tokens on ONE GPU (issue 14, item 2: end to end >= 50 % of the bare forward), one
# call, one tree: the one-process pipeline (the bench default) against lanes (qrag.index.lanes)
# feeding the same GPU from 1, 2 or 3 processes, each with its own GIL, tokenising workers and
# file writes, 12 tokenising workers in all on 16 cores (the one-process default), alternating.
# On 2 H200s one process was bound by its own GIL (2.15-2.27M tokens/s, while its 16 workers
# alone tokenise 4.0M: bench/results/index_lanes_round2_h200x2/).
# Carry .carry/idx (see bench/index_contention.sh). On the GPU machine, from the repository root:
#   QRAG_COMMIT=<sha> OUT=$OUT bash bench/index_lanes_one_gpu.sh
OUT=${OUT:-/tmp/index_lanes_one_gpu}
ARGS="--corpus $PWD/.carry/idx/novels --encoder $PWD/.carry/idx/minilm16 --random-weights --tokens ${TOKENS:-10000000} --index-only --no-lanes"
source "$(dirname "$0")/index_runs.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nproc
run one_process --devices cuda:0
run lanes_2x6 --lanes --lanes-per-device 2 --lane-workers 6 --devices cuda:0
run lanes_3x4 --lanes --lanes-per-device 3 --lane-workers 4 --devices cuda:0
run one_process_b --devices cuda:0
run lanes_2x6_b --lanes --lanes-per-device 2 --lane-workers 6 --devices cuda:0
run lanes_1x12 --lanes --lane-workers 12 --devices cuda:0
