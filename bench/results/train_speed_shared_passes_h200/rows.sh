#!/bin/bash
# One call's rows: the learner before (aefd3ba, /tmp/speed/base) and after (this tree) sharing its loss
# passes, HotpotQA soft PQN at the preset's 131,072 tokens, interleaved base/new; then QA3 4K.
set -uo pipefail
export QRAG_DATA_DIR=/tmp/speed/data QRAG_ENCODER=/tmp/speed/encoder HF_HUB_OFFLINE=1 PYTHONPATH=platform
export OUT=/tmp/sw UPDATES=20 WARMUP=4
. /tmp/speed/provenance.env
NEW=$QRAG_COMMIT
BASE=aefd3ba4e051aac3d8c6524cdc0374bbbcfdd149
H=configs/hotpot.yaml
Q=configs/babilong-qa3.yaml
QA3_DATA=data.samples_per_task=600
run() {  # tree commit label config overrides profile
  (cd "$1" && QRAG_COMMIT=$2 QRAG_DIRTY=0 QRAG_DIFF_SHA256= PROFILE=$6 ROWS="$3|$4|$5" bash bench/learner_switches.sh)
}
for r in ${REPS:-1 2 3 4 5}; do
  p=0; [ "$r" = 1 ] && p=2
  run /tmp/speed/base "$BASE" "hotpot_pqn_base_r$r" $H learner.objective=pqn $p
  run "$PWD" "$NEW" "hotpot_pqn_new_r$r" $H learner.objective=pqn $p
done
for r in ${QREPS:-1 2}; do
  run /tmp/speed/base "$BASE" "qa3_base_r$r" $Q $QA3_DATA 0
  run "$PWD" "$NEW" "qa3_new_r$r" $Q $QA3_DATA 0
done
