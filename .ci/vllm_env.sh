#!/usr/bin/env bash
# The environment of the vLLM connector's tests (tests/vllm): a vLLM release kvtier supports (the
# argument: 0.34.0, the default, in .venv-vllm; or 0.33.0, in .venv-vllm-0.33) without its GPU
# dependencies, seeing the base environment's CPU torch and the kvtier package. vLLM is installed
# with --no-deps, then the packages that its config, scheduler, connector and worker modules
# import and the transformers release it asks for, with torch pinned to the base build so nothing
# pulls a CUDA one.
# Idempotent: returns at once when the environment is complete.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=${1:-0.34.0}
case "$VLLM_VERSION" in
    0.34.*) VENV=.venv-vllm ;;
    0.33.*) VENV=.venv-vllm-0.33 ;;
    *) echo "kvtier supports vLLM 0.33 and 0.34, not $VLLM_VERSION" >&2; exit 2 ;;
esac
DEPS=(psutil pyzmq cbor2 aiohttp openai-harmony openai pybase64 cachetools msgspec uvloop
      xgrammar fastapi partial-json-parser llguidance einops)
TORCH_VERSION=$(python3 -c 'import torch; print(torch.__version__)')
# vLLM's requirement on transformers, from its metadata ("transformers<5.23.0,>=5.16.1")
WANTED_TRANSFORMERS='import importlib.metadata as m
from packaging.requirements import Requirement
print("transformers" + next(str(q.specifier) for q in map(Requirement, m.requires("vllm")) if q.name == "transformers"))'

complete() {
    "$VENV/bin/python" - "$TORCH_VERSION" "$VLLM_VERSION" >/dev/null 2>&1 <<'PY'
import sys
import torch
import vllm.config, vllm.v1.core.sched.scheduler, vllm.v1.worker.utils
import vllm.distributed.kv_transfer.kv_connector.v1.base
import kvtier.vllm
import importlib.metadata, transformers
from packaging.requirements import Requirement
assert torch.__version__ == sys.argv[1], torch.__version__
assert vllm.__version__ == sys.argv[2], vllm.__version__
wanted = next(q for q in map(Requirement, importlib.metadata.requires("vllm")) if q.name == "transformers")
assert transformers.__version__ in wanted.specifier, (transformers.__version__, str(wanted))
PY
}

if [ -x "$VENV/bin/python" ] && complete; then
    exit 0
fi
python3 -m venv --system-site-packages "$VENV"
"$VENV/bin/pip" install --quiet --no-deps "vllm==$VLLM_VERSION"
PIN=$(mktemp)
trap 'rm -f "$PIN"' EXIT
echo "torch==$TORCH_VERSION" >"$PIN"
# pip lists vLLM's own pins (torch, xgrammar) as conflicts here: expected, unused on the CPU
"$VENV/bin/pip" install --quiet -c "$PIN" "${DEPS[@]}"
# the transformers this vLLM release asks for (a user's vLLM has it), not the base environment's newer one
"$VENV/bin/pip" install --quiet -c "$PIN" "$("$VENV/bin/python" -c "$WANTED_TRANSFORMERS")"
if ! complete; then
    echo "the vLLM test environment is incomplete; the import that fails:" >&2
    "$VENV/bin/python" -c "import vllm.v1.core.sched.scheduler, vllm.v1.worker.utils, kvtier.vllm" >&2
    exit 1
fi
