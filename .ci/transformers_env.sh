#!/usr/bin/env bash
# The environment of kvtier.hf's tests on the oldest transformers release kvtier accepts (the floor
# of the hf extra in pyproject.toml, its latest patch), in .venv-transformers-floor: a virtual
# environment that sees the base environment's CPU torch and the kvtier package, with that
# transformers and the hub client it asks for. Idempotent: returns at once when it is complete.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-transformers-floor
FLOOR=$(python3 -c 'import re, tomllib; extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["hf"]; print(re.search(r"transformers>=([0-9.]+)", " ".join(extra)).group(1))')
TORCH_VERSION=$(python3 -c 'import torch; print(torch.__version__)')

complete() {
    "$VENV/bin/python" - "$TORCH_VERSION" "$FLOOR" >/dev/null 2>&1 <<'PY'
import sys
import torch
import transformers
import kvtier.hf
assert torch.__version__ == sys.argv[1], torch.__version__
floor = sys.argv[2].split(".")
assert transformers.__version__.split(".")[:2] == floor[:2], transformers.__version__
PY
}

if [ -x "$VENV/bin/python" ] && complete; then
    exit 0
fi
python3 -m venv --system-site-packages "$VENV"
PIN=$(mktemp)
trap 'rm -f "$PIN"' EXIT
echo "torch==$TORCH_VERSION" >"$PIN"
# the floor's latest patch: "5.17" -> 5.17.*; a floor naming a patch ("5.17.1") -> up to the next minor
case "$FLOOR" in
    *.*.*) WANTED="transformers>=$FLOOR,<${FLOOR%.*}.999" ;;
    *) WANTED="transformers==$FLOOR.*" ;;
esac
"$VENV/bin/pip" install --quiet -c "$PIN" "$WANTED"
if ! complete; then
    echo "the transformers $FLOOR test environment is incomplete; the import that fails:" >&2
    "$VENV/bin/python" -c "import transformers, kvtier.hf" >&2
    exit 1
fi
