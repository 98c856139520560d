#!/bin/bash
# Indexing 10M tokens on one GPU in ONE process (serve_scale.py --index-only --no-lanes): the bench's
# default pipeline against the store writer as a thread and against workers handing chunks back as
# objects, alternating in one call on one tree.
# Carry .carry/idx (random-init MiniLM shape and the novels, ~21 MB), made here once:
#   mkdir -p .carry/idx && cp -r ../shared/data/gutenberg_novels .carry/idx/novels
#   python bench/serve_scale.py --export-encoder .carry/idx/minilm16 && rm .carry/idx/minilm16/*.safetensors
# Run (GPU machine, repository root):  QRAG_COMMIT=<sha> OUT=$OUT bash bench/index_contention.sh
# Results: $OUT/<run>.json (+ err.txt), a summary line each on stdout; current: bench/results/index_contention_packed_h100/.
OUT=${OUT:-/tmp/index_contention}
ARGS="--corpus $PWD/.carry/idx/novels --encoder $PWD/.carry/idx/minilm16 --random-weights --tokens ${TOKENS:-10000000} --index-only --no-lanes"
source "$(dirname "$0")/index_runs.sh"
run index_default
run index_writer_thread --writer thread
run index_objects --worker-output objects
run index_default_b
run index_writer_thread_b --writer thread
