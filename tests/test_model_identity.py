"""Pages computed under one set of weights are never served under another (``ModelSpec.model_id``).

Two checkpoints of one architecture (two seeds of tiny-llama, or one with a few rows changed)
have the same shapes: before ``model_id`` they shared a disk directory after a restart and a
connector's keys, and the second model was served the first one's KV.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import kvtier
from kvtier.connector import FileSystemConnector
from kvtier.engine import LLMEngine, SamplingParams, SchedulerConfig
from kvtier.models import build_model, named_config
from kvtier.models.random_init import random_model
from kvtier.weights import weights_fingerprint

TPB = 16


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    system = torch.randint(1, vocab, (70,), generator=g).tolist()
    return [system + torch.randint(1, vocab, (n,), generator=g).tolist() for n in (9, 30, 17, 44)]


def config(path) -> kvtier.CacheConfig:
    return kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20), kvtier.DiskTier(4 << 20, path)])


def fine_tune(model) -> None:
    """Change row 64 onward of every gate projection: the first 4,096 values stay as they were."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "gate_proj" in name:
                param[64:] += 0.25


def test_the_fingerprint_covers_every_byte():
    model = build_model("tiny-llama", "cpu", torch.float64, seed=0)
    before = weights_fingerprint(model)
    assert before == weights_fingerprint(build_model("tiny-llama", "cpu", torch.float64, seed=0))
    fine_tune(model)
    assert weights_fingerprint(model) != before
    last = build_model("tiny-llama", "cpu", torch.float64, seed=0)
    with torch.no_grad():
        tensor = max(last.parameters(), key=lambda p: p.numel())
        flat = tensor.view(-1)
        flat[-1] = torch.nextafter(flat[-1], torch.tensor(float("inf"), dtype=flat.dtype))  # one ulp, last value
    assert weights_fingerprint(last) != before


def test_the_fingerprint_does_not_depend_on_the_chunking(monkeypatch):
    import kvtier.weights as weights

    layer = torch.nn.Linear(300, 700).to(torch.float16)
    digest = weights_fingerprint(layer)
    monkeypatch.setitem(weights.CHUNKS_PER_STEP, "cpu", 7)
    assert weights_fingerprint(layer) == digest


def test_model_id_names_the_pages():
    spec = kvtier.ModelSpec.uniform(2, 2, 8, torch.float16)
    named = kvtier.ModelSpec.uniform(2, 2, 8, torch.float16, model_id="org/model@rev1")
    assert named.model_id == "org/model@rev1"
    assert (
        len({spec.fingerprint(), named.fingerprint(), named.__class__(named.layers, named.dtype, "x").fingerprint()})
        == 3
    )
    with pytest.raises(TypeError, match="model_id"):
        kvtier.ModelSpec.uniform(2, 2, 8, model_id="")
    with pytest.raises(TypeError, match="model_id"):
        kvtier.ModelSpec.uniform(2, 2, 8, model_id=7)


def test_a_disk_tier_without_model_id_warns(tmp_path, caplog):
    spec = kvtier.ModelSpec.uniform(2, 2, 8, torch.float16)
    with caplog.at_level("WARNING", logger="kvtier.manager"), kvtier.KVCacheManager(spec, config(tmp_path)):
        pass
    assert sum("model_id=None" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("change", ["seed", "fine_tune", "rope_theta"])
def test_another_checkpoint_on_the_same_disk_directory_reuses_nothing(tmp_path, change):
    first = build_model("tiny-llama", "cpu", torch.float64, seed=0)
    ps = prompts(first.vocab_size)
    with LLMEngine(first, config(tmp_path), SchedulerConfig(max_num_tokens=256, recompute_when_faster=False)) as eng:
        eng.generate(ps, SamplingParams(max_tokens=4))
    if change == "seed":
        second = build_model("tiny-llama", "cpu", torch.float64, seed=1)
    elif change == "rope_theta":  # the same weights, another rotary base: other keys
        stretched = dataclasses.replace(named_config("tiny-llama"), rope_theta=1234.0)
        second = random_model(stretched, "cpu", torch.float64, seed=0)
        assert weights_fingerprint(second) == weights_fingerprint(first)
    else:
        second = build_model("tiny-llama", "cpu", torch.float64, seed=0)
        fine_tune(second)
    with LLMEngine(second, config(tmp_path), SchedulerConfig(max_num_tokens=256, recompute_when_faster=False)) as eng:
        outs = eng.generate(ps, SamplingParams(max_tokens=4))
    for prompt, out in zip(ps, outs, strict=True):
        assert out.token_ids == second.reference_generate(prompt, 4)
    assert sum(o.reused_tokens_by_tier["disk"] for o in outs) == 0
    # ... while the first model, restarted on the same directory, still finds its own pages
    with LLMEngine(first, config(tmp_path), SchedulerConfig(max_num_tokens=256, recompute_when_faster=False)) as eng:
        outs = eng.generate(ps, SamplingParams(max_tokens=4))
    assert sum(o.reused_tokens_by_tier["disk"] for o in outs) > 0
    for prompt, out in zip(ps, outs, strict=True):
        assert out.token_ids == first.reference_generate(prompt, 4)


def test_another_checkpoint_never_loads_through_a_connector(tmp_path):
    first = build_model("tiny-llama", "cpu", torch.float64, seed=0)
    second = build_model("tiny-llama", "cpu", torch.float64, seed=0)
    fine_tune(second)
    ps = prompts(first.vocab_size)
    small = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)])
    with LLMEngine(first, small, connector=FileSystemConnector(tmp_path / "store")) as eng:
        eng.generate(ps, SamplingParams(max_tokens=4))
    forced = SchedulerConfig(recompute_when_faster=False)  # every prompt asked of the store
    with LLMEngine(second, small, forced, connector=FileSystemConnector(tmp_path / "store")) as eng:
        outs = eng.generate(ps, SamplingParams(max_tokens=4))
    assert sum(o.reused_tokens_by_tier["connector"] for o in outs) == 0
    for prompt, out in zip(ps, outs, strict=True):
        assert out.token_ids == second.reference_generate(prompt, 4)


def test_checkpoints_served_in_turn_on_one_path_are_reported_once_their_directories_outgrow_a_tier(tmp_path, caplog):
    """Each checkpoint gets a directory of its own, each up to the tier's capacity, and none is
    removed: once the others use more than that, opening a tier says so, naming the oldest."""
    page = 2 * TPB * 64 * 2
    tiers = [kvtier.PrimaryTier(page * 200), kvtier.DiskTier(page * 256, tmp_path)]
    g = torch.Generator().manual_seed(9)
    warned = []
    for checkpoint in ("ckpt-a", "ckpt-b", "ckpt-c"):
        spec = kvtier.ModelSpec.uniform(1, 1, 64, torch.float16, model_id=checkpoint)
        caplog.clear()
        with caplog.at_level("WARNING", logger="kvtier.tiering.build"):
            mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers))
        warned.append(caplog.text)
        tokens = torch.randint(1, 30_000, (150 * TPB,), generator=g).tolist()
        cache = mgr.create_cache(tokens)
        assert cache.resume() and cache.resize(len(tokens))
        cache.commit(tokens)
        cache.close()
        mgr.close()  # writes its 150 pages to its own directory
    assert warned[0] == "" and warned[1] == ""  # one other directory: 150 pages, within 256
    assert "2 other directories under" in warned[2] and "none is removed" in warned[2]
    assert re.search(r" use 1\.\d MiB, more than this tier's 1\.0 MiB", warned[2])  # (before: 0.0 GiB and 0.0 GiB)
    a = kvtier.ModelSpec.uniform(1, 1, 64, torch.float16, model_id="ckpt-a")
    assert "kvtier-" in warned[2] and len(list(tmp_path.glob("kvtier-*"))) == 3
    with kvtier.KVCacheManager(a, kvtier.CacheConfig(TPB, tiers)) as again:  # nothing was deleted
        assert again.stats().tiers["disk"].pages_used == 150


def test_weights_changed_in_place_under_an_engine_are_refused_and_a_new_engine_serves_them():
    """A training loop that generates between optimizer steps: the engine's cached pages are of the
    old weights, so the next call raises instead of serving them; a new engine serves the new
    weights. Loading the same weights again is not a change."""
    model = build_model("tiny-llama", "cpu", torch.float64, seed=0)
    ps = prompts(model.vocab_size)
    small = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)])
    engine = LLMEngine(model, small, SchedulerConfig(max_num_tokens=256))
    engine.generate(ps[:1], SamplingParams(max_tokens=2))
    model.load_state_dict(model.state_dict())  # the same bytes written again
    assert engine.generate(ps[1:2], SamplingParams(max_tokens=2))[0].reused_tokens_by_tier["primary"] > 0
    fine_tune(model)
    with pytest.raises(kvtier.CacheStateError, match="weights changed"):
        engine.generate(ps[:1], SamplingParams(max_tokens=2))
    with pytest.raises(kvtier.CacheStateError, match="weights changed"):
        engine.add_request(ps[0], SamplingParams())
    engine.close()
    with LLMEngine(model, small, SchedulerConfig(max_num_tokens=256)) as fresh:
        outs = fresh.generate(ps, SamplingParams(max_tokens=4))
    for prompt, out in zip(ps, outs, strict=True):
        assert out.token_ids == model.reference_generate(prompt, 4)


def test_weights_changed_while_a_request_is_in_flight_stop_the_engine_before_it_publishes(tmp_path):
    """An optimizer step between two ``step()`` calls of a request in flight: the next ``step``
    raises before it computes with the new weights, so nothing of them is published or saved
    under the old weights' identity; an engine of the old weights on the same disk directory is
    served only their pages. Before, ``step`` ran the request to its end and ``close`` saved its
    pages: the old weights' next engine reused them and generated other tokens."""
    model = build_model("tiny-llama", "cpu", torch.float64, seed=0)
    old = {name: t.clone() for name, t in model.state_dict().items()}
    prompt = prompts(model.vocab_size)[0]
    config = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20), kvtier.DiskTier(8 << 20, tmp_path)])
    engine = LLMEngine(model, config, SchedulerConfig(max_num_tokens=256))
    engine.add_request(prompt, SamplingParams(max_tokens=12))
    assert engine.step() == []  # the prompt and its first token, with the old weights
    fine_tune(model)
    with pytest.raises(kvtier.CacheStateError, match="weights changed"):
        engine.step()
    engine.close()
    model.load_state_dict(old)
    follow = [*prompt, *model.reference_generate(prompt, 12), 5, 6, 7]
    with LLMEngine(model, config, SchedulerConfig(max_num_tokens=256)) as again:
        out = again.generate([follow], SamplingParams(max_tokens=6))[0]
    assert out.token_ids == model.reference_generate(follow, 6)
