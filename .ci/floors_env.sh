#!/usr/bin/env bash
# The environment of the suite on the oldest release of every dependency that pyproject.toml accepts
# (its ">=" floors: the package's own, and the gpu, redis and bench extras'), in .venv-floors, so
# that a floor stated there is one the tests ran on. torch stays the base environment's CPU build:
# its floor (2.5) is a CUDA build of several GB on PyPI, checked by hand (docs/benchmarks.md
# section 56). cuda-bindings and nvidia-ml-py only serve a GPU. Idempotent: returns at once when
# the environment is complete.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-floors
TORCH_VERSION=$(python3 -c 'import torch; print(torch.__version__.split("+")[0])')
PINS=$(python3 - <<'PY'
import re
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
skipped = {"torch", "cuda-bindings", "nvidia-ml-py"}
pins = {}
for requirement in [*project["dependencies"], *extras["gpu"], *extras["redis"], *extras["bench"]]:
    name = re.match(r"[A-Za-z0-9_.-]+", requirement).group()
    if name not in skipped:
        pins[name] = re.fullmatch(rf"{re.escape(name)}>=([0-9.]+)", requirement).group(1)
print(" ".join(f"{name}=={floor}" for name, floor in sorted(pins.items())))
PY
)

complete() {
    "$VENV/bin/python" - "$PINS" >/dev/null 2>&1 <<'PY'
import sys
from importlib.metadata import version

import kvtier  # noqa: F401


def release(text: str) -> list[int]:
    """A plain release number without its trailing zeros ("13" and "13.0.0" alike)."""
    parts = [int(part) for part in text.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return parts


for pin in sys.argv[1].split():
    name, wanted = pin.split("==")
    assert release(version(name)) == release(wanted), (name, version(name))
PY
}

if [ -x "$VENV/bin/python" ] && complete; then
    exit 0
fi
python3 -m venv "$VENV"
# shellcheck disable=SC2086
"$VENV/bin/pip" install --quiet "torch==$TORCH_VERSION" $PINS pytest pytest-timeout hypothesis
"$VENV/bin/pip" install --quiet --no-deps -e .
if ! complete; then
    echo "the dependency floors' test environment is incomplete ($PINS)" >&2
    exit 1
fi
