#!/usr/bin/env bash
# The MLflow tracking server for qrag: runs and metrics in a database (PostgreSQL in production,
# SQLite for one machine), artifacts (eval files, checkpoints) proxied through the server to a
# folder or an object store, so jobs and Serve need only MLFLOW_TRACKING_URI=http://HOST:PORT.
#
#   infra/mlflow/server.sh                                   # SQLite + ./mlflow-server/, 127.0.0.1:5000
#   MLFLOW_BACKEND_STORE_URI=postgresql://mlflow:PASSWORD@db-host:5432/mlflow \
#   MLFLOW_ARTIFACTS_DESTINATION=s3://my-bucket/mlflow MLFLOW_HOST=0.0.0.0 infra/mlflow/server.sh
#
# Environment (all optional):
#   MLFLOW_BACKEND_STORE_URI      database URI (default sqlite:///$PWD/mlflow-server/mlflow.db)
#   MLFLOW_ARTIFACTS_DESTINATION  folder or s3:// gs:// URI (default $PWD/mlflow-server/artifacts)
#   MLFLOW_HOST, MLFLOW_PORT      where to listen (default 127.0.0.1:5000; 0.0.0.0 in containers)
#   MLFLOW_WORKERS                server processes (default 2)
#   MLFLOW_BIN                    the mlflow executable of a full `pip install mlflow 'psycopg[binary]'`
#                                 (mlflow-skinny, what qrag itself needs, cannot serve)
#   MLFLOW_SERVER_ALLOWED_HOSTS   Host headers accepted (default: localhost and private IPs; add
#                                 DNS names clients use, e.g. mlflow.qrag.svc.cluster.local:*)
set -euo pipefail

backend="${MLFLOW_BACKEND_STORE_URI:-sqlite:///$PWD/mlflow-server/mlflow.db}"
artifacts="${MLFLOW_ARTIFACTS_DESTINATION:-$PWD/mlflow-server/artifacts}"
host="${MLFLOW_HOST:-127.0.0.1}"
port="${MLFLOW_PORT:-5000}"
workers="${MLFLOW_WORKERS:-2}"
mlflow_bin="${MLFLOW_BIN:-mlflow}"

if ! command -v "$mlflow_bin" >/dev/null 2>&1; then
  echo "server.sh: $mlflow_bin not found: pip install mlflow 'psycopg[binary]' (or set MLFLOW_BIN)" >&2
  exit 2
fi
if [[ "$backend" == sqlite:///* ]]; then
  mkdir -p "$(dirname "${backend#sqlite:///}")"
fi
if [[ "$artifacts" != *://* ]]; then
  mkdir -p "$artifacts"
  artifacts="$(cd "$artifacts" && pwd)"
fi

# The server's background job runner is for MLflow's GenAI features; qrag does not use it, and
# it starts a dozen processes.
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}"

# Never print the backend URI itself: it holds the database password.
echo "server.sh: MLflow tracking server on http://$host:$port (backend store ${backend%%:*}, artifacts $artifacts)"
exec "$mlflow_bin" server \
  --backend-store-uri "$backend" \
  --artifacts-destination "$artifacts" \
  --serve-artifacts \
  --host "$host" \
  --port "$port" \
  --workers "$workers"
