#!/bin/bash
# Indexing 10M tokens on a 2-GPU machine (issue 14, item 2: close to linear in GPUs), one call, one
# tree: how fast the host tokenises with 8-30 processes (bench/index_stages.py --prep-workers: no
# GPU), then the one-process pipeline on one GPU (the bench default: 16 tokenising workers, writer
# process) against lanes (qrag.index.lanes: a process per GPU with its own tokenising workers, GPU
# feeding and file writes; this process commits in order) on two GPUs with 12 and 16 workers each.
# Round 1 (index_lanes_h200x2/) timed lanes to their processes' exit; now to the last commit. Round 2
# (index_lanes_round2_h200x2/, cf7e534) ran before the word cache with one lane per GPU (12 and 16
# workers). Round 3 (index_lanes_round3_h200x2/, 37d279a): the word cache, one GPU against two, three
# lanes of 4 workers per GPU (the best on one H100), 2 x 7; its lanes were timed from the first lane
# ready with groups sent from the start (1-4 s of some lanes indexing while others started, inside the
# window). Round 4 (ROUND=4): timed from every lane ready again, no 2 x 7. Rounds 5 and 6: streamed groups
# at 10M and 30M tokens. Round 7 (ROUND=7, OLD_COMMIT=<sha> with that commit's platform/ in .carry/old):
# lanes that report a group's count once it is tokenised and take groups when they have room, against
# the old tree in the same call. Round 8 (ROUND=8): each lane's first group a quarter of the others.
# TOKENISE=1: the tokenising stage.
# Carry .carry/idx (see bench/index_contention.sh). On the GPU machine, from the repository root:
#   QRAG_COMMIT=<sha> OUT=$OUT bash bench/index_lanes.sh
OUT=${OUT:-/tmp/index_lanes}
ARGS="--corpus $PWD/.carry/idx/novels --encoder $PWD/.carry/idx/minilm16 --random-weights --tokens ${TOKENS:-10000000} --index-only --no-lanes"
source "$(dirname "$0")/index_runs.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
lscpu | grep -E "^(Thread|Core|Socket|Model name)" || true
if [ "${TOKENISE:-0}" = 1 ]; then
python bench/index_stages.py --corpus "$C/novels" --encoder "$C/minilm16" --tokens ${TOKENS:-10000000} --doc-tokens 32768 \
  --prep-workers ${PREP_WORKERS:-8,12,24} --out "$OUT/tokenise_workers.json" 2>>"$OUT/err.txt" | python3 -c "import json,sys;d=json.loads(sys.stdin.read().strip().splitlines()[-1]);print('tokenising', {k:v['tokens_per_s'] for k,v in d['stages'].items()})"
fi
if [ "${ROUND:-3}" = 8 ]; then  # each lane's first group a quarter of the others: against OLD_COMMIT's tree in .carry/old
  run new_2gpus --lanes --devices cuda:0,cuda:1
  old old_2gpus --lanes --devices cuda:0,cuda:1
  run new_1gpu --lanes --devices cuda:0
  old old_1gpu --lanes --devices cuda:0
  run new_2gpus_b --lanes --devices cuda:0,cuda:1
  run new_1gpu_b --lanes --devices cuda:0
  exit 0
fi
if [ "${ROUND:-3}" = 7 ]; then  # counts sent once tokenised, groups to the lane with room: against OLD_COMMIT's tree in .carry/old
  run new_2gpus --lanes --devices cuda:0,cuda:1
  old old_2gpus --lanes --devices cuda:0,cuda:1
  run new_1gpu --lanes --devices cuda:0
  old old_1gpu --lanes --devices cuda:0
  TOKENS=30000000; ARGS=${ARGS/--tokens 10000000/--tokens 30000000}
  run new_2gpus_30m --lanes --devices cuda:0,cuda:1
  run new_1gpu_30m --lanes --devices cuda:0
  old old_2gpus_30m --lanes --devices cuda:0,cuda:1
  exit 0
fi
if [ "${ROUND:-3}" = 6 ]; then  # round 5's defaults on 30M tokens: 10M were under 2 s on two GPUs
  run lanes_1gpu_3x4_30m --lanes --lane-workers 4 --devices cuda:0
  run lanes_2gpus_3x4_30m --lanes --lane-workers 4 --devices cuda:0,cuda:1
  exit 0
fi
if [ "${ROUND:-3}" = 5 ]; then  # streamed groups, the lanes' new defaults (groups of 4,096 chunks, workers at nice 5)
  run lanes_1gpu_3x4 --lanes --lane-workers 4 --devices cuda:0
  run lanes_2gpus_3x4 --lanes --lane-workers 4 --devices cuda:0,cuda:1
  run lanes_2gpus_2x6 --lanes --lanes-per-device 2 --lane-workers 6 --devices cuda:0,cuda:1
  run lanes_1gpu_3x4_b --lanes --lane-workers 4 --devices cuda:0
  run lanes_2gpus_3x4_b --lanes --lane-workers 4 --devices cuda:0,cuda:1
  exit 0
fi
run one_process_1gpu --devices cuda:0
run lanes_1gpu_3x4 --lanes --lanes-per-device 3 --lane-workers 4 --devices cuda:0
run lanes_2gpus_3x4 --lanes --lanes-per-device 3 --lane-workers 4 --devices cuda:0,cuda:1
if [ "${ROUND:-3}" = 3 ]; then run lanes_2gpus_2x7 --lanes --lanes-per-device 2 --lane-workers 7 --devices cuda:0,cuda:1; fi
run lanes_1gpu_3x4_b --lanes --lanes-per-device 3 --lane-workers 4 --devices cuda:0
run lanes_2gpus_3x4_b --lanes --lanes-per-device 3 --lane-workers 4 --devices cuda:0,cuda:1
