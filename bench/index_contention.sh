#!/bin/bash
# Indexing 10M tokens on one GPU (issue 14): where the embedding stage loses time. One call, one tree:
# the default (one tokeniser process per core but one), the same at nice 10 (the GPU-feeding thread
# first), 8 tokenisers, and the stages one after another (no overlap), then the first two again.
# Carry (ignored folder, ~21 MB), made here once:
#   mkdir -p .carry/idx && cp -r ../shared/data/gutenberg_novels .carry/idx/novels
#   python bench/serve_scale.py --export-encoder .carry/idx/minilm16 && rm .carry/idx/minilm16/*.safetensors
# On the GPU machine, from the repository root:  QRAG_COMMIT=<sha> bash bench/index_contention.sh   (carry .carry/idx)
export TOKENIZERS_PARALLELISM=false PYTHONPATH=platform
C=$PWD/.carry/idx
OUT=${OUT:-/tmp/index_contention}
mkdir -p "$OUT"
summ() { python3 -c "import json,sys;d=json.loads(sys.stdin.read().strip().splitlines()[-1]);i=d['indexing'];s=i['stages'];print('$1', d['gpu'], 'sec',i['seconds'],'tok/s',i['tokens_per_s'],'bare',i['bare_forward_tokens_per_s'],'share',i['end_to_end_share_of_bare'],'embed_busy',s['embed_busy_seconds'],'wait_prep',s['embed_waiting_for_prep_seconds'],'prep_busy',s['prep_busy_seconds'],'write',s['write_busy_seconds'])"; }
ARGS="--corpus $C/novels --encoder $C/minilm16 --random-weights --tokens ${TOKENS:-10000000} --index-only"
run() { local name=$1; shift; python bench/serve_scale.py $ARGS "$@" --out "$OUT/index_$name.json" 2>>"$OUT/err.txt" | summ "$name"; }
run default
run nice10 --worker-nice 10
run workers8 --workers 8
run sequential --sequential
run nice10_b --worker-nice 10
run default_b
