#!/bin/bash
# FAISS on the GPU against the shards' torch scoring (bench/faiss_gpu.py) on a lent GPU whose image has
# CUDA 13 only. The wheel is PyPI's faiss-gpu 1.15.1 (CUDA 12; its libfaiss.so holds sm_90 code, which
# faiss-gpu-cu12 1.14.1 lacked); it runs with CUDA 12's runtime (carried, 3 MB) and bench/cublas12/'s
# stand-in libcublas.so.12, which forwards the eight cuBLAS calls libfaiss.so makes to CUDA 13's
# (CUDA 12's cuBLAS is a 600 MB wheel).
#
# The wheel (135 MB) is over a call's 64 MiB carry, so it travels in parts:
#   here:  bash bench/faiss_gpu.sh pack          # .carry/faiss_1, .carry/faiss_2, .carry/faiss_3 (<= 53 MB each)
#   GPU:   three calls back to back on one warm machine, carrying .carry/faiss_1, then .carry/faiss_2, then
#          .carry/faiss_3, each running  QRAG_COMMIT=<sha> OUT=$OUT bash bench/faiss_gpu.sh [faiss_gpu.py args]
# Each call keeps its part in /tmp/faiss_parts (PARTS); the call carrying the last part (or none, once all are
# kept) checks the wheel's SHA-256, installs it and runs the benches: bench/ann_gpu.py (the approximate candidate stage with exact
# re-scoring, arguments in ANN_ARGS; ANN_ARGS=skip: not run), then bench/faiss_gpu.py (position-free
# FAISS against torch, arguments after `run`). Results: $OUT/ann_gpu.json, $OUT/faiss_gpu.json, $OUT/*err.txt.
set -e
MODE=${1:-run}
if [ "$MODE" = pack ]; then
  dl=$(mktemp -d)
  ${PY:-python3} -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dl" faiss-gpu==1.15.1 nvidia-cuda-runtime-cu12==12.9.79
  wheel=$(cd "$dl" && ls faiss_gpu-*.whl)
  (cd "$dl" && split -b 50m -d -a 1 "$wheel" "$wheel.part")
  rm -rf .carry/faiss_1 .carry/faiss_2 .carry/faiss_3
  n=0
  for part in "$dl/$wheel".part*; do
    n=$((n + 1)); mkdir -p ".carry/faiss_$n"; mv "$part" ".carry/faiss_$n/"
  done
  mv "$dl"/nvidia_cuda_runtime_cu12-*.whl ".carry/faiss_$n/"
  for d in .carry/faiss_*; do
    printf 'wheel=%s\nparts=%s\nsha256=%s\n' "$wheel" "$n" "$(sha256sum "$dl/$wheel" | cut -d' ' -f1)" > "$d/manifest"
  done
  rm -rf "$dl"; du -sh .carry/faiss_*
  exit 0
fi
[ "$MODE" = run ] && shift || true  # the rest goes to faiss_gpu.py
OUT=${OUT:-/tmp/faiss_gpu}
PARTS=${PARTS:-/tmp/faiss_parts}  # kept between calls while the machine is warm
mkdir -p "$OUT" "$PARTS"
cp .carry/faiss_*/* "$PARTS"/ 2>/dev/null || true
. "$PARTS/manifest"
have=$(ls "$PARTS/$wheel".part* 2>/dev/null | wc -l)
# Only the call that carries the last part (or none) runs the benches: on a warm machine that kept every
# part from before, a call carrying part 1 would otherwise start a run that its time limit cuts off. The
# device keeps ignored folders that earlier calls carried, so a call may hold earlier parts beside its own.
carried=$(ls .carry/faiss_*/"$wheel".part* 2>/dev/null | wc -l)
if [ "$carried" -gt 0 ] && ! ls .carry/faiss_*/"$wheel".part$((parts - 1)) >/dev/null 2>&1; then
  echo "faiss_gpu.sh: kept the carried part ($have of $parts parts in $PARTS); the call carrying the last part runs"
  exit 0
fi
if [ "$have" -lt "$parts" ]; then
  echo "faiss_gpu.sh: $have of $parts parts of $wheel kept in $PARTS; carry the next .carry/faiss_N"
  exit 0
fi
cat "$PARTS/$wheel".part* > "$PARTS/$wheel"
echo "$sha256  $PARTS/$wheel" | sha256sum -c --quiet
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/faiss_site \
  "$PARTS/$wheel" "$PARTS"/nvidia_cuda_runtime_cu12-*.whl
shim=$(bash bench/cublas12/build.sh /tmp/cublas12)
cublas13=$(find "$(python3 -c 'import site; print(site.getsitepackages()[0])')" /usr/local -name 'libcublas.so.13*' 2>/dev/null | head -1)
echo "CUDA 13 cuBLAS: $cublas13"
# faiss's __init__ preloads cuBLAS 12 and cuRAND 10 from the nvidia.cublas and nvidia.curand wheels'
# folders: point them at the stand-in and at the image's cuRAND 10 (the same soname in CUDA 13).
curand=$(find "$(dirname "$cublas13")" /usr/local -name 'libcurand.so.10*' 2>/dev/null | head -1)
mkdir -p /tmp/faiss_site/nvidia/cublas/lib /tmp/faiss_site/nvidia/curand/lib
ln -sf "$shim/libcublas.so.12" "$shim/libcublasLt.so.12" /tmp/faiss_site/nvidia/cublas/lib/
ln -sf "$curand" /tmp/faiss_site/nvidia/curand/lib/libcurand.so.10
export QRAG_CUBLAS13=$cublas13 LD_LIBRARY_PATH=$shim:/tmp/faiss_site/nvidia/cuda_runtime/lib:$LD_LIBRARY_PATH
export PYTHONPATH=/tmp/faiss_site:$PWD/platform _FAISS_WHEEL_DISABLE_CUDA_PRELOAD=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cd bench
if [ "${ANN_ARGS:-}" != skip ]; then
  # shellcheck disable=SC2086 - ANN_ARGS is a list of arguments
  python3 ann_gpu.py --out "$OUT/ann_gpu.json" ${ANN_ARGS:-} 2>"$OUT/ann_err.txt" || { tail -40 "$OUT/ann_err.txt"; exit 1; }
fi
python3 faiss_gpu.py --out "$OUT/faiss_gpu.json" "$@" 2>"$OUT/err.txt" || { tail -40 "$OUT/err.txt"; exit 1; }
