#!/usr/bin/env bash
# The one command for a lent GPU machine (no network there): install the few pure-Python wheels the engine needs
# that the machine's image lacks (carried in .whl/, see tests/gpu/README.md), then run the whole check into $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "${OUT:-/tmp}/nvidia-smi.csv" 2>&1
python3 tests/gpu/gpu_check.py --out "${OUT:-/tmp/gpu-check}" --budget-s "${BUDGET_S:-420}" 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
