"""The same chat turns on a CUDA device (skipped without one): pages promoted by the copier on the
model's stream, loaded and saved by device copies, token-identical to ``generate`` in float64."""

from __future__ import annotations

import pytest
import torch

from kvtier.hf import PrefixCache
from tests.hf.tiny import ARCHS, HAS_GEMMA4, tiers_config, tiny_model, tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize(
    "arch", [*ARCHS, pytest.param("gemma4", marks=pytest.mark.skipif(not HAS_GEMMA4, reason="no Gemma 4 here"))]
)
def test_chat_turns_on_the_gpu_through_host_and_disk(arch, tmp_path):
    chat_turns(tiny_model(arch), "cuda", tmp_path, seed=[*ARCHS, "gemma4"].index(arch) + 30)


def chat_turns(model, device: str, tmp_path, seed: int) -> None:
    """Three conversations of two turns each on ``device`` through host memory and disk, every call
    ``generate``'s tokens, the second turn reusing its history."""
    model = model.to(device)
    config = tiers_config(model, blocks=12, host_blocks=4, disk_blocks=400, disk_path=tmp_path / "disk", device=device)
    g = torch.Generator().manual_seed(seed)
    system = tokens(g, 41)
    history = [system + tokens(g, n) for n in (20, 24, 17)]
    with PrefixCache(model, config) as pc:
        for turn in range(2):
            for c in range(3):
                ids = torch.tensor([history[c]], device=device)
                mask = torch.ones_like(ids)
                expected = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
                got = pc.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
                assert torch.equal(got, expected), (turn, c, pc.last_reused_tokens)
                if turn:
                    assert pc.last_reused_tokens[0] >= len(history[c]) - 24
                history[c] = got[0].tolist() + tokens(g, 7)
        stats = pc.manager.stats()
        assert stats.hit_tokens["host"] + stats.hit_tokens["disk"] > 0, stats.hit_tokens


def test_a_left_padded_batch_on_the_gpu():
    model = tiny_model("llama").to("cuda")
    g = torch.Generator().manual_seed(31)
    rows = [tokens(g, 40), tokens(g, 23), tokens(g, 31)]
    with PrefixCache(model, tiers_config(model, blocks=64, device="cuda")) as pc:
        for turn in range(2):
            width = max(map(len, rows))
            ids = torch.zeros((3, width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, row in enumerate(rows):
                ids[i, width - len(row) :] = torch.tensor(row)
                mask[i, width - len(row) :] = 1
            ids, mask = ids.cuda(), mask.cuda()
            expected = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
            got = pc.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
            assert torch.equal(got, expected)
            if turn:
                assert all(n > 0 for n in pc.last_reused_tokens)
            rows = [got[i, width - len(r) :].tolist() + tokens(g, 3 + i) for i, r in enumerate(rows)]


def test_a_model_moved_to_the_cpu_is_refused_and_reuses_again_once_back():
    from kvtier.errors import CacheStateError

    model = tiny_model("llama").to("cuda")
    prompt = tokens(torch.Generator().manual_seed(32), 40)
    with PrefixCache(model, tiers_config(model, blocks=64, device="cuda")) as pc:
        ids = torch.tensor([prompt], device="cuda")
        pc.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        model.to("cpu")
        with pytest.raises(CacheStateError, match="the model moved to cpu"):
            pc.generate(ids.cpu(), attention_mask=torch.ones_like(ids.cpu()), max_new_tokens=4, do_sample=False)
        model.to("cuda")
        longer = torch.tensor([[*prompt, 5]], device="cuda")
        mask = torch.ones_like(longer)
        got = pc.generate(longer, attention_mask=mask, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, model.generate(longer, attention_mask=mask, max_new_tokens=4, do_sample=False))
        assert pc.last_reused_tokens == [40]


@pytest.mark.parametrize("seed", range(16))
def test_a_random_session_on_the_gpu_gives_generates_tokens_and_scores(seed, tmp_path):
    from tests.hf.test_hf_soak import session

    assert len(session(seed, tmp_path, device="cuda")) >= 2


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_a_script_that_makes_cuda_the_default_device(arch, tmp_path):
    """``torch.set_default_device("cuda")`` before building: kvtier's host memory, page tables and
    token bookkeeping are still on the CPU, and the chat goes through host and disk as before."""
    model = tiny_model(arch).to("cuda")
    config = tiers_config(model, blocks=12, host_blocks=4, disk_blocks=400, disk_path=tmp_path / "disk", device="cuda")
    g = torch.Generator().manual_seed(33)
    history = [tokens(g, 41) + tokens(g, n) for n in (20, 24)]
    replies = [tokens(g, 7) for _ in range(4)]  # drawn on the CPU, before the default changes
    torch.set_default_device("cuda")
    try:
        with PrefixCache(model, config) as pc:
            for _ in range(2):
                for c in range(2):
                    ids = torch.tensor([history[c]], device="cuda")
                    expected = model.generate(
                        ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False
                    )
                    got = pc.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
                    assert torch.equal(got, expected)
                    history[c] = got[0].tolist() + replies.pop()
            assert pc.last_reused_tokens[0] > 0
            hits = pc.manager.stats().hit_tokens
            assert hits["host"] + hits["disk"] > 0, hits
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3_next"])
def test_beam_search_on_the_gpu_through_host_and_disk(arch, tmp_path):
    model = tiny_model(arch).to("cuda")
    config = tiers_config(model, blocks=12, host_blocks=4, disk_blocks=400, disk_path=tmp_path / "disk", device="cuda")
    g = torch.Generator().manual_seed(32)
    prompts = [tokens(g, 48) for _ in range(4)]  # ends on a snapshot point of the hybrid (every 16 tokens)
    arguments = {"max_new_tokens": 5, "num_beams": 3, "num_return_sequences": 2, "return_dict_in_generate": True}
    with PrefixCache(model, config, recompute_when_faster=False) as pc:  # every cached block is loaded
        for turn in range(2):
            for prompt in prompts:
                ids = torch.tensor([prompt + tokens(g, 16)], device="cuda")
                expected = model.generate(ids, output_scores=True, **arguments)
                got = pc.generate(ids, output_scores=True, **arguments)
                assert torch.equal(got.sequences, expected.sequences), (turn, pc.last_reused_tokens)
                tolerance = 1e-6 if arch == "qwen3_next" else 1e-9  # float32 inside its linear attention
                torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, rtol=0, atol=tolerance)
                if turn:
                    assert pc.last_reused_tokens == [48, 48]
        stats = pc.manager.stats()
        assert stats.hit_tokens["host"] + stats.hit_tokens["disk"] > 0, stats.hit_tokens
