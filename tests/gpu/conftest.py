"""GPU tests: every test here is skipped cleanly where CUDA is not available.

Test modules in this folder import GPU-only packages (cuda-bindings, NVML) inside the tests,
never at module level, so that collection works on a machine without them.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
