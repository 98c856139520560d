#!/bin/bash
# FAISS on the GPU against the shards' torch scoring (bench/faiss_gpu.py) on a lent GPU whose image has
# CUDA 13 only: installs the faiss-gpu-cu12 wheel with CUDA 12's runtime and builds bench/cublas12/'s
# stand-in libcublas.so.12 (it forwards FAISS's eight cuBLAS calls to CUDA 13's; CUDA 12's cuBLAS is a
# 600 MB wheel). Carry .carry/faiss, made here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 \
#     -d .carry/faiss faiss-gpu-cu12==1.14.1.post1 nvidia-cuda-runtime-cu12==12.9.79
# Run (GPU machine, repository root):  QRAG_COMMIT=<sha> OUT=$OUT bash bench/faiss_gpu.sh
# Results: $OUT/faiss_gpu.json and $OUT/err.txt; current: bench/results/faiss_gpu_h100/.
set -e
OUT=${OUT:-/tmp/faiss_gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/faiss_site .carry/faiss/*.whl
shim=$(bash bench/cublas12/build.sh /tmp/cublas12)
cublas13=$(find "$(python3 -c 'import site; print(site.getsitepackages()[0])')" /usr/local -name 'libcublas.so.13*' 2>/dev/null | head -1)
echo "CUDA 13 cuBLAS: $cublas13"
export QRAG_CUBLAS13=$cublas13 LD_LIBRARY_PATH=$shim:/tmp/faiss_site/nvidia/cuda_runtime/lib:$LD_LIBRARY_PATH
export PYTHONPATH=/tmp/faiss_site:$PWD/platform _FAISS_WHEEL_DISABLE_CUDA_PRELOAD=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cd bench && python3 faiss_gpu.py --out "$OUT/faiss_gpu.json" "$@" 2>"$OUT/err.txt" || { tail -40 "$OUT/err.txt"; exit 1; }
