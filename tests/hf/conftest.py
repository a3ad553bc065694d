"""The transformers tests run their tiny models on one thread: many small kernels, where a second
thread only adds synchronisation (ten times slower on a busy two-core machine)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
