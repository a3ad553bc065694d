"""PEFT adapters (LoRA) on a ``PrefixCache``'s model: pages computed with one adapter active are
never served with another, or with none (``kvtier.hf.adapters``); every call gives ``generate``'s
tokens."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import CacheStateError
from kvtier.hf import PrefixCache
from tests.hf.tiny import tiers_config, tiny_model, tokens

peft = pytest.importorskip("peft")


def train_in_place(model, step: float) -> None:
    """A training step on the LoRA ``B`` matrices, in place (as an optimizer writes them)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.add_(step)


def lora(seed: int) -> peft.LoraConfig:
    torch.manual_seed(seed)
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)


def two_adapters(arch: str = "llama", seeds: tuple[int, int] = (1, 2)):
    """A PEFT model of a tiny ``arch`` with LoRA adapters "first" (active) and "second", in eval mode."""
    model = peft.get_peft_model(tiny_model(arch), lora(seeds[0]), adapter_name="first")
    model.add_adapter("second", lora(seeds[1]))
    model.eval()
    return model


def both(model, pc: PrefixCache, prompt: list[int]) -> int:
    """One call through both paths (the same tokens); the tokens it reused."""
    ids = torch.tensor([prompt])
    expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    got = pc.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(got, expected), f"reused {pc.last_reused_tokens}"
    return pc.last_reused_tokens[0]


def test_each_adapter_and_the_base_model_reuse_only_their_own_pages(tmp_path):
    model = two_adapters()
    prompt = tokens(torch.Generator().manual_seed(3), 40)
    config = tiers_config(model.base_model.model, blocks=60, disk_blocks=200, disk_path=tmp_path)
    with PrefixCache(model, config) as pc:
        model.set_adapter("first")
        assert both(model, pc, prompt) == 0
        model.set_adapter("second")
        assert both(model, pc, prompt) == 0  # not the first adapter's pages
        with model.disable_adapter():
            assert both(model, pc, prompt) == 0  # nor either adapter's for the base model
            assert both(model, pc, [*prompt, 5]) == 40
        model.set_adapter("first")
        assert both(model, pc, [*prompt, 6]) == 40
    with PrefixCache(model, config) as pc:  # a restart: the same adapter is the same scope
        model.set_adapter("second")
        assert both(model, pc, [*prompt, 7]) == 40


def test_a_merged_adapter_is_a_scope_of_its_own_whichever_is_active():
    """PEFT's forward runs a merged layer's base weights alone: merging "second" while "first" is
    active applies "second". Before, such calls saved their pages under "first", and a call with
    "first" after ``unmerge_adapter()`` was served them (scores off by 0.53)."""
    model = two_adapters()
    prompt = tokens(torch.Generator().manual_seed(3), 40)
    with PrefixCache(model, tiers_config(model.base_model.model, blocks=200)) as pc:
        model.set_adapter("first")
        model.base_model.merge_adapter(["second"])
        assert both(model, pc, [*prompt, 4]) == 0
        assert both(model, pc, [*prompt, 5]) == 40  # the merged adapter's own pages
        model.base_model.unmerge_adapter()
        assert both(model, pc, [*prompt, 6]) == 0  # "first" applied: not the merged "second"'s pages
        model.set_adapter("second")
        assert both(model, pc, [*prompt, 7]) == 0  # "second" beside the base weights: other roundings
        model.base_model.merge_adapter(["second"])
        assert both(model, pc, [*prompt, 8]) == 0  # the unmerge left other base weights (a rounding off)
        assert both(model, pc, [*prompt, 9]) == 40
        model.base_model.unmerge_adapter()


def test_an_adapter_added_after_construction_and_one_trained_in_between_get_scopes_of_their_own():
    base = tiny_model("llama")
    prompt = tokens(torch.Generator().manual_seed(4), 40)
    with PrefixCache(base, tiers_config(base, blocks=60)) as pc:
        assert both(base, pc, prompt) == 0
        peft.inject_adapter_in_model(lora(5), base, adapter_name="late")  # new layers, active at once
        assert both(base, pc, [*prompt, 1]) == 0  # not the base model's pages
        assert both(base, pc, [*prompt, 2]) == 40
        with torch.no_grad():  # a training step on the adapter
            for name, param in base.named_parameters():
                if "lora_B" in name:
                    param.add_(0.05)
        assert both(base, pc, [*prompt, 3]) == 0
        for module in base.modules():
            if isinstance(module, peft.tuners.tuners_utils.BaseTunerLayer):
                module.enable_adapters(False)
        assert both(base, pc, [*prompt, 4]) == 40  # the base model's pages again


def test_training_an_adapter_present_at_construction_is_a_weight_change():
    model = peft.get_peft_model(tiny_model("llama"), lora(6), adapter_name="only")
    model.eval()
    prompt = tokens(torch.Generator().manual_seed(5), 30)
    with PrefixCache(model, tiers_config(model.base_model.model, blocks=60)) as pc:
        both(model, pc, prompt)
        with torch.no_grad():
            next(p for n, p in model.named_parameters() if "lora_A" in n).mul_(1.5)
        with pytest.raises(CacheStateError, match="weights changed"):
            pc.generate(torch.tensor([prompt]), max_new_tokens=2)


def per_row(model, pc: PrefixCache, ids: torch.Tensor, names: list[str]) -> list[int]:
    """One call of a batch with an adapter per row through both paths (the same tokens); the tokens
    each row reused."""
    mask = torch.ones_like(ids)
    expected = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, adapter_names=names
    )
    got = pc.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, adapter_names=names)
    assert torch.equal(got, expected), f"reused {pc.last_reused_tokens}"
    return pc.last_reused_tokens


def test_a_batch_with_an_adapter_per_row_reuses_each_rows_own_pages():
    model = two_adapters(seeds=(7, 8))
    g = torch.Generator().manual_seed(6)
    shared = tokens(g, 32)
    rows = [[*shared, *tokens(g, 4)] for _ in range(3)]
    ids = torch.tensor(rows)
    mask = torch.ones_like(ids)
    with PrefixCache(model, tiers_config(model.base_model.model, blocks=80)) as pc:
        calls = ((["first", "second", "__base__"], [0, 0, 0]), (["second", "__base__", "first"], [32] * 3))
        for names, reused in calls:
            assert per_row(model, pc, ids, names) == reused
        with pytest.raises(ValueError, match="one adapter per batch row"):
            pc.generate(ids, attention_mask=mask, max_new_tokens=3, adapter_names=["first"])


def test_after_unload_the_adapters_pages_are_not_served_to_the_base_model():
    """Before: ``unload()`` took the LoRA layers out of the model but left ``peft_config`` as it was;
    the scope still listed the removed layers, active, so the adapter's pages were served to the
    base model: other tokens than ``generate``'s."""
    model = peft.get_peft_model(tiny_model("llama"), lora(6))
    model.eval()
    prompt = tokens(torch.Generator().manual_seed(7), 40)
    with PrefixCache(model, tiers_config(model.base_model.model, blocks=60)) as pc:
        assert both(model, pc, prompt) == 0
        assert both(model, pc, [*prompt, 1]) == 40  # the adapter's own pages
        base = model.unload()
        assert both(base, pc, [*prompt, 2]) == 0  # not the adapter's pages
        assert both(base, pc, [*prompt, 3]) == 40  # the base model's own


@pytest.mark.parametrize("built_on", ["base", "adapter"])
def test_an_adapter_merged_into_the_weights_after_a_call_saw_it_is_a_weight_change(built_on):
    """PEFT's ``merge_and_unload()`` adds the adapter into the base weights through ``.data``, which
    no version counter sees. Before, the next call was served the pages of the weights before the
    merge (scores off by 0.45). Now it is a weight change: ``CacheStateError``. A plain ``unload()``
    changes no weight and still serves the base model's pages."""
    base = tiny_model("llama")
    prompt = tokens(torch.Generator().manual_seed(8), 40)
    pc = PrefixCache(base, tiers_config(base, blocks=60))
    if built_on == "base":
        assert both(base, pc, prompt) == 0  # the base model's pages
    model = peft.get_peft_model(base, lora(9))
    model.eval()
    assert both(model, pc, [*prompt, 1]) == 0  # the adapter is seen by a call
    merged = model.merge_and_unload()
    with pytest.raises(CacheStateError, match="adapter merged"):
        pc.generate(torch.tensor([[*prompt, 2]]), max_new_tokens=2)
    pc.close()
    again = tiny_model("llama")  # the same weights: unloaded, not merged
    pc = PrefixCache(again, tiers_config(again, blocks=60))
    assert both(again, pc, prompt) == 0
    unmerged = peft.get_peft_model(again, lora(9))
    unmerged.eval()
    assert both(unmerged, pc, [*prompt, 1]) == 0
    plain = unmerged.unload()
    assert both(plain, pc, [*prompt, 2]) == 40
    pc.close()
    assert merged is base


@pytest.mark.parametrize(
    "config",
    [
        peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5),
        peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5),
        peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=5, encoder_hidden_size=16),
    ],
    ids=["prefix", "prompt", "p-tuning"],
)
def test_prompt_learning_adapters_are_refused_by_name(config):
    """They feed virtual tokens of their own. Before: prefix tuning was refused for a cache left
    unwritten (``TypeError`` from the padding probe before that), prompt tuning for the positions
    its virtual tokens add, naming neither."""
    model = peft.get_peft_model(tiny_model("llama"), config)
    model.eval()
    with pytest.raises(NotImplementedError, match=rf"prompt-learning adapter: 'default' \({config.peft_type.value}\)"):
        PrefixCache(model, tiers_config(model.get_base_model(), blocks=20))


def test_a_peft_model_is_given_its_cache_by_the_name_the_wrapped_model_takes(recwarn):
    """A PEFT model's forward takes ``**kwargs``; the model it wraps names its cache ``cache``.
    Before, kvtier passed ``past_key_values``: a FutureWarning on every forward (transformers 5.25
    drops the name from ``forward`` in 5.40, when the cache would no longer reach the model)."""
    model = peft.get_peft_model(tiny_model("llama"), lora(6))
    model.eval()
    prompt = tokens(torch.Generator().manual_seed(5), 40)
    with PrefixCache(model, tiers_config(model.get_base_model(), blocks=60)) as pc:
        assert both(model, pc, prompt) == 0
        assert both(model, pc, [*prompt, 1]) == 40
    assert not [w for w in recwarn if "past_key_values" in str(w.message)]


@pytest.mark.parametrize("arch", ["qwen3_next", "falcon_h1"])
def test_a_peft_model_of_a_hybrid_model_records_the_states_generate_computes(arch):
    """PEFT's ``generate`` runs the wrapped model's forwards: the recurrent states' recorder hooks it
    there. Before, it hooked the PEFT model and saw none of them: a call whose decoding passed a
    snapshot point (32 here) raised ``InvariantError`` ("no state was recorded at snapshot
    point"), its output lost."""
    model = peft.get_peft_model(tiny_model(arch), lora(8))
    model.eval()
    prompt = tokens(torch.Generator().manual_seed(6), 30)
    with PrefixCache(model, tiers_config(model.get_base_model(), blocks=60)) as pc:
        ids = torch.tensor([prompt])
        first = pc.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        assert torch.equal(first, expected)
        assert both(model, pc, [*first[0].tolist(), 1]) == 32  # the state decoding passed at 32


def test_per_row_adapters_of_a_hybrid_model_compute_the_snapshots_with_each_rows_adapter():
    """The prompt's stretches up to the recurrent snapshots run with ``adapter_names`` too."""
    model = two_adapters("qwen3_next")
    g = torch.Generator().manual_seed(9)
    prompt = tokens(g, 40)
    with PrefixCache(model, tiers_config(model.get_base_model(), blocks=120)) as pc:
        for names, tail in ((["first", "second"], 5), (["second", "first"], 6)):
            reused = per_row(model, pc, torch.tensor([[*prompt, tail], [*prompt, tail + 1]]), names)
        assert min(reused) >= 32  # each row's adapter's pages, saved by the first call


def test_a_peft_models_prompt_forward_is_timed(tmp_path):
    """``recompute_when_faster`` times generate's prompt forward, on the wrapped model. Before, the
    hook sat on the PEFT model and no rate was ever measured."""
    model = peft.get_peft_model(tiny_model("llama"), lora(7))
    model.eval()
    config = tiers_config(model.get_base_model(), blocks=200, disk_blocks=400, disk_path=tmp_path)
    with PrefixCache(model, config, recompute_when_faster=True) as pc:
        both(model, pc, tokens(torch.Generator().manual_seed(2), 300))
    with PrefixCache(model, config) as pc:
        assert pc.manager.remembered_prefill_rate is not None


def test_the_model_of_a_prefix_cache_cannot_be_replaced():
    """Before, ``pc.model = other`` was taken, and the other model was served the first one's pages."""
    first = tiny_model("llama")
    with PrefixCache(first, tiers_config(first, blocks=40)) as pc:
        with pytest.raises(AttributeError):
            pc.model = tiny_model("llama", seed=1)
        assert pc.model is first


def test_rows_named_inside_disable_adapter_are_the_base_models():
    """PEFT's layers run their base alone while adapters are disabled, whatever ``adapter_names``
    names. Before, such rows were saved under the named adapters' scopes: a later call with the
    adapter active was served the base model's pages (other tokens than ``generate``'s)."""
    model = peft.get_peft_model(tiny_model("llama"), lora(3), adapter_name="first")
    model.eval()
    prompt = tokens(torch.Generator().manual_seed(8), 40)
    with PrefixCache(model, tiers_config(model.get_base_model(), blocks=120)) as pc:
        with model.disable_adapter():
            per_row(model, pc, torch.tensor([[*prompt, 1], [*prompt, 2]]), ["first", "__base__"])
            assert both(model, pc, [*prompt, 3]) == 40  # the base model's pages, both rows'
        assert both(model, pc, [*prompt, 4]) == 0  # "first" active: none of them


def test_an_adapter_added_again_under_its_name_on_other_modules_gets_a_scope_of_its_own():
    """Before, its new layers were never listed (the names in ``peft_config`` were the same): the
    call ran under the base model's scope and was served its pages."""
    model = two_adapters()
    prompt = tokens(torch.Generator().manual_seed(9), 40)
    with PrefixCache(model, tiers_config(model.get_base_model(), blocks=120)) as pc:
        with model.disable_adapter():
            assert both(model, pc, prompt) == 0
        model.delete_adapter("second")
        torch.manual_seed(4)
        model.add_adapter(
            "second", peft.LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"], init_lora_weights=False)
        )
        model.set_adapter("second")
        model.eval()
        assert both(model, pc, [*prompt, 1]) == 0  # not the base model's pages
        assert both(model, pc, [*prompt, 2]) == 40  # its own


def test_an_unmerge_that_leaves_other_base_weights_starts_their_own_scope_without_an_error():
    """``unmerge_adapter`` subtracts the delta through ``.data``: ``W + d - d`` is a rounding off
    ``W``. Before, that went unseen until an adapter was added or deleted, and then every call
    raised ``CacheStateError`` blaming a merge no longer there."""
    model = peft.get_peft_model(tiny_model("llama"), lora(1), adapter_name="first")
    model.eval()
    prompt = tokens(torch.Generator().manual_seed(4), 40)
    with PrefixCache(model, tiers_config(model.base_model.model, blocks=200)) as pc:
        with model.disable_adapter():
            assert both(model, pc, prompt) == 0
        model.base_model.merge_adapter()
        assert both(model, pc, [*prompt, 1]) == 0
        model.base_model.unmerge_adapter()
        with model.disable_adapter():
            assert both(model, pc, [*prompt, 2]) == 0  # not the pages of the weights before the merge
            assert both(model, pc, [*prompt, 3]) == 40  # the new weights' own
        model.add_adapter("second", lora(2))
        with model.disable_adapter():
            assert both(model, pc, [*prompt, 4]) == 40
        model.set_adapter("second")
        assert both(model, pc, [*prompt, 5]) == 0


def test_base_pages_are_not_served_after_an_adapter_was_trained_while_merged_then_unmerged():
    """Unmerging subtracts the trained delta, not the one merged: the base weights change through
    ``.data``. Before, the base model's earlier pages were served (scores off by 0.58)."""
    base = tiny_model("llama")
    prompt = tokens(torch.Generator().manual_seed(3), 40)
    with PrefixCache(base, tiers_config(base, blocks=60)) as pc:
        assert both(base, pc, prompt) == 0
        model = peft.get_peft_model(base, lora(5))
        model.eval()
        assert both(model, pc, [*prompt, 4]) == 0
        model.base_model.merge_adapter()
        assert both(model, pc, [*prompt, 5]) == 0
        train_in_place(model, 0.05)
        model.base_model.unmerge_adapter()
        with model.disable_adapter():
            assert both(model, pc, [*prompt, 6]) == 0


def kvtier_first(model, pc: PrefixCache, prompt: list[int]) -> int:
    """``both`` with the PrefixCache's call first (it sees the model as the user left it)."""
    ids = torch.tensor([prompt])
    got = pc.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(got, expected), f"reused {pc.last_reused_tokens}"
    return pc.last_reused_tokens[0]


def test_a_call_inside_disable_adapter_over_a_merged_adapter_reuses_and_saves_nothing():
    """PEFT undoes the merge inside that call's forward, subtracting the delta as it is then: after
    training while merged the base weights change during the call. Before, the call reused the
    base model's earlier pages (scores 0.49 off) and saved its own under their scope."""
    base = tiny_model("llama")
    prompt = tokens(torch.Generator().manual_seed(5), 40)
    with PrefixCache(base, tiers_config(base, blocks=200)) as pc:
        assert kvtier_first(base, pc, prompt) == 0
        model = peft.get_peft_model(base, lora(6))  # added after construction: trained unwatched
        model.eval()
        model.base_model.merge_adapter()
        assert kvtier_first(model, pc, [*prompt, 1]) == 0
        train_in_place(model, 0.5)
        with model.disable_adapter():
            assert kvtier_first(model, pc, [*prompt, 2]) == 0  # unmerged during the call: plain
            assert kvtier_first(model, pc, [*prompt, 3]) == 0  # the new weights: none of the old ones' pages
            assert kvtier_first(model, pc, [*prompt, 4]) == 40


def test_unload_after_an_unmerge_no_call_saw_is_no_merge():
    """``unmerge_adapter`` then ``unload()`` with no call between: the base layers leave a rounding
    off the weights before the merge. Before, that was taken for a merge for good: every later
    call raised ``CacheStateError``."""
    model = peft.get_peft_model(tiny_model("llama"), lora(7))
    model.eval()
    prompt = tokens(torch.Generator().manual_seed(6), 40)
    with PrefixCache(model, tiers_config(model.base_model.model, blocks=200)) as pc:
        model.base_model.merge_adapter()
        assert kvtier_first(model, pc, prompt) == 0
        model.base_model.unmerge_adapter()
        base = model.unload()
        assert kvtier_first(base, pc, [*prompt, 1]) == 0
        assert kvtier_first(base, pc, [*prompt, 2]) == 40
