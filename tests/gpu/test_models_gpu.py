"""The paged forward on a CUDA device (skipped without one): exact in float64, close in bf16."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtier.models import LayerKind, build_model, named_config
from kvtier.models.random_init import random_model
from tests.test_paged_attention import MODELS, PagePool, Request, paged_generate, paged_prefill, prompt_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("name", MODELS)
def test_float64_paged_generation_matches_reference_on_cuda(name: str) -> None:
    model = build_model(name, "cuda", torch.float64, seed=1)
    prompt = prompt_of(140, seed=3, vocab=model.vocab_size)
    tokens, logits = paged_generate(model, Request(PagePool(model, 16)), prompt, 16, [50, 7, 64])
    assert tokens == model.reference_generate(prompt, 16)
    torch.testing.assert_close(logits, model.forward_dense(torch.tensor(prompt)), rtol=0, atol=1e-10)


def test_float64_weights_match_across_devices() -> None:
    cpu = build_model("tiny-hybrid", "cpu", torch.float64, seed=4)
    cuda = build_model("tiny-hybrid", "cuda", torch.float64, seed=4)
    for (key, a), b in zip(cpu.state_dict().items(), cuda.state_dict().values(), strict=True):
        assert torch.equal(a, b.cpu()), key


def test_llama_8b_shaped_layers_in_bf16() -> None:
    """Two layers of Llama-3-8B size in bf16: a cached 4K prefix (three chunks) plus a suffix
    through the pages gives the dense forward's logits, up to bf16 rounding."""
    config = dataclasses.replace(named_config("llama-8b-shape"), layer_kinds=(LayerKind.FULL_ATTENTION,) * 2)
    model = random_model(config, torch.device("cuda"), torch.bfloat16, seed=0)
    prompt = prompt_of(4096 + 100, seed=5, vocab=model.vocab_size)
    paged = paged_prefill(model, Request(PagePool(model, 32, num_slots=160)), prompt, [1500, 1500, 1096, 100])
    dense = model.forward_dense(torch.tensor(prompt, device="cuda"))
    assert torch.isfinite(paged).all() and torch.isfinite(dense).all()
    error = (paged.float() - dense.float()).norm() / dense.float().norm()
    assert error < 0.02
    assert (paged.argmax(-1) == dense.argmax(-1)).float().mean() > 0.95
