# Sourced by bench/longctx_seeds.sh and bench/hotpot_seeds.sh: what a GPU call carries ($CARRY; at most 64 MiB
# together with the source tree) split over calls on one warm machine and merged into $ASSETS, which later
# calls read (a warm machine keeps /tmp between calls, not the carried folders). Set PY, CARRY and ASSETS first.

split_large_encoder() {  # after packing: an encoder that cannot travel whole beside the tree becomes $CARRY/encoder_parts/a, b, ...
  # A call carries 64 MiB with the source tree (tracked files and the untracked ones git does not ignore), which
  # grows with bench/results: 2 MiB stay spare for manifests. CARRY_TREE_MIB stands in for the tree's size (tests).
  local tree room part
  tree=${CARRY_TREE_MIB:-$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s |
    awk '{s += $1} END {print int(s / 1048576) + 1}')}
  room=$(( 62 - tree ))
  [ "$room" -gt 0 ] || { echo "carry_assets.sh: the source tree ($tree MiB) leaves no room in a 64 MiB call" >&2; exit 2; }
  if [ "$(du -sm --apparent-size "$CARRY/encoder" | cut -f1)" -gt "$room" ]; then
    # one `stage` call each; require_assets joins them (hash-checked) before any run. Parts of at most 40 MiB
    # leave room beside one for a little more (the data, provenance.env).
    part=$(( room < 40 ? room : 40 ))
    rm -rf "$CARRY/encoder_parts"
    $PY bench/carry_parts.py split --source "$CARRY/encoder" --out "$CARRY/encoder_parts" --part-mib "$part"
    rm -rf "$CARRY/encoder"
  fi
}

merge_carry() {  # script name, mode: what this call carried joins $ASSETS; mode `stage` ends the script there
  if [ -d "$CARRY" ] && ! [ "$CARRY" -ef "$ASSETS" ]; then mkdir -p "$ASSETS" && cp -r "$CARRY"/. "$ASSETS"/; fi
  if [ "$2" = stage ]; then
    [ -d "$CARRY" ] || { echo "$1: stage: $CARRY was not carried" >&2; exit 2; }
    echo "$1: staged $CARRY into $ASSETS, which holds:"
    du -sh "$ASSETS"/*
    exit 0
  fi
}

require_assets() {  # script name, parts...: the encoder joined from its staged parts, each part present, provenance
  local name=$1 part
  shift
  if [ ! -e "$ASSETS/encoder" ] && [ -d "$ASSETS/encoder_parts" ]; then
    $PY bench/carry_parts.py join "$ASSETS/encoder_parts" "$ASSETS"  # every part staged, or it names the missing
  fi
  for part in "$@"; do
    [ -e "$ASSETS/$part" ] || { echo "$name: no $part under $ASSETS: carry $CARRY/$part" >&2; exit 2; }
  done
  if [ -f "$ASSETS/provenance.env" ]; then set -a; . "$ASSETS/provenance.env"; set +a; fi
}
