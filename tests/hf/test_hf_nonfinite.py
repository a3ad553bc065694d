"""``PrefixCache`` saves only what the model computed as finite numbers: a row whose forward went
NaN (a model's own bug, as Gemma 2's eager attention over left padding) is cut where it did, so
no later prompt is served its garbage."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvtier.hf import PrefixCache
from tests.hf import tiny
from tests.hf.tiny import left_padded, tiers_config, tiny_model, tokens

POISON_AT = 20  # the first token of the poisoned row whose keys are NaN


class PoisonedOutput:
    """NaN in ``module``'s output for one row of a batch, from a column on, while this is open.

    The forwards of a call cover consecutive columns: the wrapper counts them. It replaces the
    module's forward (a forward hook would make the calls run as plain generate)."""

    def __init__(self, module: torch.nn.Module, row: int, first_column: int) -> None:
        self.module, self.row, self.first_column = module, row, first_column
        self.seen = 0

    def __enter__(self) -> None:
        original = self.module.forward

        def forward(*args, **kwargs):
            output = original(*args, **kwargs)
            columns = output.shape[1]
            poisoned = output.clone()
            start = max(self.first_column - self.seen, 0)
            if start < columns:
                poisoned[self.row, start:] = float("nan")
            self.seen += columns
            return poisoned

        self.module.forward = forward

    def __exit__(self, *exc) -> None:
        del self.module.forward  # the class's forward again


def attention_first_hybrid():
    """A Qwen3-Next whose one full-attention layer comes first: NaNs after it reach only states."""
    config = tiny.config("qwen3_next")
    config.layer_types = ["full_attention", "linear_attention", "linear_attention", "linear_attention"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    model.generation_config.pad_token_id = tiny.PAD
    model.generation_config.eos_token_id = None
    return model


def greedy(fn, prompt: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt])
    return fn(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)


CASES = {  # NaN keys in the last layer (attention) / NaN states after the only attention layer
    "llama": (lambda: tiny_model("llama"), lambda model: model.model.layers[-1].self_attn.k_proj, POISON_AT),
    "qwen3_next": (lambda: tiny_model("qwen3_next"), lambda model: model.model.layers[-1].self_attn.k_proj, 16),
    "states": (attention_first_hybrid, lambda model: model.model.layers[1].linear_attn, 16),
}  # the cut: the first NaN token, or back to the snapshot point before it


@pytest.mark.parametrize("case", CASES)
def test_a_row_that_went_nan_is_saved_only_up_to_where_it_did(case, caplog):
    build, poisoned_module, cut = CASES[case]
    model = build()
    g = torch.Generator().manual_seed(31)
    rows = [tokens(g, n) for n in (40, 33, 47)]
    ids, mask = left_padded(rows)
    with PrefixCache(model, tiers_config(model, blocks=60)) as pc:
        poisoned = PoisonedOutput(poisoned_module(model), 0, ids.shape[1] - len(rows[0]) + POISON_AT)
        with poisoned, caplog.at_level(logging.WARNING, logger="kvtier.hf.prefix_save"):
            pc.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        assert f"row 0 computed NaN or infinite keys, values or states; its tokens from {cut} on" in caplog.text
        assert "row 1" not in caplog.text and "row 2" not in caplog.text
        for i, prompt in enumerate(rows):  # the model healthy again: every answer is plain generate's
            assert torch.equal(greedy(pc.generate, prompt), greedy(model.generate, prompt))
            if i == 0:
                assert pc.last_reused_tokens == [16]  # the whole blocks before the cut
            else:
                assert pc.last_reused_tokens[0] >= 32  # the healthy rows were saved whole (to a snapshot point)


def test_gemma2_nans_over_left_padding_do_not_reach_a_row_sharing_the_prefix():
    """Gemma 2's eager attention turns pad columns into NaNs that reach the real columns of the
    padded rows: plain ``generate`` answers garbage for them. The full-length row sharing their
    system prompt must still get its own answer on the next call."""
    model = tiny_model("gemma2")
    g = torch.Generator().manual_seed(3)
    system = tokens(g, 30)
    rows = [system + tokens(g, 9), system + tokens(g, 17), tokens(g, 12)]
    with PrefixCache(model, tiers_config(model, blocks=40)) as pc:
        ids, mask = left_padded(rows)
        pc.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(greedy(pc.generate, rows[1]), greedy(model.generate, rows[1]))
        assert pc.last_reused_tokens[0] >= 40


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA here"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_all_layers_are_told_finite_at_once_and_anything_else_is_looked_at_column_by_column(dtype, device):
    """The quick test over every layer says "finite" only when every key and value is. Half types
    sum their squares in float32: keys near float16's largest value still pass."""
    from kvtier.hf.prefix_save import _all_finite

    g = torch.Generator().manual_seed(7)
    layers = {i: [torch.randn(2, 3, 40, 8, generator=g).to(device, dtype) + 1.0 for _ in range(2)] for i in range(3)}

    def sources():
        return {i: (keys, values, 0) for i, (keys, values) in layers.items()}

    assert _all_finite(sources())
    layers[1][0][:, :, 5] = 60000.0  # finite in every dtype here; its 2-norm is not, in float16
    assert _all_finite(sources())
    for bad in (float("nan"), float("inf"), -float("inf")):
        values = layers[2][1]
        saved = values[1, 2, 39, 7].clone()
        values[1, 2, 39, 7] = bad
        assert not _all_finite(sources())
        values[1, 2, 39, 7] = saved
    assert _all_finite({})
