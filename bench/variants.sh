# Sourced by bench/longctx_seeds.sh and bench/hotpot_seeds.sh: the rows a seeds run trains beside the
# preset. VARIANTS is a list of LABEL:key=value,key=value ('_' in a label is a space; LABEL: alone is the
# preset as it is); "table3" is the paper's Table 3 ablation with both supervised rows; "sft3" separates
# those two: ours, the paper's, and ours with each one of the paper's three choices (qrag/rl/sft.py).
TABLE3_VARIANTS="Q-RAG:learner.objective=pqn w/o_target:learner.objective=pqn,learner.use_target=false \
w/o_soft-Q:learner.objective=pqn,learner.soft_q=false w/o_positions:learner.objective=pqn,model.positions=none SFT:learner.objective=sft SFT_trajectory:learner.objective=sft_trajectory"
SFT3_VARIANTS="SFT:learner.objective=sft SFT_trajectory:learner.objective=sft_trajectory \
SFT_given_order:learner.objective=sft,learner.sft_order=given \
SFT_next_fact:learner.objective=sft,learner.sft_positives=next \
SFT_BCE:learner.objective=sft,learner.sft_loss=bce"
if [ "${VARIANTS:-}" = table3 ]; then VARIANTS=$TABLE3_VARIANTS; fi
if [ "${VARIANTS:-}" = sft3 ]; then VARIANTS=$SFT3_VARIANTS; fi
VARIANTS=${VARIANTS:-Q-RAG:}

variant_label() {  # 'w/o_target:learner.use_target=false' -> 'w/o target'
  local label=${1%%:*}
  echo "${label//_/ }"
}

variant_overrides() {  # 'SFT:learner.objective=sft,learner.lr=1e-4' -> 'learner.objective=sft learner.lr=1e-4'
  local overrides=${1#*:}
  echo "${overrides//,/ }"
}

label_slug() {  # as bench/longctx.py's label_slug names a row's runs and files: 'w/o soft-Q' -> w-o-soft-q
  echo "$1" | tr 'A-Z' 'a-z' | sed -E 's/[^a-z0-9]+/-/g; s/^-+|-+$//g'
}
