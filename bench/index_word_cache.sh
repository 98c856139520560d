#!/bin/bash
# Indexing 10M tokens on ONE GPU (16 cores): lanes (qrag index --lanes and its defaults: 3 lanes of 4
# tokenising workers at nice 5, groups of 4,096 chunks) against one process, alternating in one call on
# one tree. ROUND picks the runs: 12 = the defaults against one process, 13 = the defaults twice and at
# 30M tokens, 14 = the defaults against OLD_COMMIT's platform/ in .carry/old; 4-11 = the variants the
# defaults were chosen from (the case below; their results are in git history); unset = tokenising alone,
# then lanes 2 x 6, 2 x 7, 3 x 4 and 4 x 3 against one process.
# Run (repository root, carrying .carry/idx, see bench/index_contention.sh):
#   QRAG_COMMIT=<sha> ROUND=13 OUT=$OUT bash bench/index_word_cache.sh
# Results: $OUT/<run>.json (+ err.txt); current: bench/results/index_one_gpu_round{12,13}_h100/.
OUT=${OUT:-/tmp/index_word_cache}
ARGS="--corpus $PWD/.carry/idx/novels --encoder $PWD/.carry/idx/minilm16 --random-weights --tokens ${TOKENS:-10000000} --index-only --no-lanes"
source "$(dirname "$0")/index_runs.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nproc
lscpu | grep -E "^(Thread|Core|Socket|Model name|CPU max MHz)" || true
# Later rounds: NAME:OPTIONS (commas for spaces), each run on cuda:0; the results folders name the round.
L=--lanes,--lanes-per-device,3,--lane-workers,4
case "${ROUND:-3}" in
  4) RUNS="lanes_3x4:$L cache: lanes_3x4_b:$L lanes_2x6:--lanes,--lanes-per-device,2,--lane-workers,6 lanes_3x4_c:$L" ;;
  5) RUNS="lanes_3x4:$L cache: lanes_3x4_b:$L lanes_3x4_c:$L" ;;
  # smaller commit groups: 10 groups of ~1M tokens gave 3 lanes 4/3/3 and a slow first group each
  6) RUNS="lanes_3x4_cc4096:$L,--commit-chunks,4096 lanes_3x4_cc2048:$L,--commit-chunks,2048 cache_cc4096:--commit-chunks,4096
           lanes_3x4_cc4096_b:$L,--commit-chunks,4096 lanes_3x4:$L lanes_3x4_cc2048_b:$L,--commit-chunks,2048" ;;
  7) RUNS="lanes_3x4:$L lanes_3x4_cc4096:$L,--commit-chunks,4096 cache: lanes_3x4_b:$L lanes_3x4_cc4096_b:$L,--commit-chunks,4096
           lanes_3x4_c:$L lanes_3x4_cc4096_c:$L,--commit-chunks,4096" ;;
  # slices of 2,048 chunks instead of 8,192: a lane's first slice needs a quarter of the tokenising
  8) RUNS="lanes_3x4_cc4096_cb2048:$L,--commit-chunks,4096,--chunk-batch,2048 lanes_3x4_cc4096_cb2048_b:$L,--commit-chunks,4096,--chunk-batch,2048" ;;
  # workers and lanes around 3 x 4 with groups of 4,096 chunks (the best of rounds 7 and 8)
  9) C4=--commit-chunks,4096
     RUNS="lanes_3x4_cc4096:$L,$C4 lanes_3x5_cc4096:--lanes,--lanes-per-device,3,--lane-workers,5,$C4
           lanes_3x4_cc4096_nice5:$L,$C4,--worker-nice,5 lanes_4x3_cc4096:--lanes,--lanes-per-device,4,--lane-workers,3,$C4
           lanes_2x6_cc4096:--lanes,--lanes-per-device,2,--lane-workers,6,$C4 lanes_3x4_cc4096_b:$L,$C4" ;;
  # lanes that capture their chunk shapes while they start (round 9's first run, on a fresh
  # machine, was 0.35 against 0.50 after it), with and without the workers below the lanes
  10) C4=--commit-chunks,4096
      RUNS="lanes_3x4_cc4096:$L,$C4 lanes_3x4_cc4096_nice5:$L,$C4,--worker-nice,5 lanes_3x4_cc4096_b:$L,$C4
            lanes_3x4_cc4096_nice5_b:$L,$C4,--worker-nice,5 lanes_2x6_cc4096_nice5:--lanes,--lanes-per-device,2,--lane-workers,6,$C4,--worker-nice,5
            lanes_3x4_cc4096_nice5_c:$L,$C4,--worker-nice,5" ;;
  # the lanes' defaults (qrag.index.lanes: groups of 4,096 chunks, slices of 8,192, workers at nice 5)
  11) RUNS="lanes:--lanes,--lane-workers,4 cache: lanes_b:--lanes,--lane-workers,4 lanes_c:--lanes,--lane-workers,4" ;;
  # the final warm-up (every other chunk shape run once at lane start) on a fresh 16-core machine
  12) RUNS="lanes:--lanes cache: lanes_b:--lanes" ;;
  # each lane's ramp and tail (when it began, its first block, first slice, last slice back)
  13) RUNS="lanes:--lanes lanes_b:--lanes lanes_30m:--lanes,--tokens,30000000" ;;
  # each lane's first group a quarter of the others, against OLD_COMMIT's tree in .carry/old
  14) run new --lanes --devices cuda:0; old old --lanes --devices cuda:0
      run new_b --lanes --devices cuda:0; old old_b --lanes --devices cuda:0
      exit 0 ;;
  *) RUNS="" ;;
esac
if [ -n "$RUNS" ]; then
  for spec in $RUNS; do
    opts=${spec#*:}
    run "${spec%%:*}" --devices cuda:0 ${opts//,/ }
  done
  exit 0
fi
python bench/index_stages.py --corpus "$C/novels" --encoder "$C/minilm16" --tokens 2000000 --doc-tokens 32768 \
  --prep-workers 1 --out "$OUT/tokenise_one_worker.json" 2>>"$OUT/err.txt" | python3 -c "import json,sys;d=json.loads(sys.stdin.read().strip().splitlines()[-1]);print('tokenising', {k:v['tokens_per_s'] for k,v in d['stages'].items()})"
python bench/index_stages.py --corpus "$C/novels" --encoder "$C/minilm16" --tokens ${TOKENS:-10000000} --doc-tokens 32768 \
  --prep-workers ${PREP_WORKERS:-4,8,12} --out "$OUT/tokenise_workers.json" 2>>"$OUT/err.txt" | python3 -c "import json,sys;d=json.loads(sys.stdin.read().strip().splitlines()[-1]);print('tokenising', {k:v['tokens_per_s'] for k,v in d['stages'].items()})"
run lanes_2x6 --lanes --lanes-per-device 2 --lane-workers 6 --devices cuda:0
run lanes_2x7 --lanes --lanes-per-device 2 --lane-workers 7 --devices cuda:0
run lanes_3x4 --lanes --lanes-per-device 3 --lane-workers 4 --devices cuda:0
run lanes_4x3 --lanes --lanes-per-device 4 --lane-workers 3 --devices cuda:0
run cache --devices cuda:0
run lanes_2x6_b --lanes --lanes-per-device 2 --lane-workers 6 --devices cuda:0
