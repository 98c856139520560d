# Sourced by bench/index_contention.sh and bench/index_two_gpus.sh (set OUT and ARGS first): the
# environment, the carry folder $C, and `run NAME [serve_scale options]`, which writes
# $OUT/NAME.json and prints one line of its indexing (and, when timed, query) figures, and `old NAME ...`.
# serve_scale.py indexes in lanes on GPUs by default since session 10: ARGS carry --no-lanes so a run
# without --lanes is the one-process path these rounds measured.
# QRAG_PLATFORM: another tree's platform/ (an earlier commit's library: a baseline in the same call),
# read by each run (rounds 7 and 8 of bench/index_lanes.sh read it once here, so their "old" runs
# ran the new tree).
export TOKENIZERS_PARALLELISM=false
C=$PWD/.carry/idx
mkdir -p "$OUT"
summ() { python3 -c "import json,sys;d=json.loads(sys.stdin.read().strip().splitlines()[-1]);i=d['indexing'];s=i['stages'];pl=s.get('per_lane') or [s];l=d.get('latency_concurrency_1') or {};t=d.get('throughput') or {};print('$1', d['gpu'], d['devices'], 'tokens',d['corpus']['encoder_tokens'],'sec',i['seconds'],'tok/s',i['tokens_per_s'],'bare(1 GPU)',i['bare_forward_tokens_per_s'],'share',i['end_to_end_share_of_bare'],'lanes',s.get('lanes'),'startup',s.get('startup_seconds'),'total',s.get('total_seconds'),'lane_start',[(r.get('model_seconds'),r.get('warm_up_seconds'),r.get('warm_shapes'),r.get('workers_after_model_seconds')) for r in s.get('lane_startup') or []],'embed_busy',[r.get('embed_busy_seconds',r.get('embed_seconds')) for r in pl],'wait_prep',[r.get('embed_waiting_for_prep_seconds',r.get('embed_waiting_for_prep')) for r in pl],'prep_busy',[r.get('prep_busy_seconds',r.get('prep_seconds')) for r in pl],'write',[r.get('write_busy_seconds',r.get('write_seconds')) for r in pl],'writer_wait',[r.get('writer_waiting_for_embed_seconds',r.get('writer_waiting_for_embed')) for r in pl],'graphs',(i.get('chunk_graphs') or {}).get('replays'),'mem_gib',[r.get('max_memory_reserved_gib') for r in pl],'groups',[r.get('commits') for r in pl],'ramp/tail',[(r.get('started_after_ready'),r.get('first_block_at'),r.get('first_slice_at'),r.get('last_slice_done_at') and round(r['seconds']-r['last_slice_done_at'],3)) for r in pl],'p50/p99',l.get('p50_ms'),l.get('p99_ms'),'q/s',t.get('max_queries_per_s_with_p99_under_limit'))"; }
run() { local name=$1; shift; PYTHONPATH=${QRAG_PLATFORM:-platform} python bench/serve_scale.py $ARGS "$@" --out "$OUT/$name.json" 2>>"$OUT/err.txt" | summ "$name"; }
# `old NAME [options]`: the same run on OLD_COMMIT's platform/ in .carry/old (a baseline in the same call).
old() { local name=$1; shift; QRAG_PLATFORM=$PWD/.carry/old/platform QRAG_COMMIT=$OLD_COMMIT run "$name" "$@"; }
