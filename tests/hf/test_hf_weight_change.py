"""Weights changed in place under a ``PrefixCache`` (a training loop that generates between
optimizer steps) are noticed: ``generate`` refuses to serve pages of the old weights."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers

from kvtier.errors import CacheStateError
from kvtier.hf import PrefixCache
from kvtier.weights import weights_fingerprint
from tests.hf.tiny import PAD, TINY_TEXT, tiers_config, tiny_model, tokens

ROOT = Path(__file__).resolve().parents[2]


def greedy(fn, prompt: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt])
    return fn(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)


def optimizer_step(model) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.arange(3, 40).reshape(1, -1)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("model_id", [None, "my-checkpoint"])
def test_an_optimizer_step_makes_generate_refuse_and_a_new_prefix_cache_serves_the_new_weights(model_id):
    model = tiny_model("llama")
    prompt = tokens(torch.Generator().manual_seed(5), 40)
    pc = PrefixCache(model, tiers_config(model, blocks=20), model_id=model_id)
    greedy(pc.generate, prompt)
    assert torch.equal(greedy(pc.generate, prompt), greedy(model.generate, prompt))
    optimizer_step(model)
    with pytest.raises(CacheStateError, match="weights changed since this PrefixCache was built"):
        greedy(pc.generate, prompt)
    pc.close()
    with PrefixCache(model, tiers_config(model, blocks=20)) as fresh:
        assert torch.equal(greedy(fresh.generate, prompt), greedy(model.generate, prompt))
        assert fresh.last_reused_tokens == [0]


def test_loading_the_same_weights_again_is_not_a_change():
    model = tiny_model("llama")
    prompt = tokens(torch.Generator().manual_seed(6), 40)
    with PrefixCache(model, tiers_config(model, blocks=20)) as pc:
        greedy(pc.generate, prompt)
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
        assert torch.equal(greedy(pc.generate, prompt), greedy(model.generate, prompt))
        assert pc.last_reused_tokens[0] > 0
        model.load_state_dict(tiny_model("llama", seed=1).state_dict())  # another checkpoint
        with pytest.raises(CacheStateError, match="weights changed"):
            greedy(pc.generate, prompt)


def test_a_rotary_cache_rebuilt_by_a_forward_is_not_a_change():
    """Non-persistent buffers (a rotary cache that dynamic scaling rebuilds) are not weights."""
    model = tiny_model("llama")
    prompt = tokens(torch.Generator().manual_seed(7), 40)
    with PrefixCache(model, tiers_config(model, blocks=20), model_id="named") as pc:
        greedy(pc.generate, prompt)
        rotary = model.model.rotary_emb
        rotary.register_buffer("inv_freq", rotary.inv_freq.clone(), persistent=False)
        assert torch.equal(greedy(pc.generate, prompt), greedy(model.generate, prompt))
        assert pc.last_reused_tokens[0] > 0


def test_a_model_converted_to_another_dtype_is_a_change():
    model = tiny_model("llama")
    prompt = tokens(torch.Generator().manual_seed(8), 40)
    with PrefixCache(model, tiers_config(model, blocks=20)) as pc:
        greedy(pc.generate, prompt)
        model.float()  # replaces every parameter's data, which torch does not count as a write
        with pytest.raises(CacheStateError, match="weights changed"):
            greedy(pc.generate, prompt)


def test_the_same_weights_with_another_rotary_base_never_read_the_pages_on_disk(tmp_path):
    """Rotary tables are not saved with the weights: a model rebuilt with another ``rope_theta`` (a
    checkpoint stretched to a longer context) on the same disk directory starts from nothing, and
    its scores are plain ``generate``'s."""
    from transformers import AutoModelForCausalLM

    from tests.hf.tiny import config

    first = tiny_model("llama")
    prompt = tokens(torch.Generator().manual_seed(8), 48)
    with PrefixCache(first, tiers_config(first, 20, disk_blocks=20, disk_path=tmp_path)) as pc:
        greedy(pc.generate, prompt)
    stretched = config("llama")
    stretched.rope_parameters = {"rope_type": "default", "rope_theta": 1234.0}
    second = AutoModelForCausalLM.from_config(stretched, dtype=torch.float64).eval()
    second.load_state_dict(first.state_dict())
    second.generation_config.pad_token_id = first.generation_config.pad_token_id
    second.generation_config.eos_token_id = None
    ids = torch.tensor([prompt + [5, 6, 7]])
    expected = second.generate(ids, max_new_tokens=1, output_logits=True, return_dict_in_generate=True).logits[0]
    with PrefixCache(second, tiers_config(second, 20, disk_blocks=20, disk_path=tmp_path)) as pc:
        logits = pc.generate(ids, max_new_tokens=1, output_logits=True, return_dict_in_generate=True).logits[0]
        assert pc.last_reused_tokens == [0]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-10)
    with PrefixCache(first, tiers_config(first, 20, disk_blocks=20, disk_path=tmp_path)) as pc:
        greedy(pc.generate, prompt + [5])
        assert pc.last_reused_tokens == [48]  # the first model's own pages are still there


def test_a_model_moved_to_another_device_is_refused_before_anything_changes():
    """A model moved (from cuda to the CPU, say) after its ``PrefixCache`` was built: the call is
    refused by name, not left to fail inside the forward. (The GPU suite moves it back and on.)"""
    model = tiny_model("llama")
    prompt = tokens(torch.Generator().manual_seed(8), 40)
    with PrefixCache(model, tiers_config(model, blocks=20)) as pc:
        greedy(pc.generate, prompt)
        before = pc.manager.stats()
        model.to("meta")
        with pytest.raises(CacheStateError, match="the model moved to meta since this PrefixCache was built"):
            greedy(pc.generate, [*prompt, 5])
        assert pc.manager.stats() == before


def test_pages_of_one_attention_implementation_are_never_served_to_another(tmp_path):
    """eager and sdpa attention compute keys and values that differ in the last bits (scores 1.5e-8
    apart in float64): another implementation is another model_id on disk, and switching it under
    a PrefixCache is refused until it is switched back. Before, both were served the other's pages."""
    prompt = tokens(torch.Generator().manual_seed(9), 40)
    reused = []
    for implementation in ("eager", "sdpa", "eager"):
        model = tiny_model("llama")
        model.set_attn_implementation(implementation)
        with PrefixCache(model, tiers_config(model, 60, disk_blocks=60, disk_path=tmp_path)) as pc:
            assert torch.equal(
                greedy(pc.generate, [*prompt, len(reused)]), greedy(model.generate, [*prompt, len(reused)])
            )
            reused.append(pc.last_reused_tokens[0])
    assert reused == [0, 0, 40]  # the third finds the first's pages on disk
    model.set_attn_implementation("eager")
    with PrefixCache(model, tiers_config(model, 60)) as pc:
        greedy(pc.generate, prompt)
        model.set_attn_implementation("sdpa")
        with pytest.raises(CacheStateError, match=r"attention \(or experts\) implementation changed"):
            greedy(pc.generate, [*prompt, 1])
        model.set_attn_implementation("eager")
        assert torch.equal(greedy(pc.generate, [*prompt, 1]), greedy(model.generate, [*prompt, 1]))
        assert pc.last_reused_tokens == [40]


def test_pages_computed_with_hub_kernels_are_served_only_to_calls_with_the_same_kernels(tmp_path):
    """From transformers 5.25 ``from_pretrained`` turns the hub's kernels on where the ``kernels``
    package is installed (``model.use_kernels``), in a mode ``train()`` and ``eval()`` switch. Pages
    computed with them are another scope: a process without them on the same disk directory
    never reads them, nor a call in the other mode, and switching kernels or mode under a
    PrefixCache is no error. Before, processes with and without shared pages. (The flags are set as
    transformers sets them, so that no kernel is fetched from the hub.)"""
    prompt = tokens(torch.Generator().manual_seed(11), 40)
    reused = []
    for kernels in (False, True, False):
        model = tiny_model("llama")
        model._use_kernels = kernels
        with PrefixCache(model, tiers_config(model, 60, disk_blocks=60, disk_path=tmp_path)) as pc:
            greedy(pc.generate, [*prompt, len(reused)])
            reused.append(pc.last_reused_tokens[0])
    assert reused == [0, 0, 40]  # the third finds the first's pages on disk
    with PrefixCache(model, tiers_config(model, 60)) as pc:
        assert torch.equal(greedy(pc.generate, prompt), greedy(model.generate, prompt))
        model._use_kernels, model._kernels_mode = True, "inference"
        assert torch.equal(greedy(pc.generate, [*prompt, 1]), greedy(model.generate, [*prompt, 1]))
        assert pc.last_reused_tokens == [0]  # the plain call's pages are not the kernels'
        if not hasattr(type(model), "kernels_mode"):
            return  # (transformers before 5.25 has no kernels modes)
        model._kernels_mode = "training"
        greedy(pc.generate, [*prompt, 2])
        assert pc.last_reused_tokens == [0]
        model._kernels_mode = "inference"
        greedy(pc.generate, [*prompt, 3])
        assert pc.last_reused_tokens == [40]


def test_pages_computed_under_autocast_are_served_only_to_calls_under_the_same_autocast():
    """A float32 model: a call under ``torch.autocast("cpu", bfloat16)`` computes keys rounded to
    bfloat16. Before, its pages were served to plain float32 calls (other tokens: scores 2.25 off)."""
    model = tiny_model("llama").to(torch.float32)
    prompt = tokens(torch.Generator().manual_seed(10), 48)
    longer = [*prompt, *tokens(torch.Generator().manual_seed(11), 8)]
    with PrefixCache(model, tiers_config(model, 60)) as pc:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected_autocast = greedy(model.generate, prompt)
            assert torch.equal(greedy(pc.generate, prompt), expected_autocast)
        assert torch.equal(greedy(pc.generate, longer), greedy(model.generate, longer))
        assert pc.last_reused_tokens == [0]  # the autocast call's pages are not this call's
        greedy(pc.generate, prompt)  # a plain call saves the prompt's pages in float32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(greedy(pc.generate, [*prompt, 5]), greedy(model.generate, [*prompt, 5]))
            assert pc.last_reused_tokens == [48]  # the first autocast call's pages


def test_a_configuration_changed_in_place_is_refused_until_it_is_set_back():
    """Mistral's window changed on its config after the PrefixCache was built. Before, a call that
    reused crashed inside the model, and pages saved under the other window were served once it
    was set back (other tokens: scores 0.56 off)."""
    model = tiny_model("mistral")
    window = model.config.sliding_window
    prompt = tokens(torch.Generator().manual_seed(12), 40)
    with PrefixCache(model, tiers_config(model, 60)) as pc:
        greedy(pc.generate, prompt)
        model.config.sliding_window = 2 * window
        with pytest.raises(CacheStateError, match="configuration changed"):
            greedy(pc.generate, [*prompt, 1])
        model.config.sliding_window = window
        assert torch.equal(greedy(pc.generate, [*prompt, 1]), greedy(model.generate, [*prompt, 1]))
        assert pc.last_reused_tokens == [40]


@pytest.fixture
def matmul_precision_restored():
    yield
    torch.set_float32_matmul_precision("highest")


def test_pages_computed_with_reduced_precision_cpu_matmuls_are_served_only_to_such_calls(matmul_precision_restored):
    """``torch.set_float32_matmul_precision("medium")`` runs a float32 model's matmuls in bfloat16
    through oneDNN on CPUs with bfloat16 instructions. Before, only CUDA's precision was part of a
    call's scope: such pages were served to full-precision calls (2 prompts in 30 gave other tokens
    on a CPU with AMX)."""
    model = tiny_model("llama").to(torch.float32)
    prompt = tokens(torch.Generator().manual_seed(13), 48)
    with PrefixCache(model, tiers_config(model, 60)) as pc:
        torch.set_float32_matmul_precision("medium")
        assert torch.equal(greedy(pc.generate, prompt), greedy(model.generate, prompt))
        torch.set_float32_matmul_precision("highest")
        assert torch.equal(greedy(pc.generate, [*prompt, 1]), greedy(model.generate, [*prompt, 1]))
        assert pc.last_reused_tokens == [0]
        torch.set_float32_matmul_precision("medium")
        assert torch.equal(greedy(pc.generate, [*prompt, 2]), greedy(model.generate, [*prompt, 2]))
        assert pc.last_reused_tokens == [48]


def test_the_matmul_precision_is_read_after_torch_s_newer_api_was_used():
    """transformers' ``enable_tf32`` sets ``torch.backends.cuda.matmul.fp32_precision``; after that,
    ``torch.get_float32_matmul_precision()`` raises ``RuntimeError``, which every call on CUDA
    reached. Run in a process of its own: the mix of both APIs stays for the process's life."""
    script = (
        "import torch\n"
        "from kvtier.hf.numerics import numerics_tag\n"
        "torch.set_float32_matmul_precision('highest')\n"
        "torch.backends.cuda.matmul.fp32_precision = 'tf32'\n"
        "print(numerics_tag(torch.device('cuda')), numerics_tag(torch.device('cpu')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["numerics:matmul-tf32", "None"]


def quantized(model):
    """``model`` with its Linear layers quantized dynamically to int8 (torch's eager quantization;
    the test is skipped where this torch no longer has it)."""
    quantize = getattr(getattr(torch.ao, "quantization", None), "quantize_dynamic", None)
    if quantize is None:
        pytest.skip("this torch has no torch.ao.quantization.quantize_dynamic")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its deprecation warnings
        return quantize(model, {torch.nn.Linear}, dtype=torch.qint8)


def test_dynamically_quantized_weights_are_part_of_the_identity_and_their_changes_are_noticed():
    """A dynamically quantized Linear keeps its int8 weight packed, outside its parameters and
    buffers. Before, two models differing only there had one ``model_id`` (a shared disk tier served
    one's pages to the other), and other weights set or loaded into one went unnoticed."""
    first = quantized(tiny_model("llama").to(torch.float32))
    other = tiny_model("llama").to(torch.float32)
    with torch.no_grad():
        for module in other.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(-2)
    second = quantized(other)
    assert weights_fingerprint(first) != weights_fingerprint(second)
    prompt = tokens(torch.Generator().manual_seed(14), 40)
    with PrefixCache(first, tiers_config(first, 60)) as pc:
        assert torch.equal(greedy(pc.generate, prompt), greedy(first.generate, prompt))
        first.load_state_dict(first.state_dict())  # the same weights again: nothing changed
        assert torch.equal(greedy(pc.generate, [*prompt, 1]), greedy(first.generate, [*prompt, 1]))
        assert pc.last_reused_tokens == [40]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for mine, theirs in zip(first.modules(), second.modules(), strict=True):
                if hasattr(mine, "set_weight_bias"):
                    mine.set_weight_bias(*theirs._weight_bias())
        with pytest.raises(CacheStateError, match="weights changed"):
            greedy(pc.generate, [*prompt, 2])


def test_a_mixture_of_experts_models_experts_kernels_are_part_of_its_identity():
    """``set_experts_implementation`` switches how the experts' matmuls run (``grouped_mm``,
    ``batched_mm``, ``eager``): other roundings (1e-3 off in bfloat16). Before, a switch under a
    PrefixCache went unseen, and processes running other kernels shared one ``model_id``."""
    config = transformers.MixtralConfig(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, **TINY_TEXT)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    prompt = tokens(torch.Generator().manual_seed(15), 40)
    model.set_experts_implementation("eager")
    with PrefixCache(model, tiers_config(model, 60)) as pc:
        eager_id = pc.manager.spec.model_id
        greedy(pc.generate, prompt)
        model.set_experts_implementation("batched_mm")
        with pytest.raises(CacheStateError, match=r"attention \(or experts\) implementation changed"):
            greedy(pc.generate, [*prompt, 1])
    with PrefixCache(model, tiers_config(model, 60)) as pc:
        assert pc.manager.spec.model_id != eager_id
        assert torch.equal(greedy(pc.generate, prompt), greedy(model.generate, prompt))
