#!/usr/bin/env bash
# The GPU tier in one call of the device machine (see tests/gpu/README.md):
#   device run, carry [".whl"]:  bash tests/gpu/run.sh
# Installs the packages the device image lacks from the wheels in .whl/ (built here by `make gpu-wheels`), never
# torch (the image's CUDA build stays), then runs every tier-A case and writes the tier's JSON to $OUT/gpu.json
# (bench/results/gpu.json when $OUT is unset). Tier A needs no Ray: tests/gpu/cases.py --block-ray proves it.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-bench/results}"
mkdir -p "$out"
start=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "[gpu tier] wheel install failed"; exit 2; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 DS_ACCELERATOR="${DS_ACCELERATOR:-cuda}" TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c 'import torch, deepspeed, pydantic; print("[gpu tier] torch", torch.__version__, "cuda", torch.version.cuda, "deepspeed", deepspeed.__version__)' || exit 2
GPU_TIER_CASE_TIMEOUT_S="${GPU_TIER_CASE_TIMEOUT_S:-150}" python3 tests/gpu/cases.py --block-ray --budget-s "${GPU_TIER_BUDGET_S:-300}" --out "$out/gpu.json" --keep "$out/logs" "$@"
code=$?
# Logs come back as one archive (the device returns at most 8 files, two folders down).
tar -czf "$out/gpu-logs.tar.gz" -C "$out" logs 2>/dev/null && rm -rf "$out/logs"
echo "[gpu tier] exit $code after $(( $(date +%s) - start )) s"
exit $code
