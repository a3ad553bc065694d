#!/usr/bin/env bash
# One GPU session on the device machine, from the source tree: e2e bench, demo on CUDA, GPU tests.
# Usage: OUT=/some/dir bash scripts/h200_run.sh [e2e] [demo] [tests] [copy]  (default: all but copy)
set -uo pipefail
export PYTHONPATH=.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kvtier-out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(e2e demo tests)
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for step in "${steps[@]}"; do
    echo "=== $step ($(date -u +%H:%M:%S))"
    case $step in
        e2e) python3 -m kvtier bench e2e --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.log" ;;
        demo) python3 -m kvtier demo --device cuda --dtype bfloat16 --json "$OUT/demo_gpu.json" \
                  --plot "$OUT/demo_gpu.png" 2>&1 | tail -n 30 | tee "$OUT/demo_gpu.log" ;;
        tests) timeout 300 python3 -m pytest -q -x tests/gpu 2>&1 | tail -n 25 | tee "$OUT/gpu_tests.log" ;;
        copy) python3 -m kvtier bench copy --json "$OUT/copy.json" 2>&1 | tail -n 40 | tee "$OUT/copy.log" ;;
        probe) python3 -m kvtier probe 2>&1 | tee "$OUT/probe.log" ;;
    esac
done
echo "=== done ($(date -u +%H:%M:%S))"
