"""A fingerprint of a model's weights (every byte of every parameter and buffer) and one of its
configuration (the settings that may decide keys and values).

Used as ``ModelSpec.model_id`` when the user names no checkpoint, so two fine-tunes of one
architecture never share pages. The bytes are hashed where they live (on the GPU for a GPU
model) by a linear hash over 32-bit words: word ``i`` of a chunk is multiplied by an odd
64-bit coefficient derived from ``i`` and the products are summed modulo 2**64, twice with
independent coefficients. Changing any single word changes each sum (an odd coefficient is
invertible modulo 2**64), and unrelated changes collide with probability about 2**-128.
Device-independent: the same weights give the same digest on the CPU and
on a GPU. It is a content fingerprint, not a defence against a crafted collision.

The weights alone do not decide a key: the same weights with another rotary base or scaling
(``rope_theta``, ``rope_scaling``: how a checkpoint is stretched to a longer context) give other
keys. Rotary tables are buffers a model does not save, so ``config_fingerprint`` digests the
configuration's settings too, all but those that cannot change a key or value.

Weights can also change in place under a cache that named them once (a training loop that
generates between optimizer steps, ``load_state_dict``): ``WeightWatch`` notices. Every in-place
write to a parameter or buffer through autograd's view of it (``optimizer.step()``,
``load_state_dict``, ``tensor.copy_`` under ``no_grad``) bumps the tensor's version counter,
replacing a parameter changes its identity, and converting one (``model.half()``, ``.to()``) gives
it new memory: the watch keeps all three for every parameter and persistent buffer (what the
fingerprint covers: not a rotary cache a forward may rebuild) of the model's modules, listed once
at construction, and compares them at each call: a pass over the tensors' handles, not their
bytes (about 0.15 ms for a Llama-3-8B-shaped model on the development CPU). Not noticed: writes in
place through ``tensor.data`` (torch does not count them) and modules added or swapped in after
construction.

Cost: one multiply-add per 4 bytes. Measured: 16 GiB of bf16 weights (an 8B model) in 0.39 s
on an H200; 512 MiB in 0.33 s on that machine's CPU (about 1.6 GB/s), about 1 GB/s on one core
of a small development machine (a tiny test model: milliseconds).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable

import torch

CHUNK_WORDS = 1 << 18  # words sharing one row of coefficients (1 MiB of weights)
# Chunks hashed per step (the digest does not depend on it): a GPU wants few launches, a CPU
# wants temporaries that stay in cache.
CHUNKS_PER_STEP = {"cuda": 16, "cpu": 2}
_MASK64 = (1 << 64) - 1
# Settings of a transformers configuration that cannot change a key or a value: where it was
# loaded from and by which version, output switches, labels and special token ids, and the dtype
# (the weights' fingerprint has it).
_RUNTIME_SETTINGS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "architectures",
        "dtype",
        "torch_dtype",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "tokenizer_class",
        "task_specific_params",
    }
)


def weights_fingerprint(module: torch.nn.Module) -> str:
    """A hex digest of every parameter and buffer of ``module``: names, shapes, dtypes and bytes."""
    return tensors_fingerprint(module.state_dict(keep_vars=False).items())


def config_fingerprint(config: object) -> str:
    """A hex digest of a model configuration's settings (a transformers ``PretrainedConfig``, as its
    ``to_dict()`` gives them, nested configurations included; or a dataclass, as the reference
    engine's ``ModelConfig``), leaving out the runtime settings that cannot change a key or value.
    Configurations differing in anything else differ here."""
    if hasattr(config, "to_dict"):
        settings = config.to_dict()
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        settings = dataclasses.asdict(config)
    else:
        raise TypeError(f"a model configuration has to_dict() or is a dataclass, got {type(config).__name__}")
    text = json.dumps(_without_runtime(settings), sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8, person=b"kvtier-config1").hexdigest()


def default_model_id(module: torch.nn.Module, config: object) -> tuple[str, str]:
    """(the weights' fingerprint, the ``model_id`` a model gets when the user names none): the
    weights and the configuration, so pages outlive neither a change of checkpoint nor of rotary
    settings. The fingerprint alone is what ``WeightWatch`` compares."""
    weights = weights_fingerprint(module)
    return weights, f"weights:{weights}+config-{config_fingerprint(config)}"


def _without_runtime(value: object) -> object:
    if isinstance(value, dict):
        return {k: _without_runtime(v) for k, v in value.items() if k not in _RUNTIME_SETTINGS}
    return value


def tensors_fingerprint(named: Iterable[tuple[str, object]]) -> str:
    """A hex digest of named tensors (their names, shapes, dtypes and bytes), in name order.

    Tensors inside tuples and lists count too, under ``name.i`` (torch's dynamically quantized
    ``Linear`` saves its packed weight and bias as such a pair); a quantized tensor counts by its
    integer values and its quantization (scheme, scales, zero points). Other entries are skipped."""
    h = hashlib.blake2b(digest_size=16, person=b"kvtier-weights1")
    coefficients: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, tensor in sorted(_flattened(named), key=lambda item: item[0]):
        h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        tensor = tensor.detach()
        if tensor.is_quantized:
            h.update(_quantization(tensor).encode())
            tensor = tensor.int_repr()
        words = _as_words(tensor)
        if tensor.device not in coefficients:
            coefficients[tensor.device] = _coefficients(tensor.device)
        for digest in _hash_words(words, coefficients[tensor.device]):
            h.update(digest.to_bytes(8, "little"))
    return h.hexdigest()


def _flattened(named: Iterable[tuple[str, object]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of ``named``, with those inside tuples and lists (nested too) named ``name.i``."""
    found: list[tuple[str, torch.Tensor]] = []
    pending = list(named)
    while pending:
        name, value = pending.pop()
        if isinstance(value, torch.Tensor):
            found.append((name, value))
        elif isinstance(value, tuple | list):
            pending += [(f"{name}.{i}", item) for i, item in enumerate(value)]
    return found


def _quantization(tensor: torch.Tensor) -> str:
    """How a quantized tensor maps its integers to values: its scheme and parameters, as text."""
    scheme = tensor.qscheme()
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return f"{scheme}|{tensor.q_scale()!r}|{tensor.q_zero_point()}|"
    scales = tensor.q_per_channel_scales().tolist()
    zero_points = tensor.q_per_channel_zero_points().tolist()
    return f"{scheme}|{tensor.q_per_channel_axis()}|{scales!r}|{zero_points!r}|"


def _as_words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int32 words (zero-padded to a multiple of 4 bytes)."""
    data = tensor.contiguous().reshape(-1).view(torch.uint8)
    pad = -data.numel() % 4
    if pad:
        data = torch.cat([data, data.new_zeros(pad)])
    return data.view(torch.int32)


def _coefficients(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of odd 64-bit coefficients, one per word position of a chunk."""
    index = torch.arange(CHUNK_WORDS, dtype=torch.int64, device=device)
    return _splitmix64(index) | 1, _splitmix64(index + CHUNK_WORDS) | 1


def _hash_words(words: torch.Tensor, coefficients: tuple[torch.Tensor, torch.Tensor]) -> list[int]:
    """Two 64-bit sums over all words, each chunk's sum mixed with its index; one host sync."""
    totals = torch.zeros(2, dtype=torch.int64, device=words.device)
    step = CHUNK_WORDS * CHUNKS_PER_STEP.get(words.device.type, 2)
    for start in range(0, len(words), step):
        block = words[start : start + step].to(torch.int64)
        pad = -len(block) % CHUNK_WORDS
        if pad:  # zero words add nothing to a sum; the length is hashed separately
            block = torch.cat([block, block.new_zeros(pad)])
        block = block.view(-1, CHUNK_WORDS)
        index = torch.arange(len(block), dtype=torch.int64, device=words.device) + start // CHUNK_WORDS
        mix = _splitmix64(index + (1 << 40)) | 1
        for i, c in enumerate(coefficients):
            totals[i] += ((block * c).sum(dim=1) * mix).sum()
    return [len(words)] + [v & _MASK64 for v in totals.tolist()]


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 over an int64 tensor (wrapping arithmetic; logical shifts by masking)."""
    x = x + _signed(0x9E3779B97F4A7C15)
    x = (x ^ _shr(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shr(x, 31)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


class WeightWatch:
    """Whether ``model``'s weights are still those a cache (a ``PrefixCache``, an ``LLMEngine``) was
    built for.

    ``fingerprint``: the weights' fingerprint at construction (part of the pages' default
    ``model_id``), or None when the caller named the weights: then any counted write is taken as a
    change.
    """

    def __init__(self, model: torch.nn.Module, fingerprint: str | None) -> None:
        self._model = model
        self._modules = list(model.modules())
        self._fingerprint = fingerprint
        self._seen = self._handles()

    def unchanged(self) -> bool:
        """False when the weights were written to (and, where a fingerprint is known, now differ
        from it); a write that left every byte as it was is accepted and remembered."""
        seen = self._handles()
        if seen == self._seen:
            return True
        if self._fingerprint is None or weights_fingerprint(self._model) != self._fingerprint:
            return False
        self._seen = seen
        return True

    def _handles(self) -> tuple[object, ...]:
        """(identity, version, address) of every parameter and persistent buffer of the modules, and
        every packed-weights object with its ``id`` (torch's quantized modules keep their weights in
        one, outside the parameters; setting or loading weights replaces it). The objects are held,
        so no later object can take their ids: equal ids mean the same object, and different ids stop
        the comparison before the objects (which have no ``==``) are compared."""
        tensors = tuple(
            (id(t), t._version, t.data_ptr())
            for module in self._modules
            for name, t in (*module._parameters.items(), *module._buffers.items())
            if t is not None and name not in module._non_persistent_buffers_set
        )
        packed = tuple((id(p), p) for p in map(_packed_weights, self._modules) if p is not None)
        return tensors + packed if packed else tensors


def _packed_weights(module: torch.nn.Module) -> object | None:
    """The packed-weights object a module holds outside its parameters (``_packed_params``: a
    ``torch.ScriptObject`` in torch's quantized modules), or None."""
    packed = module.__dict__.get("_packed_params")
    return packed if isinstance(packed, torch.ScriptObject) else None
