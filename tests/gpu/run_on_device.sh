#!/usr/bin/env bash
# The one command for a lent GPU machine (no network there): install the few pure-Python wheels the engine needs
# that the machine's image lacks (carried in .whl/, see tests/gpu/README.md), then run the whole check into $OUT.
# The check stops itself at BUDGET_S (seconds, default 255: the ladder's need_s, 250, fits); a SIGINT at LIMIT_S
# (default 280) stops it from outside if a section overruns, and it still writes what it has: with the wheels'
# install and the kill's grace, under a call of 300 s, so the script's own stop comes before the caller's.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
if ! python3 -c "import platformdirs" 2>/dev/null; then
  echo "platformdirs is missing on this machine: carry .whl/ (see tests/gpu/README.md)" | tee "$OUT/gpu_check.log"
  exit 3
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export GAPLESS_CACHE_DIR="${GAPLESS_CACHE_DIR:-/tmp/gapless-cache}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia-smi.csv" 2>&1
timeout -s INT -k 8 "${LIMIT_S:-280}" python3 tests/gpu/gpu_check.py --out "$OUT" --budget-s "${BUDGET_S:-255}" "$@" 2>&1 \
  | tee "$OUT/gpu_check.log"
