"""The PEFT adapters (LoRA, ...) active in a model: part of a call's reuse scope.

An adapter changes the keys and values its layers compute, while the model's own weights stay
as they were: pages computed with adapter ``a`` active must never be served with ``b`` active,
or with adapters disabled. ``AdapterScope`` gives each call the ``PrefixCache``'s scope with the
adapters its layers apply added to its ``lora_id`` (the active ones, or the merged ones while a
merge holds: PEFT's forward then runs the base layer alone; none while adapters are disabled,
whatever rows ``adapter_names`` names): each adapter by name and by a fingerprint of its weights
and settings (a name given to other weights later is another scope; the same adapter loaded in
another process is the same scope, so a disk tier serves it after a restart).

PEFT's tuner layers are found by what they expose (``active_adapters``, ``disable_adapters``,
``adapter_layer_names``), so peft is never imported. The layers are listed at construction and
again whenever the model's ``peft_config`` names other adapters (``add_adapter``,
``load_adapter``, ``delete_adapter``, an adapter added again under its name) or a layer listed is
no longer where it was in the model (``unload()`` puts the base layers back and leaves
``peft_config`` as it was). A fingerprint is computed once per set of tensors (their identity,
version and address), so training an adapter between calls makes a new scope too.

Adapters merged into the weights are the base weights' business (``kvtier.weights.WeightWatch``),
but PEFT merges and unmerges by writing through ``tensor.data``, which no version counter sees.
So a fingerprint of the tuner layers' base weights is kept, taken while no adapter is merged, and
compared again:

- when a tuner layer leaves the model (``merge_and_unload()``, ``unload()``): changed base weights
  of layers that leave merged mean an adapter was merged into them for good
  (``merged_into_weights``, sticky); of layers unmerged before they left, new weights (below);
- when the layers are unmerged again (a call finds none merged where the last one found some) or
  listed again with none merged: ``unmerge_adapter`` subtracts the delta it added, which leaves the
  base weights a rounding off (``W + d - d``), or further off when the adapter was trained while
  merged. Changed base weights are new weights: every scope of this object then carries their
  fingerprint (``weights@...``), so pages computed before are never served to them, and calls go
  on without an error. A call inside ``disable_adapter()`` over a merged adapter is unmerged by
  PEFT during its own forward: it runs as plain ``generate`` (``unmerged_in_call``).

A DoRA adapter merges otherwise: PEFT assigns its base layer new weight memory, which
``WeightWatch`` sees as a weight change (``CacheStateError``, as after an optimizer step).

Comparing reads every byte of the tuner layers' base weights (``kvtier.weights``: about 1 GB/s
on one CPU core), once per unmerge or adapter list change, never per call. Writes between two
calls that no call saw merged (an adapter injected and merged, or merged, trained and unmerged,
between two calls) go unseen, like any other ``.data`` write.
"""

from __future__ import annotations

import hashlib

import torch

from kvtier.config import ReuseScope
from kvtier.weights import tensors_fingerprint


class AdapterScope:
    """The reuse scope of a call on ``model``: ``base`` plus the adapters its layers apply now."""

    def __init__(self, model: torch.nn.Module, base: ReuseScope) -> None:
        self._model = model
        self._origin = base  # the scope given; ``_base`` adds the base weights' fingerprint once they change
        self._base = base
        self._names = _configured(model)
        self._paths, self._layers = _tuner_layers(model)
        self._was_merged = _any_merged(self._layers)  # as the last call found the layers
        # the tuner layers' base weights and their fingerprint, taken with no adapter merged (with
        # one merged at construction: as they were then, compared at the first unmerge); None while
        # merged layers were never seen unmerged (listed first while merged): unknown, so changed
        self._bases: tuple[list[tuple[str, torch.Tensor]], str] | None = _base_weights(self._layers)
        self._merged = False  # base weights found changed when tuner layers left the model (a merge)
        self._fingerprints: dict[str, tuple[tuple, str]] = {}  # per adapter: its tensors' handles, fingerprint

    def merged_into_weights(self) -> bool:
        """Whether an adapter was merged into the base weights since construction, as far as seen:
        tuner layers left the model (``merge_and_unload``, ``unload``) and their base weights had
        changed. Sticky: those weights are not the ones the pages were computed with."""
        self._refresh()
        return self._merged

    def for_rows(self, count: int, kwargs: dict) -> list[ReuseScope]:
        """The scope of each of ``count`` batch rows: with PEFT's per-row ``adapter_names`` argument
        (``"__base__"``: none), each row's adapter; else the adapters active now, for every row."""
        names = kwargs.get("adapter_names")
        if names is None:
            return [self.current()] * count
        if isinstance(names, str) or len(names) != count:
            raise ValueError(f"adapter_names must name one adapter per batch row ({count}), got {names!r}")
        self._refresh()
        disabled = tuple(bool(layer.disable_adapters) for layer in self._layers)
        if disabled and all(disabled):  # (``disable_adapter()``: PEFT runs every row on the base layers)
            return [self._base] * count
        scopes = [self._base if name == "__base__" else self._scope([(name, False)]) for name in names]
        if any(disabled):  # some layers run their base alone for every row: the pattern is part of the key
            pattern = hashlib.blake2b(repr(disabled).encode(), digest_size=8).hexdigest()
            scopes = [
                s if s is self._base else ReuseScope(lora_id=f"{s.lora_id}+off:{pattern}", salt=s.salt) for s in scopes
            ]
        return scopes

    def current(self) -> ReuseScope:
        """``base`` when no adapter is applied, else ``base`` with the applied ones in its ``lora_id``
        (``_applied``: the active adapters, or the merged ones while a merge holds)."""
        self._refresh()
        if not self._layers:
            return self._base
        states = tuple(_applied(layer) for layer in self._layers)
        applied = sorted(set().union(*states))
        if not applied:
            return self._base
        scope = self._scope(applied)
        if len(set(states)) > 1:  # layers disagree on what is active: the whole pattern is part of the key
            pattern = hashlib.blake2b(repr(states).encode(), digest_size=8).hexdigest()
            scope = ReuseScope(lora_id=f"{scope.lora_id}+{pattern}", salt=scope.salt)
        return scope

    def _refresh(self) -> None:
        """List the tuner layers again if the adapters changed, and compare the base weights where
        the module's docstring says."""
        names = _configured(self._model)
        model = self._model
        in_place = all(map(_in_place, [model] * len(self._paths), self._paths, self._layers))
        if in_place and _same_adapters(names, self._names):
            merged = _any_merged(self._layers)
            if self._was_merged and not merged:  # unmerged since the last call
                self._compare_bases()
            self._was_merged = merged
            return
        if not in_place:  # a layer left the model: its base weights stay as it leaves them
            now = self._changed_bases()
            if now is not None:
                if _any_merged(self._layers):  # merged as they left (``merge_and_unload``): for good
                    self._merged = True
                else:  # unmerged before they left: new weights, as after an unmerge
                    self._renew_base(now)
            self._bases = [], ""  # compared: the layers listed now are fingerprinted afresh
        known = bool(self._bases and self._bases[0])
        self._names = names
        self._paths, self._layers = _tuner_layers(model)
        self._was_merged = _any_merged(self._layers)
        if not self._was_merged:
            self._compare_bases()
        elif not known:  # merged before a call saw them unmerged (injected after construction, say)
            self._bases = None

    def _compare_bases(self) -> None:
        """No adapter is merged: if the base weights fingerprinted last differ now (or were never
        seen unmerged), the base weights are new (every scope carries their fingerprint from now
        on); the tuner layers' base weights now listed become the ones compared next."""
        now = _base_weights(self._layers)
        if self._changed_bases(now) is not None:
            self._renew_base(now[1])
        self._bases = now

    def _changed_bases(self, now: tuple[list[tuple[str, torch.Tensor]], str] | None = None) -> str | None:
        """The fingerprint now of the base weights last fingerprinted, if they changed or are
        unknown (``_bases`` None: those of the layers listed now), else None. ``now``: the current
        layers' ``_base_weights``, reused where they are the same tensors."""
        if self._bases is None:
            return (now or _base_weights(self._layers))[1]
        tensors, fingerprint = self._bases
        if not tensors:
            return None
        same = (
            now is not None
            and len(tensors) == len(now[0])
            and all(a is b for (_, a), (_, b) in zip(tensors, now[0], strict=True))
        )
        current = now[1] if same else tensors_fingerprint(tensors)
        return current if current != fingerprint else None

    def _renew_base(self, fingerprint: str) -> None:
        """The base weights changed to those of ``fingerprint``: every scope carries it from now on."""
        key = f"weights@{fingerprint[:16]}"
        lora_id = key if self._origin.lora_id is None else f"{self._origin.lora_id}|{key}"
        self._base = ReuseScope(lora_id=lora_id, salt=self._origin.salt)

    def unmerged_in_call(self) -> bool:
        """Whether PEFT will undo a merge inside the next forward: a tuner layer both merged and
        disabled (``disable_adapter()`` over a merged adapter unmerges on the way). The weights such a
        call computes with are known only once it ran (the unmerge subtracts the delta as it is
        then), so it must neither reuse nor save; the call after it compares them (``_refresh``)."""
        self._refresh()
        return any([layer.disable_adapters and getattr(layer, "merged_adapters", None) for layer in self._layers])

    def _scope(self, applied: list[tuple[str, bool]]) -> ReuseScope:
        """``base`` with the adapters ``applied`` (name, merged into the base weights) in its ``lora_id``."""
        key = "peft:" + "+".join(
            f"{name}{'(merged)' if merged else ''}@{self._fingerprint(name)}" for name, merged in applied
        )
        lora_id = key if self._base.lora_id is None else f"{self._base.lora_id}|{key}"
        return ReuseScope(lora_id=lora_id, salt=self._base.salt)

    def _fingerprint(self, name: str) -> str:
        """A fingerprint of adapter ``name``'s tensors and settings in every tuner layer (cached while
        its tensors and settings stay as they were: one entry per adapter, however often it is trained)."""
        tensors: list[tuple[str, torch.Tensor]] = []
        settings: list[str] = []
        for i, layer in enumerate(self._layers):
            for attribute in layer.adapter_layer_names:
                container = getattr(layer, attribute, None)
                if container is not None and name in container:
                    part = container[name]
                    found = part.named_parameters() if isinstance(part, torch.nn.Module) else [("", part)]
                    tensors += [(f"{i}.{attribute}.{n}", t) for n, t in found if isinstance(t, torch.Tensor)]
            for attribute in getattr(layer, "other_param_names", ()):
                values = getattr(layer, attribute, None)
                if isinstance(values, dict) and name in values:
                    settings.append(f"{i}.{attribute}={values[name]!r}")
        handles = tuple((id(t), t._version, t.data_ptr()) for _, t in tensors)
        key = (handles, tuple(settings))
        cached = self._fingerprints.get(name)
        if cached is None or cached[0] != key:
            digest = tensors_fingerprint(tensors)
            cached = key, hashlib.blake2b((digest + "|".join(settings)).encode(), digest_size=8).hexdigest()
            self._fingerprints[name] = cached
        return cached[1]


def _configured(model: torch.nn.Module) -> tuple[tuple[str, object], ...]:
    """The adapters the model's ``peft_config`` holds (PeftModel, transformers' adapter API): each
    name with its config object (held, so compared by identity: an adapter deleted and added again
    under its name, maybe on other modules, has a new one)."""
    config = getattr(model, "peft_config", None)
    return tuple(sorted(config.items(), key=lambda item: item[0])) if isinstance(config, dict) else ()


def _same_adapters(a: tuple[tuple[str, object], ...], b: tuple[tuple[str, object], ...]) -> bool:
    return len(a) == len(b) and all(x[0] == y[0] and x[1] is y[1] for x, y in zip(a, b, strict=True))


def _tuner_layers(model: torch.nn.Module) -> tuple[list[tuple[str, ...]], list[torch.nn.Module]]:
    """The model's tuner layers and the path of each (its submodule names from the model down)."""
    found = [
        (tuple(name.split(".")), m)
        for name, m in model.named_modules()
        if hasattr(m, "adapter_layer_names") and hasattr(m, "active_adapters") and hasattr(m, "disable_adapters")
    ]
    return [path for path, _ in found], [layer for _, layer in found]


def _base_weights(layers: list[torch.nn.Module]) -> tuple[list[tuple[str, torch.Tensor]], str]:
    """The parameters of each tuner layer's base layer (the weights an adapter merges into), and
    their fingerprint ("" with none)."""
    tensors: list[tuple[str, torch.Tensor]] = []
    for i, layer in enumerate(layers):
        base = getattr(layer, "base_layer", None)
        if isinstance(base, torch.nn.Module):
            tensors += [(f"{i}.{name}", t) for name, t in base.named_parameters()]
    return tensors, tensors_fingerprint(tensors) if tensors else ""


def _any_merged(layers: list[torch.nn.Module]) -> bool:
    """Whether an adapter is merged into any of these tuner layers' base weights now."""
    return any([getattr(layer, "merged_adapters", None) for layer in layers])


def _in_place(model: torch.nn.Module, path: tuple[str, ...], layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is still the model's submodule at ``path``."""
    module: torch.nn.Module | None = model
    for name in path:
        module = module._modules.get(name)  # (no ``getattr``: this runs for every tuner layer on every call)
        if module is None:
            return False
    return module is layer


def _applied(layer: torch.nn.Module) -> tuple[tuple[str, bool], ...]:
    """The adapters a tuner layer applies now, each with whether it is merged into the base weights,
    as PEFT's forward decides: none while adapters are disabled (a merge is undone first); the
    merged ones alone while any is merged (the base layer holds them; the active ones are not
    added); else the active ones present in the layer. A merged adapter is a scope of its own: the
    merged weights compute other roundings than the adapter beside them."""
    if layer.disable_adapters:
        return ()
    merged = getattr(layer, "merged_adapters", None)
    if merged:
        return tuple(sorted((name, True) for name in merged))
    active = layer.active_adapters
    names = [active] if isinstance(active, str) else list(active)
    present = [n for n in names if any(n in getattr(layer, a, {}) for a in layer.adapter_layer_names)]
    return tuple(sorted((name, False) for name in present))
