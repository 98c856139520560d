#!/bin/bash
# Ray on the device: start a head like bench/two_gpu.py, probe a driver, run a tiny training job; keep every log.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/two/whl/*.whl || exit 2
export PYTHONPATH=/tmp/site:$PWD/platform HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$(python3 -c 'import secrets;print(secrets.token_hex(32))')
python3 -c "import ray, sys; print(ray.__version__, ray.__file__, sys.version)"
ls -la /dev/shm | head -3; df -h /dev/shm /tmp; ulimit -a | head -20
python3 bench/two_gpu.py --check-imports
python3 -m ray.scripts.scripts start --head --node-ip-address=127.0.0.1 --port=6390 --dashboard-host=127.0.0.1 --num-cpus=8 --num-gpus=1 --temp-dir=/tmp/rt --disable-usage-stats > $OUT/ray_start.log 2>&1
echo "start rc=$?"; sleep 5
timeout 120 python3 -c "
import ray; ray.init(address='127.0.0.1:6390', logging_level='ERROR')
print('driver ok', ray.cluster_resources())
print('task', ray.get(ray.remote(lambda: 41 + 1).remote()))
" 2>&1 | tail -20
python3 -c "
import torch
from transformers import AutoConfig, AutoModel, AutoTokenizer
torch.manual_seed(0); AutoModel.from_config(AutoConfig.from_pretrained('.carry/two/minilm16')).save_pretrained('/tmp/enc', safe_serialization=True)
AutoTokenizer.from_pretrained('.carry/two/minilm16').save_pretrained('/tmp/enc')"
QRAG_ENCODER=/tmp/enc QRAG_DATA_DIR=.carry/two/data timeout 240 python3 jobs/train_hotpot.py --address 127.0.0.1:6390 --config configs/hotpot.yaml name=probe out_dir=/tmp/probe_runs updates=6 eval_every=0 keep_best=false checkpoint_every=0 eval_limit=20 log_every=1 distributed.runners=2 distributed.mlflow_uri=none distributed.learner_gpu=true distributed.learner_gpus=0.5 2>&1 | grep -v Warning | tail -25
echo "train rc=${PIPESTATUS[0]}"
L=/tmp/rt/session_latest/logs; ls $L | head -50
for f in raylet.out raylet.err dashboard_agent.log runtime_env_agent.log gcs_server.err; do [ -f $L/$f ] && tail -c 12000 $L/$f > $OUT/$f; done
grep -il "error\|fatal\|check failed" $L/* 2>/dev/null | head; tail -5 $L/raylet.out
python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1
