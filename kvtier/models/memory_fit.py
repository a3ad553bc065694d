"""A model's weights against the memory of the device they are to live on."""

from __future__ import annotations

import torch

from kvtier.config import check_fits_in_memory


def check_weights_fit(model: torch.nn.Module, device: torch.device | str, dtype: torch.dtype) -> None:
    """``ValueError`` when ``model``'s parameters (built on the meta device: nothing allocated yet)
    take more bytes in ``dtype`` than all the memory of ``device``."""
    nbytes = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    what = f"the model's weights ({nbytes / 2**30:.1f} GiB in {dtype})"
    check_fits_in_memory(what, nbytes, torch.device(device), "choose a smaller model or dtype")
