"""Tiny random-weight transformers models in float64, built from configs in code (no hub access).

``llama`` (full attention), ``mistral`` (sliding window of 24 tokens, smaller than the prompts),
``gemma2`` (sliding and full attention alternating), ``qwen3_next`` (linear attention hybrid: three
linear-attention layers per full-attention one; dense MLPs, since the mixture-of-experts kernel
has no float64 path on the CPU), ``falcon_h1`` (attention and a state space model side by side in
every decoder layer: one cache layer holding keys, values and states), ``deepseek_v3`` (multi-head
latent attention: the cache keeps two latents of different sizes per token; dense MLPs). Outside
``ARCHS``: ``gemma4`` (Gemma 4's text model: sliding and full attention layers of different head
sizes, the last two layers reading earlier layers' keys and values, their cache layers empty).
"""

from __future__ import annotations

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    FalconH1Config,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    Qwen3NextConfig,
)

import kvtier
from kvtier.hf.model_layers import read_model
from kvtier.layout import page_geometries
from kvtier.spec import GroupKind

VOCAB = 97
PAD = 0  # the pad token: prompts draw their tokens from [FIRST_TOKEN, VOCAB)
FIRST_TOKEN = 3
ARCHS = ("llama", "mistral", "gemma2", "qwen3_next", "falcon_h1", "deepseek_v3")
HAS_GEMMA4 = hasattr(transformers, "Gemma4TextConfig")
WINDOW = 24
TOKENS_PER_BLOCK = 8
SNAPSHOT_INTERVAL_BLOCKS = 2

TINY_TEXT = dict(  # what every tiny model's text part shares
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=2,
)


def config(arch: str):
    if arch == "llama":
        return LlamaConfig(num_hidden_layers=2, **TINY_TEXT)
    if arch == "mistral":
        return MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **TINY_TEXT)
    if arch == "gemma2":
        return Gemma2Config(num_hidden_layers=4, head_dim=8, sliding_window=WINDOW, **TINY_TEXT)
    if arch == "qwen3_next":
        return Qwen3NextConfig(
            num_hidden_layers=4,
            head_dim=8,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            mlp_only_layers=[0, 1, 2, 3],
            **TINY_TEXT,
        )
    if arch == "falcon_h1":
        return FalconH1Config(num_hidden_layers=2, head_dim=8, mamba_d_state=8, mamba_d_head=8, **TINY_TEXT)
    if arch == "deepseek_v3":
        latent = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
        heads = {**TINY_TEXT, "num_key_value_heads": TINY_TEXT["num_attention_heads"]}  # MLA: a KV head per query head
        return DeepseekV3Config(num_hidden_layers=2, first_k_dense_replace=2, **latent, **heads)
    if arch == "gemma4":
        from transformers import Gemma4TextConfig  # releases with Gemma 4 only (``HAS_GEMMA4``)

        sliding, full = "sliding_attention", "full_attention"
        return Gemma4TextConfig(
            num_hidden_layers=6,
            head_dim=8,
            layer_types=[sliding, sliding, full, sliding, sliding, full],
            per_layer_config={"02": {"head_dim": 16}, "05": {"head_dim": 16}},
            sliding_window=WINDOW,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB,
            **TINY_TEXT,
        )
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A random-weight model of ``arch``: the same ``seed``, the same weights."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(arch), dtype=torch.float64).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None  # every call generates all it is asked for
    return model


def tiers_config(
    model, blocks: int, host_blocks: int = 0, disk_blocks: int = 0, disk_path=None, device: str = "cpu"
) -> kvtier.CacheConfig:
    """A config whose primary tier holds about ``blocks`` blocks of history (host, disk likewise)."""
    spec = read_model(model, model_id="sizing").spec
    geometries = page_geometries(spec, TOKENS_PER_BLOCK)
    per_block = sum(
        g.page_bytes / (SNAPSHOT_INTERVAL_BLOCKS if g.group.kind is GroupKind.RECURRENT else 1) for g in geometries
    )
    tiers = [kvtier.PrimaryTier(int(blocks * per_block) + 1)]
    if host_blocks:
        tiers.append(kvtier.HostTier(int(host_blocks * per_block) + 1))
    if disk_blocks:
        tiers.append(kvtier.DiskTier(int(disk_blocks * per_block) + 1, disk_path))
    return kvtier.CacheConfig(TOKENS_PER_BLOCK, tiers, device=device, snapshot_interval_blocks=SNAPSHOT_INTERVAL_BLOCKS)


def tokens(generator: torch.Generator, n: int) -> list[int]:
    return torch.randint(FIRST_TOKEN, VOCAB, (n,), generator=generator).tolist()


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of rows, left-padded with ``PAD``, and its attention mask."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask
