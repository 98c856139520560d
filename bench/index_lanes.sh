#!/bin/bash
# Indexing on a 2-GPU machine in lanes (qrag.index.lanes: a process per lane with its own tokenising
# workers, GPU feeding and file writes; this process commits in order): one GPU against two, alternating
# in one call on one tree. ROUND picks the runs: 5 = the lanes' defaults at 10M tokens, 6 = at 30M,
# 7 and 8 = the new tree against OLD_COMMIT's platform/ in .carry/old (a baseline in the same call);
# unset = one process against 3 x 4 lanes on one and two GPUs. TOKENISE=1 first times tokenising alone.
# Run (repository root, carrying .carry/idx, see bench/index_contention.sh):
#   QRAG_COMMIT=<sha> ROUND=5 OUT=$OUT bash bench/index_lanes.sh
# Results: $OUT/<run>.json (+ err.txt); current: bench/results/index_lanes_round{5,5_repeat,6,6_repeat,7,8}_h100x2/.
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
