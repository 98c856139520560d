#!/bin/bash
# HotpotQA dev and MuSiQue out of distribution under the headline protocol (docs/benchmarks.md): SEEDS
# training seeds of a preset side by side on one GPU, each checkpoint chosen on the validation part of
# train (the preset's keep_best), dev scored once per seed, the untrained encoder once, then
# `qrag combine-seeds` (means with 95% intervals over seeds and questions). No Ray, MLflow or FAISS.
#
# Here, once (commit first: the results record the commit and whether the tree differed from it):
#   bash bench/hotpot_seeds.sh pack          # .carry/hotpot: fp16 MiniLM, the QA data, provenance.env (~50 MB)
#   PACK_ENCODER=mpnet bash bench/hotpot_seeds.sh pack   # all-mpnet-base-v2 instead, in parts (encoder_parts/a..f)
# On a GPU machine: a call carries at most 64 MiB with the source tree, less than .carry/hotpot, so it goes
# in parts over calls on one warm machine, each merged into $ASSETS ($WORK/assets; bench/carry_assets.sh):
#   call 1, carry .carry/hotpot/data and .carry/hotpot/provenance.env:   bash bench/hotpot_seeds.sh stage
#   (MPNet: one more `stage` call per part, carrying .carry/hotpot/encoder_parts/a, then b, ... f)
#   call 2, carry .carry/hotpot/encoder (MiniLM; MPNet: nothing):        OUT=$OUT bash bench/hotpot_seeds.sh run
# An encoder that does not fit beside the tree in one call (bench/carry_assets.sh measures it; MiniLM's as well
# as MPNet's, as the tree grows) is packed as encoder_parts/a, b, ...: one `stage` call per part, then `run`
# carrying nothing.
# The paper's Table 3 rows, each with SEEDS seeds, in one headline per dataset with the differences between rows
# (w/o positions is left out: the preset has none), more than one call's work; `timeout` below the call's 600 s:
#   OUT=$OUT VARIANTS=table3 timeout 560 bash bench/hotpot_seeds.sh run
# On its SIGTERM the script stops the runs and packs what exists into $OUT/hotpot_seeds_partial.tgz (exit 124);
# the same command in a later call on the same warm machine (carrying nothing more) resumes: training from
# each run's newest checkpoint (every EVERY updates), finished evaluations not redone. At most PER_GPU runs share
# the GPU at once (default 12), the rest start as they end.
# It brings back hotpot_headline.json, musique_headline.json, val_headline.json (HotpotQA val, the part of train each
# run held out: where rows are compared to choose a preset's objective), the untrained summaries and one .tgz with
# every seed's summary, per-question records and log (a call returns at most 8 files); with MUSIQUE_STOP (below)
# also musique_stop_<rule>_headline.json, MuSiQue dev under a stop chosen on MuSiQue's train subset.
# CPU check with a tiny encoder (minutes): DEVICE=cpu ENCODER=DIR EXTRA="updates=2 eval_every=1
#   learner.episodes_per_update=8 learner.micro_batch=8" LIMIT=20 OUT=/tmp/hs bash bench/hotpot_seeds.sh run
set -euo pipefail
MODE=${1:?usage: bench/hotpot_seeds.sh pack|stage|run}
CARRY=${CARRY:-.carry/hotpot}
# configs/hotpot.yaml (the README's HotpotQA row) trains on HotpotQA alone, so MuSiQue is out of
# distribution; CONFIG=configs/hotpot-mixed.yaml trains on 150 MuSiQue train questions too (not OOD).
CONFIG=${CONFIG:-configs/hotpot.yaml}
# What val and dev are read from (default CONFIG): configs/hotpot.yaml scores a hotpot-mixed run on the
# HotpotQA questions alone, the same val part (ids hashed alike) that HotpotQA-only runs held out.
EVAL_CONFIG=${EVAL_CONFIG:-$CONFIG}
SEEDS=${SEEDS:-0 1 2}
PY=${PY:-python3}
export PYTHONPATH=$PWD/platform PYTHONUNBUFFERED=1

. "$(dirname "$0")/carry_assets.sh"

if [ "$MODE" = pack ]; then
  data=$($PY -c 'from qrag.data.paths import data_root; print(data_root())')
  rm -rf "$CARRY/encoder" "$CARRY/encoder_parts"
  mkdir -p "$CARRY/data"
  cp -r "$data/hotpotqa" "$data/musique" "$data/2wikimultihopqa" "$CARRY/data/"
  PYTHONPATH=$PYTHONPATH:$PWD/bench $PY -c 'import sys; from bench_common import pack_encoder; pack_encoder(*sys.argv[1:])' \
    "$CARRY/encoder" "${PACK_ENCODER:-minilm}"
  split_large_encoder
  $PY -m qrag.integrations.provenance --env > "$CARRY/provenance.env"
  du -sh "$CARRY"/*  # each part's size: what a call can carry beside the source tree
  exit 0
fi
case "$MODE" in
  stage | run) ;;
  *) echo "bench/hotpot_seeds.sh: pack, stage or run, not $MODE" >&2; exit 2 ;;
esac

WORK=${WORK:-/tmp/hotpot_seeds}
ASSETS=${ASSETS:-$WORK/assets}
merge_carry bench/hotpot_seeds.sh "$MODE"
OUT=${OUT:?set OUT to the folder that comes back}
DEVICE=${DEVICE:-cuda}
parts=""  # what must have been carried: not what ENCODER or QRAG_DATA_DIR name elsewhere
[ -n "${QRAG_DATA_DIR:-}" ] || parts+=" data"
[ -n "${ENCODER:-}" ] || parts+=" encoder"
require_assets bench/hotpot_seeds.sh $parts
export HF_HUB_OFFLINE=1 QRAG_DATA_DIR=${QRAG_DATA_DIR:-$ASSETS/data}
mkdir -p "$WORK/done" "$OUT"
settings="model.encoder=${ENCODER:-$ASSETS/encoder} device=$DEVICE out_dir=$WORK/runs checkpoint_every=${EVERY:-50} ${EXTRA:-}"
limit=${LIMIT:+--limit $LIMIT}
qeval() {  # checkpoint, out, more qrag eval arguments
  $PY -m qrag eval --config "$EVAL_CONFIG" --checkpoint "$1" $settings $limit --no-progress --out "$2" "${@:3}"
}
evaluate() {  # checkpoint, name[, --label L]: HotpotQA val and dev (the preset's T), MuSiQue dev out of distribution (T = 4)
  # Side by side: a process's start-up (imports, the GPU, the checkpoint) is most of an evaluation's time.
  local pids=() pid status=0
  # val (the part of train each run held out) per question: what a preset's objective is chosen on.
  qeval "$1" "$WORK/val_$2.json" --split val "${@:3}" &
  pids+=($!)
  qeval "$1" "$WORK/hotpot_$2.json" --split dev "${@:3}" &
  pids+=($!)
  qeval "$1" "$WORK/musique_$2.json" --dataset musique --split dev --steps 4 "${@:3}" &
  pids+=($!)
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  [ "$status" = 0 ] || return 1
  touch "$WORK/done/$2"  # all three written whole: a later call skips them
}
# MUSIQUE_STOP (rules of `qrag learned-stop`: budget, threshold, best): MuSiQue's stop for each run's greedy search,
# chosen on the MuSiQue train subset (150 questions a HotpotQA-only run never saw: its out-of-distribution val)
# and applied to its MuSiQue dev records. A run trained on MuSiQue (hotpot-mixed) is refused by qrag eval.
MUSIQUE_STOP=${MUSIQUE_STOP:-}
musique_stop() {  # checkpoint, name, --label L
  local rule
  qeval "$1" "$WORK/musique-val_$2.json" --dataset musique --split train --steps 4 "${@:3}"
  for rule in $MUSIQUE_STOP; do
    $PY -m qrag learned-stop "$WORK/musique-val_$2.json" "$WORK/musique_$2.json" --rule "$rule" \
      --out "$WORK/musique-stop-${rule}_$2.json"
  done
  touch "$WORK/done/stop-$2"
}
. "$(dirname "$0")/seeds_jobs.sh"
trap 'stop_and_pack bench/hotpot_seeds.sh "$OUT/hotpot_seeds_partial.tgz" "./*.json ./*.records.jsonl ./*.log runs/*/training.json"' TERM INT
# VARIANTS (bench/variants.sh): rows beside the preset. With several, each headline is a methods file: every
# row's seeds combined and the difference between every pair of rows.
# Alone, the preset is named by its objective, as Table 3 names its rows (SFT for configs/hotpot.yaml).
VARIANTS=${VARIANTS:-$($PY -c 'import sys; from qrag.config import load_config; from qrag.evaluation.methods import OBJECTIVE_NAMES
print(OBJECTIVE_NAMES[load_config(sys.argv[1]).learner.objective].replace(" ", "_") + ":")' "$CONFIG")}
. "$(dirname "$0")/variants.sh"
if [ "$VARIANTS" = "$TABLE3_VARIANTS" ]; then VARIANTS=$(for v in $VARIANTS; do [ "${v%%:*}" = w/o_positions ] || echo "$v"; done); fi
max_running=${PER_GPU:-12}
# SEARCHES: more ways to search each trained checkpoint, rows of their own beside the preset's search, in the
# format of VARIANTS (LABEL:key=value,...; e.g. beam_4_logprob:search.beam_width=4,search.beam_score=logprob).
SEARCHES=${SEARCHES:-}
searched() {  # tag seed: every evaluation of that run is done
  local search
  [ -f "$WORK/done/$1s$2" ] || return 1
  [ -z "$MUSIQUE_STOP" ] || [ -f "$WORK/done/stop-$1s$2" ] || return 1
  for search in $SEARCHES; do [ -f "$WORK/done/$1$(label_slug "$(variant_label "$search")")-s$2" ] || return 1; done
}
for variant in $VARIANTS; do
  label=$(variant_label "$variant")
  vargs=$(variant_overrides "$variant")
  # The preset keeps the names it always had (seed0, hotpot_s0.json); a variant's are prefixed by its label.
  if [ "$label" = Q-RAG ]; then tag=""; else tag="$(label_slug "$label")-"; fi
  for S in $SEEDS; do
    searched "$tag" "$S" && continue
    make_room
    (
      run=$WORK/runs/${tag}seed$S
      if [ ! -d "$run/final" ]; then
        # A run a call's time limit cut short goes on from its newest checkpoint (a save cut short is not one).
        latest=$(compgen -G "$run/checkpoints/update_*[0-9]" | sort | tail -n 1 || true)
        $PY -m qrag train --config "$CONFIG" name="${tag}seed$S" seed="$S" data.seed="$S" $settings $vargs \
          --no-progress ${latest:+--resume "$latest"}
      fi
      [ -f "$WORK/done/${tag}s$S" ] || evaluate "$run/best" "${tag}s$S" --label "$label"
      [ -z "$MUSIQUE_STOP" ] || [ -f "$WORK/done/stop-${tag}s$S" ] || musique_stop "$run/best" "${tag}s$S" --label "$label"
      for search in $SEARCHES; do
        slabel=$(variant_label "$search")
        name="${tag}$(label_slug "$slabel")-s$S"
        # shellcheck disable=SC2046  # the search's overrides are words
        [ -f "$WORK/done/$name" ] || evaluate "$run/best" "$name" --label "$label $slabel" $(variant_overrides "$search")
      done
    ) >> "$WORK/${tag}seed$S.log" 2>&1 &
  done
done
if [ ! -f "$WORK/done/untrained" ]; then make_room; evaluate none untrained >> "$WORK/untrained.log" 2>&1 & fi
wait_all
tail -n 3 "$WORK"/*.log
[ "$failed" = 0 ] || { echo "bench/hotpot_seeds.sh: a run failed (logs above)" >&2; exit 1; }

$PY -m qrag combine-seeds "$WORK"/hotpot_*s[0-9]*.json --out "$OUT/hotpot_headline.json"
$PY -m qrag combine-seeds "$WORK"/musique_*s[0-9]*.json --out "$OUT/musique_headline.json"
$PY -m qrag combine-seeds "$WORK"/val_*s[0-9]*.json --out "$OUT/val_headline.json"
for rule in $MUSIQUE_STOP; do
  $PY -m qrag combine-seeds "$WORK"/musique-stop-"${rule}"_*s[0-9]*.json --out "$OUT/musique_stop_${rule}_headline.json"
done
cp "$WORK/hotpot_untrained.json" "$WORK/musique_untrained.json" "$OUT/"
(cd "$WORK" && tar czf "$OUT/hotpot_seeds_files.tgz" ./*.json ./*.records.jsonl ./*.log)
