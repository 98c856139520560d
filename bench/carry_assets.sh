# Sourced by bench/longctx_seeds.sh and bench/hotpot_seeds.sh: what a GPU call carries ($CARRY; at most 64 MiB
# together with the source tree) split over calls on one warm machine and merged into $ASSETS, which later
# calls read (a warm machine keeps /tmp between calls, not the carried folders). Set PY, CARRY and ASSETS first.

split_large_encoder() {  # after packing: an encoder over 45 MiB (MPNet) becomes $CARRY/encoder_parts/a, b, ...
  # Parts of 40 MiB leave a call room for the source tree beside one (the tree grows with bench/results).
  if [ "$(du -sm "$CARRY/encoder" | cut -f1)" -gt 45 ]; then
    # one `stage` call each; require_assets joins them (hash-checked) before any run
    rm -rf "$CARRY/encoder_parts"
    $PY bench/carry_parts.py split --source "$CARRY/encoder" --out "$CARRY/encoder_parts" --part-mib 40
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
