# Sourced by bench/longctx_seeds.sh and bench/hotpot_seeds.sh: their runs as background jobs, at most
# max_running of them at once, and a call's time limit (`timeout` sends SIGTERM; Ctrl-C SIGINT) that
# stops them all and packs what exists into one file (a call returns 8), so that a later call on the
# same warm machine resumes from $WORK.
failed=0

make_room() {  # wait until fewer than max_running runs are live (set max_running first)
  while [ "$(jobs -rp | wc -l)" -ge "$max_running" ]; do wait -n || failed=1; done
}

wait_all() {  # every run still live; failed=1 if any of them failed
  local job
  for job in $(jobs -p); do wait "$job" || failed=1; done
}

stop_tree() {  # a process and all under it; held first, so that it starts nothing new meanwhile
  local kid kids
  kill -STOP "$1" 2>/dev/null || return 0
  kids=$(pgrep -P "$1" || true)
  kill -TERM "$1" 2>/dev/null || true
  kill -CONT "$1" 2>/dev/null || true
  for kid in $kids; do stop_tree "$kid"; done
}

stop_and_pack() {  # script name, tarball, then globs under $WORK: what a stopped call brings back
  trap '' TERM INT  # `timeout` signals the whole process group as well: one bundle
  local name=$1 tarball=$2 job
  shift 2
  for job in $(jobs -p); do stop_tree "$job"; done
  (
    cd "$WORK" && shopt -s nullglob
    # shellcheck disable=SC2206  # the globs expand here, in $WORK
    files=($@)
    tar czf "$tarball" -T /dev/null ${files[@]+"${files[@]}"}
  ) || true
  echo "$name: stopped by a signal; what exists is in $tarball; a later call on this machine resumes"
  exit 124
}
