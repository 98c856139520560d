#!/usr/bin/env bash
# The learner's speed switches against each other in one call on one GPU: bench/train_speed.py per
# row, one after another (never side by side: each row has the GPU alone), each with --profile.
#
#   OUT=$OUT bash bench/learner_switches.sh            # the default rows below
#   OUT=$OUT ROWS="pqn_eager|configs/hotpot.yaml|learner.objective=pqn,learner.graphs=false" bash bench/learner_switches.sh
#
# ROWS: LABEL|CONFIG|key=value,key=value (space separated). A row whose file exists is skipped, so a
# call stopped at its limit resumes. REPEATS=N runs the rows N times, interleaved (LABEL_r1 ... LABEL_rN:
# the host's speed moves between runs on a lent machine), and $OUT/summary.json gives each row's median
# (bench/speed_medians.py). Data and encoder as for train_speed.py (QRAG_DATA_DIR,
# QRAG_ENCODER, PYTHONPATH=platform). CPU check: OUT=/tmp/sw UPDATES=1 WARMUP=1 PROFILE=0
# ROWS="cpu|configs/hotpot.yaml|device=cpu,learner.episodes_per_update=4,learner.micro_batch=4" bash bench/learner_switches.sh
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
UPDATES=${UPDATES:-6}
WARMUP=${WARMUP:-3}
PROFILE=${PROFILE:-2}
QA3="configs/babilong-qa3.yaml"
HOTPOT="configs/hotpot.yaml"
QA3_DATA="data.samples_per_task=600"  # a shorter data start-up; the contexts are the preset's
ROWS=${ROWS:-"hotpot_pqn_padded|$HOTPOT|learner.objective=pqn,learner.packed=false \
hotpot_pqn_packed_fp32|$HOTPOT|learner.objective=pqn,learner.bf16_copies=false \
hotpot_pqn|$HOTPOT|learner.objective=pqn \
hotpot_pqn_128k|$HOTPOT|learner.objective=pqn,learner.encode_tokens=131072 \
hotpot_sft_padded|$HOTPOT|learner.objective=sft,learner.packed=false \
hotpot_sft_32k|$HOTPOT|learner.objective=sft,learner.encode_tokens=32768 \
hotpot_sft|$HOTPOT|learner.objective=sft \
qa3_pqn_padded|$QA3|learner.packed=false,$QA3_DATA \
qa3_pqn_packed_fp32|$QA3|learner.bf16_copies=false,$QA3_DATA \
qa3_pqn|$QA3|$QA3_DATA"}

# A machine where pip installed torch and transformers has their compiled bytecode; an image run with
# PYTHONDONTWRITEBYTECODE compiles them again in every process, which the first-update figure would count.
# BYTECODE=image keeps the image's behaviour; by default the rows share a cache, filled once before them.
if [ "${BYTECODE:-cached}" = cached ]; then
  unset PYTHONDONTWRITEBYTECODE
  export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/qrag-pycache}
  python -c "import qrag.rl.train, transformers.models.bert.modeling_bert" || true
fi
REPEATS=${REPEATS:-1}
mkdir -p "$OUT"
runs=""
for ((r = 1; r <= REPEATS; r++)); do
  for row in $ROWS; do
    if [ "$REPEATS" -gt 1 ]; then runs+=" ${row%%|*}_r$r|${row#*|}"; else runs+=" $row"; fi
  done
done
for row in $runs; do
  IFS='|' read -r label config overrides <<<"$row"
  out="$OUT/$label.json"
  if [ -s "$out" ]; then echo "== $label: done before"; continue; fi
  echo "== $label ($config ${overrides//,/ })"
  # shellcheck disable=SC2086
  python bench/train_speed.py --config "$config" --updates "$UPDATES" --warmup "$WARMUP" --timed 1 \
    --profile "$PROFILE" --out "$out" ${overrides//,/ } >"$OUT/$label.log" 2>&1 || {
    echo "== $label failed:"; tail -20 "$OUT/$label.log"; }
  [ -s "$out" ] && python - "$out" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
p = r.get("profile") or {}
print(f"   {r['episodes_per_s']:.0f} episodes/s, first update {r['first_update_s_from_process_start']:.1f} s, "
      f"GPU busy {p.get('gpu_busy_share')}, kernels/update {p.get('kernels_per_update')}")
EOF
done
python bench/speed_medians.py "$OUT" --out "$OUT/summary.json" || true
