#!/bin/bash
# Indexing 10M tokens on ONE GPU with 16 cores (issue 14, item 2: end to end >= 50 % of the bare
# forward), one call, one tree, alternating: tokenising workers with the word cache
# (qrag.data.word_cache: ASCII words' WordPiece ids looked up, the same ids; 0.40-0.45M -> 1.23-1.29M
# tokens/s per process on a 2-core VM) against every sentence through the Rust tokenizer (the rounds
# before), one process (the bench default) and lanes (qrag.index.lanes) feeding the GPU.
# The previous round (index_lanes_one_gpu_h100/) found the 16 cores' tokenising the bound. Round 1
# (index_word_cache_h100/, d26cf8f) compared the cache with the Rust tokenizer (no gain for one process:
# its writer hand-over is the bound then) and ran 2 x 6 lanes once (0.45); this round repeats the lanes
# and tries 3 x 4 and 2 x 5 against one process. Round 3 (this file now): the host's cores (lscpu), one
# tokenising process's rate on this host (2M tokens), lanes 2 x 6 twice, 2 x 7, 3 x 4 and 4 x 3
# (index_word_cache_round3_h100/, 64e2350: 3 x 4 best, 0.49). Round 4 (ROUND=4): lanes that start
# faster (workers forked with the lane's imports) and a cheaper gathering process; 3 x 4 three times
# against one process and 2 x 6, no tokenising stage (index_one_gpu_round4_h100/: groups were sent
# from the start and the rate timed from the first lane ready, so a lane ready early indexed alone
# for 1-3 s inside the window: 0.31-0.35). Round 5 (ROUND=5): the window from every lane ready again.
# Round 6 (ROUND=6): commit groups of 4,096 and 2,048 chunks instead of 16,384 (10M tokens were 10
# groups: 4/3/3 over three lanes, each lane's first group tokenised whole before its GPU work).
# Round 7 (ROUND=7): streamed groups and a feeder that never pauses between groups
# (qrag.index.pipeline._Feeder): 3 x 4 with groups of 16,384 and 4,096 chunks, one process
# (index_one_gpu_round7_h100/, db21b0d). Round 8 (ROUND=8): slices of 2,048 chunks (worse: 0.47-0.48).
# Round 9 (ROUND=9): lanes x workers around 3 x 4, groups of 4,096 chunks (index_one_gpu_round9_h100/,
# 9b42910). Round 10 (ROUND=10): lanes capture their main chunk shape at start; workers at nice 5
# (e41e5c0 captured every shape: out of memory, and the process hung at exit: err_oom_every_shape.txt).
# Round 11 (ROUND=11): the lanes' defaults chosen from rounds 7-10, against one process.
# Round 12 (ROUND=12): the defaults with the final warm-up and the faster tokenising worker (8e3e9e1),
# the first run on a fresh machine, against one process. Round 13 (ROUND=13): the lanes' ramp and tail.
# Round 14 (ROUND=14, OLD_COMMIT=<sha> with that commit's platform/ in .carry/old): each lane's first
# group a quarter of the others, against the old tree in the same call.
# Carry .carry/idx (see bench/index_contention.sh). On the GPU machine, from the repository root:
#   QRAG_COMMIT=<sha> OUT=$OUT bash bench/index_word_cache.sh
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
