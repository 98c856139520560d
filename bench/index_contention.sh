#!/bin/bash
# Indexing 10M tokens on one GPU (issue 14), one call, one tree, alternating: the default (books cut
# into ~32K-token documents, torch's CPU threads at 1 and the GIL's switch interval at 0.2 ms while
# feeding the GPU, chunks embedded by CUDA-graph replays, workers tokenising through the Rust
# tokenizer's encode_batch_fast on 3/4 of the cores and handing chunks back packed, the store
# written by a child process: qrag.index.writer_process) against the writer thread and against
# workers handing back DocumentChunks one by one. Round 6 (index_contention_packed_h100/) ran the
# thread writer as its default, the process writer and the objects variant beside it. Earlier
# rounds in bench/results/: index_contention_10m_h100/, index_contention_docs_threads_h100/, index_contention_graphs_switch_h100/,
# index_contention_fast_tokeniser_h100/, index_contention_workers_h100/,
# index_contention_writer_process_h100/; bench/index_stages.py times each stage alone.
# Carry (ignored folder, ~21 MB), made here once:
#   mkdir -p .carry/idx && cp -r ../shared/data/gutenberg_novels .carry/idx/novels
#   python bench/serve_scale.py --export-encoder .carry/idx/minilm16 && rm .carry/idx/minilm16/*.safetensors
# On the GPU machine, from the repository root:  QRAG_COMMIT=<sha> bash bench/index_contention.sh   (carry .carry/idx)
OUT=${OUT:-/tmp/index_contention}
ARGS="--corpus $PWD/.carry/idx/novels --encoder $PWD/.carry/idx/minilm16 --random-weights --tokens ${TOKENS:-10000000} --index-only --no-lanes"
source "$(dirname "$0")/index_runs.sh"
run index_default
run index_writer_thread --writer thread
run index_objects --worker-output objects
run index_default_b
run index_writer_thread_b --writer thread
