#!/bin/bash
# Indexing on two GPUs (issue 14, items 2 and 4), one call on a 2-GPU machine, one tree: 10M tokens
# on one GPU against two (a model replica per GPU, commit groups round robin, committed in order:
# qrag.index.pipeline.index_groups(replicas=...)), alternating, then 100M tokens indexed on both
# and served with its shards spread over them (shard s on GPU s % 2), the serving path timed.
# Carry .carry/idx (see bench/index_contention.sh). On the GPU machine, from the repository root:
#   QRAG_COMMIT=<sha> OUT=$OUT bash bench/index_two_gpus.sh
export TOKENIZERS_PARALLELISM=false PYTHONPATH=platform
C=$PWD/.carry/idx
OUT=${OUT:-/tmp/index_two_gpus}
mkdir -p "$OUT"
summ() { python3 -c "import json,sys;d=json.loads(sys.stdin.read().strip().splitlines()[-1]);i=d['indexing'];s=i['stages'];l=d.get('latency_concurrency_1') or {};t=d.get('throughput') or {};print('$1', d['gpu'], d['devices'], 'tokens',d['corpus']['encoder_tokens'],'sec',i['seconds'],'tok/s',i['tokens_per_s'],'bare(1 GPU)',i['bare_forward_tokens_per_s'],'share',i['end_to_end_share_of_bare'],'embed_busy',s['embed_busy_seconds'],'prep_busy',s['prep_busy_seconds'],'write',s['write_busy_seconds'],'writer_wait',s['writer_waiting_for_embed_seconds'],'p50/p99',l.get('p50_ms'),l.get('p99_ms'),'q/s',t.get('max_queries_per_s_with_p99_under_limit'))"; }
ARGS="--corpus $C/novels --encoder $C/minilm16 --random-weights --writer process"
run() { local name=$1; shift; python bench/serve_scale.py $ARGS "$@" --out "$OUT/$name.json" 2>>"$OUT/err.txt" | summ "$name"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run index_10m_1gpu --tokens 10000000 --index-only --devices cuda:0
run index_10m_2gpus --tokens 10000000 --index-only --devices cuda:0,cuda:1

run serve_scale_100m_2gpus --tokens 100000000 --devices cuda:0,cuda:1 --variants optimized --batches 1,8,32,64
