#!/usr/bin/env bash
# One GPU session on the device machine, from the source tree: each step named runs in turn, each
# under its own time limit, its log under $OUT.
# Usage: OUT=/some/dir bash scripts/h200_run.sh [step ...]   (default: tests planning demo; a device call
# runs at most 10 minutes: name steps whose limits below add up to less)
#   tests     tests/gpu, the transformers GPU test and the CPU-suite files whose paths change on CUDA
#   planning  scripts/pressure_planning.py (issue 14's 2 ms target for planning a 2,048-page resume)
#   copy      kvtier bench copy (copy paths idle and under load, host submit costs)
#   e2e       kvtier bench e2e at a 32K prefix, one repeat (the host-full and queued cases included)
#   demo      kvtier demo on CUDA
#   probe     kvtier probe
#   soak      scripts/gpu_soak.py for 240 s (property machines, churn with a restart, the engine against its oracle)
#   nobindings  scripts/copy_without_bindings.py (scattered pages without cuda-bindings: kernel against torch copies)
set -uo pipefail
export PYTHONPATH=.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kvtier-out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests planning demo)
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
parallel=()
python3 -c "import xdist" 2>/dev/null && parallel=(-n 4 --dist loadfile)
for step in "${steps[@]}"; do
    echo "=== $step ($(date -u +%H:%M:%S))"
    case $step in
        tests) timeout 300 python3 -m pytest -q -p no:cacheprovider "${parallel[@]}" tests/gpu tests/hf/test_hf_gpu.py \
                   tests/test_copy_submit.py tests/test_vllm_transfer.py tests/test_swap_scratch.py \
                   tests/test_write_through.py tests/test_host_prefetch.py tests/test_engine_prefetch.py \
                   2>&1 | tee "$OUT/gpu_tests.log" | tail -n 30 ;;
        planning) timeout 60 python3 scripts/pressure_planning.py --seeds 3 2>&1 | tee "$OUT/planning.log" ;;
        copy) timeout 240 python3 -m kvtier bench copy --json "$OUT/copy.json" 2>&1 | tee "$OUT/copy.log" | tail -n 60 ;;
        e2e) timeout 300 python3 -m kvtier bench e2e --prefixes 32768 --repeats 1 --json "$OUT/e2e.json" 2>&1 \
                 | tee "$OUT/e2e.log" | tail -n 30 ;;
        demo) timeout 180 python3 -m kvtier demo --device cuda --dtype bfloat16 --json "$OUT/demo_gpu.json" \
                  --plot "$OUT/demo_gpu.png" 2>&1 | tee "$OUT/demo_gpu.log" | tail -n 30 ;;
        probe) timeout 120 python3 -m kvtier probe 2>&1 | tee "$OUT/probe.log" ;;
        soak) timeout 300 python3 scripts/gpu_soak.py --seconds 240 > "$OUT/soak.log" 2>&1; echo "soak rc=$?"
              grep -A3 "^FAIL" "$OUT/soak.log" | head -n 40; tail -n 4 "$OUT/soak.log" ;;
        nobindings) timeout 200 python3 scripts/copy_without_bindings.py 2>&1 | tee "$OUT/no_bindings.log" | tail -n 40 ;;
        *) echo "unknown step: $step (tests, planning, copy, e2e, demo, probe, soak, nobindings)" >&2; exit 2 ;;
    esac
done
echo "=== done ($(date -u +%H:%M:%S))"
