"""``PrefixCache``: prefix reuse across ``generate()`` calls of a transformers model, on kvtier's tiers.

One call, for a batch of left-padded rows:

1. match: each row's prompt gets a kvtier cache holding its longest cached prefix (never the
   last prompt token); ``batch_rows.choose_width`` picks how many leading columns every row can
   take from kvtier exactly, and resumes the caches that hold them (promoting pages from host or
   disk in one batch per tier and layer group);
2. load: a ``RecordingCache`` is filled with that prefix (``prefix_load``);
3. generate: ``model.generate`` runs with that cache on the rest, with the caller's arguments
   (a model with linear-attention layers first runs the prompt up to each snapshot point, so the
   states there can be kept);
4. save: every computed token of every row goes into its pages and is committed, publishing full
   blocks for the next call (``prefix_save``).

Beam search: the cache is filled for the rows (and run to their snapshot points), then repeated
once per beam, states included (as ``generate`` repeats the rows), so every beam reuses its row's
prefix. Only the prompts are saved: beams are reordered and cut at every step, so the cache's
rows do not hold the returned sequences' generated tokens.

The prompt forward of each call is timed (``prefill_rate``) and the rate given to the manager:
a cached prefix is then reused only as far as loading it is estimated faster than recomputing
it (``recompute_when_faster``), so blocks on a slow disk are recomputed.

A row is reused and saved only as far as its keys and values depend on its token ids alone
(``token_bound``): a multimodal call shares the text before its first image, not the image
(before transformers 5.23, nothing of a call given nonzero ``token_type_ids``). The
PEFT adapters active in a call are part of its scope (``adapters``).

Outputs are those of ``model.generate`` with the same arguments. What is reused in a batch:
``last_reused_tokens[i]`` prompt tokens of row i, where the batch takes the same number of
leading columns from kvtier for every row (see ``batch_rows``). A batch whose attention mask is
not left padding, a padded batch of a model that computes padded rows its own way
(``kvtier.hf.padding``: TrOCR, GIT), and a call while a module of the model applies dropout or
noise in training mode (``training_noise``), run as plain ``model.generate``, reusing and saving
nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import os
import threading

import torch
from transformers.generation import GenerationConfig, GenerationMode

from kvtier.cache import CacheState
from kvtier.config import DEFAULT_SCOPE, CacheConfig, DiskTier, ReuseScope, same_device
from kvtier.errors import CacheStateError
from kvtier.hf.adapters import AdapterScope
from kvtier.hf.batch_rows import Row, choose_width, close_rows, left_pads, release_reads
from kvtier.hf.call_state import CallState
from kvtier.hf.forward_hooks import user_hook
from kvtier.hf.hf_cache import RecordingCache, StateRecorder, held_columns
from kvtier.hf.model_layers import ModelLayers, attention_implementation, read_model, wrapped_model
from kvtier.hf.numerics import with_numerics
from kvtier.hf.prefill_rate import PrefillTiming
from kvtier.hf.prefix_load import group_stacks, load_prefix, state_packing
from kvtier.hf.prefix_save import save_rows
from kvtier.hf.token_bound import dynamic_rope_limit, placeholder_ids, row_bounds, typed_scope, zero_types_matter
from kvtier.hf.training_noise import random_module
from kvtier.hf.window_check import applies_window, uniform_window
from kvtier.manager import KVCacheManager
from kvtier.process_bound import ProcessBound
from kvtier.spec import ModelSpec
from kvtier.storage.disk_replicas import open_first_free
from kvtier.storage.log_limit import RateLimitedWarning
from kvtier.weights import WeightWatch, config_fingerprint

log = logging.getLogger(__name__)

_CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")
_UNSUPPORTED = {
    "custom_generate": "a custom generate",
    "negative_prompt_ids": "classifier-free guidance with a negative prompt",
}
# Decoding that writes only the tokens it keeps into the cache. Assisted decoding writes drafts and
# cuts the rejected ones back out, which the recording of sliding-window layers does not follow;
# and transformers' assisted loop (5.25) feeds its first forward the whole prompt whatever the
# cache it is given already holds, so over a filled cache it answers other tokens than without one
# (a plain ``DynamicCache`` of a prompt's first tokens does the same), even for full attention.
_BEAM_MODES = (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE)
# what has generate decode with the cache kvtier filled (``_own_cache``)
_OWN_CACHE = {"cache_implementation": None, "use_cache": True}
# per-token inputs of a text model, batch first: ``generate`` repeats them row by row for
# ``num_return_sequences``, as kvtier repeats the rows (other tensors follow each model's rules)
_PER_TOKEN_INPUTS = ("position_ids", "token_type_ids")
_SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.DOLA_GENERATION, *_BEAM_MODES)


class PrefixCache(ProcessBound):
    """Prefix reuse for ``model.generate`` over kvtier's tiers (GPU, host, disk).

    ``cache_config.device`` must be the model's device. ``model_id`` names the weights (default:
    ``kvtier.weights_fingerprint(model)`` with a fingerprint of the model's configuration, whose
    rotary settings decide keys too, transformers' version, whose model code computes them, and
    the attention implementation, whose kernels do), so pages are only ever served to the same
    model computed the same way; a later change of the model's weights in place (an optimizer
    step, ``load_state_dict``, a PEFT adapter merged for good while a call saw it), of its
    configuration or of its attention implementation makes ``generate`` raise ``CacheStateError``
    (``kvtier.weights.WeightWatch``): build a new PrefixCache for the new weights. A PEFT
    ``unmerge_adapter`` that leaves the base weights other than before the merge (a rounding off)
    starts a scope of the new weights instead (``kvtier.hf.adapters``). A call under
    ``torch.autocast`` (or TF32 matmuls on CUDA, or with the hub's kernels) reuses and saves in a scope of its own
    (``kvtier.hf.numerics``). While a forward hook of the user's is registered on the model, calls
    run as plain ``generate`` (``kvtier.hf.forward_hooks``). Not noticed: other writes through
    ``tensor.data`` (torch does not count them; an adapter injected and merged between two calls)
    and modules swapped in after construction (``set_input_embeddings``); after those, build a
    new PrefixCache too. A ``model_id`` given names the weights, the rotary settings, the model
    code and the kernels alike: a disk tier serves its pages to any model given the same one.
    ``recompute_when_faster`` (default True): time each call's prompt forward and reuse a cached
    prefix below the GPU only as far as loading it is estimated faster than recomputing it (the
    tokens left are counted in ``manager.stats().recomputed_tokens``); with a disk tier, the rates
    measured by the last user of its directory apply from the first call. False loads every cached
    block. Raises ``NotImplementedError`` naming what kvtier cannot represent (see
    ``model_layers``). Calls from several threads run one at a time, and each thread reads its own
    last call's ``last_reused_tokens``. Also a context manager; ``close`` (which waits for a running
    call) persists a disk tier's pages. It is never copied or pickled: build one in each process.
    """

    remedy = "build one in each process, around that process's model"

    def __init__(
        self,
        model: torch.nn.Module,
        cache_config: CacheConfig,
        scope: ReuseScope = DEFAULT_SCOPE,
        model_id: str | None = None,
        recompute_when_faster: bool = True,
    ) -> None:
        if not isinstance(cache_config, CacheConfig):
            raise TypeError(f"cache_config must be a kvtier.CacheConfig, got {type(cache_config).__name__}")
        if not isinstance(scope, ReuseScope):
            raise TypeError(f"scope must be a kvtier.ReuseScope, got {type(scope).__name__}")
        if not isinstance(recompute_when_faster, bool):
            raise TypeError(f"recompute_when_faster must be a bool, got {recompute_when_faster!r}")
        model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: its generate is the model's own
        device = next(model.parameters()).device
        if device.type == "meta":
            raise NotImplementedError(
                f"{type(model).__name__} has its weights offloaded (on the meta device: accelerate's cpu_offload, "
                "disk_offload or a device_map that offloads), which kvtier.hf does not serve: load the model "
                "onto one device"
            )
        if not same_device(device, cache_config.device):
            raise ValueError(f"cache_config.device is {cache_config.device}, the model is on {device}: use the same")
        self._model = model
        self._runner = wrapped_model(model)  # whose forwards generate runs: the call's hooks go there
        self.scope = scope
        self._scopes = AdapterScope(model, scope)  # each call's: with the PEFT adapters active then
        self._call_state = CallState(model)  # values a model keeps from its last call (cleared before each)
        self._call_state.clear()  # the probe's forwards extend a cache too
        self._layers: ModelLayers = read_model(model, model_id)
        self._weights = WeightWatch(model, self._layers.weights)
        self._attention = attention_implementation(model)  # the kernels its pages are computed with
        self._config = config_fingerprint(model.config)  # the settings its pages are computed with
        self.manager = _open_manager(self._layers.spec, cache_config)
        self._packing = state_packing(self._layers, self.manager)
        self._stacks = group_stacks(self.manager)  # how each call's load reads the pages
        self._forward_arguments = set(inspect.signature(self._runner.forward).parameters)
        self._calls = threading.RLock()  # one call at a time: the manager is driven by one thread
        self._pid = os.getpid()  # a forked child's copy is refused before it waits on ``_calls``
        self._last = threading.local()  # each thread's last call: ``last_reused_tokens``
        self._unsaved = RateLimitedWarning(log, "kvtier.hf: new blocks not saved")  # a primary tier too small
        self._placeholders = placeholder_ids(model.config)  # multimodal placeholder tokens (``token_bound``)
        # calls this long run as plain generate: a rotary embedding that rescales (``token_bound``), a
        # window the cache keeps and the attention does not apply (``window_check``, once a call is longer)
        self._length_limit = dynamic_rope_limit(model)
        self._window_to_check = uniform_window(self._layers)
        self._told_of_preset = False  # a generation config's cache_implementation, set aside (logged once)
        self._told_of_no_cache = False  # a generation config's use_cache=False, set aside (logged once)
        self._told_of_dropped_cache = False  # a call whose generate set kvtier's cache aside (logged once)
        self._told_of_noise = False  # a call in training mode with dropout or noise (logged once)
        self._told_of_hook: str | None = None  # the user hook a call last warned of (logged once each)
        self._told_of_unmerging = False  # a call whose forward unmerges a PEFT adapter (logged once)
        self._zero_types_matter: bool | None = None  # ``token_bound.zero_types_matter``, probed when first needed
        self._told_of_prompt_outputs = False  # a call asking for the prompt's hidden states or attentions
        self._told_of_padding = False  # a padded call on a model that computes padded rows its own way
        self._told_of_healing = False  # a call with token healing (logged once)
        self._prefill = None
        if recompute_when_faster:  # from the first call on, with the rate a manager on its disk tier measured last
            self._prefill = PrefillTiming(device, self.manager.remembered_prefill_rate)
            if self._prefill.rate is not None:
                self.manager.set_prefill_rate(self._prefill.rate)
        self._closed = False

    @property
    def model(self) -> torch.nn.Module:
        """The model given at construction (read-only: a PrefixCache serves that model's pages only;
        build another for another model)."""
        return self._model

    @property
    def spec(self):
        """The ``kvtier.ModelSpec`` read from the model."""
        return self._layers.spec

    def generate(self, input_ids: torch.Tensor, *args, **kwargs):
        """``model.generate(input_ids, attention_mask=attention_mask, **kwargs)``, reusing cached prefixes.

        Called as ``generate(input_ids, attention_mask=None, **kwargs)``; a second positional
        argument is the attention mask, or the call's ``generation_config`` where it is a
        ``GenerationConfig``, as ``model.generate(input_ids, generation_config)`` takes it.

        Sets ``last_reused_tokens`` (one entry per output row). Greedy, sampling and beam search (with
        or without sampling); sampling several sequences per row (``num_return_sequences``) repeats
        each row as ``generate`` does, so each copy reuses the row's prefix, and so do a row's beams
        (with ``position_ids`` or ``token_type_ids`` repeated alike; another tensor argument, such as
        images, or ``adapter_names`` raises ``NotImplementedError`` there).
        Beam search saves the prompts only. Assisted decoding, constrained or group beam search and
        static caches raise ``NotImplementedError``.
        A ``cache_implementation`` preset by the model's generation config (Gemma's "hybrid") is set
        aside: kvtier's dynamic cache serves the call, with the same tokens. A call that asks for the
        prompt's hidden states or attentions (``return_dict_in_generate`` with ``output_hidden_states``
        or ``output_attentions``) reuses nothing: ``generate`` returns them for every prompt position;
        nor does one with ``token_healing``: ``generate`` rewrites its prompt after kvtier matched it.
        A call from another thread meanwhile waits for this one to end.
        """
        self._last.tokens = []  # until the call is served: a refused call reused nothing
        if len(args) > 1:
            raise TypeError(
                f"generate() takes input_ids and at most one more positional argument (the attention mask or a "
                f"GenerationConfig), got {1 + len(args)}"
            )
        if args:  # ``model.generate``'s second parameter is its generation_config
            name = "generation_config" if isinstance(args[0], GenerationConfig) else "attention_mask"
            if name in kwargs:
                raise TypeError(f"generate() got multiple values for argument {name!r}")
            kwargs[name] = args[0]
        attention_mask = kwargs.pop("attention_mask", None)
        if os.getpid() != self._pid:  # a thread of the parent inside a call at the fork holds ``_calls`` for ever
            raise CacheStateError(
                f"this PrefixCache was made by process {self._pid}, of which this process is a forked child: "
                "build a PrefixCache in the child"
            )
        with self._calls:
            return self._serve(input_ids, attention_mask, kwargs)

    @property
    def last_reused_tokens(self) -> list[int]:
        """Per row of this thread's last ``generate`` call, the prompt tokens reused (not recomputed)."""
        return getattr(self._last, "tokens", [])

    def _serve(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict):
        if self._closed:
            raise CacheStateError("the PrefixCache is closed")
        config = self._generation_config(kwargs)  # (once a call: completing a passed one costs ~30 us)
        _check_inputs(input_ids, attention_mask, kwargs)  # first: the rows are repeated next
        input_ids, attention_mask, kwargs = self._one_sequence_per_row(input_ids, attention_mask, kwargs, config)
        self._check_arguments(kwargs, config)
        device = next(self._model.parameters()).device
        if not same_device(device, self.manager.device):
            raise CacheStateError(
                f"the model moved to {device} since this PrefixCache was built with its pages on "
                f"{self.manager.device}: move it back, or build a PrefixCache for {device}"
            )
        if attention_implementation(self._model) != self._attention:
            raise CacheStateError(
                "the model's attention (or experts) implementation changed since this PrefixCache was built "
                f"({self._attention} -> {attention_implementation(self._model)}): its pages hold keys and values of "
                "the other kernels. Set it back, or build a new PrefixCache"
            )
        if config_fingerprint(self._model.config) != self._config:
            raise CacheStateError(
                "the model's configuration changed since this PrefixCache was built (a setting such as "
                "sliding_window or the rotary scaling): its pages were computed, and are laid out, with the old "
                "one. Set it back, or build a new PrefixCache"
            )
        if not self._weights.unchanged() or self._scopes.merged_into_weights():
            raise CacheStateError(
                "the model's weights changed since this PrefixCache was built (an optimizer step, "
                "load_state_dict, an adapter merged into them): its pages hold keys and values of the old "
                "weights. Build a new PrefixCache for the new weights (close this one first to free its memory)"
            )
        mask = attention_mask if attention_mask is not None else self._inferred_mask(input_ids, kwargs, config)
        pads = left_pads(mask)
        noisy = random_module(self._model)
        if noisy is not None and not self._told_of_noise:
            self._told_of_noise = True
            log.warning(
                "%s is in training mode: its keys and values are random draws, so PrefixCache.generate "
                "reuses and saves nothing while it is (call model.eval() to reuse)",
                noisy,
            )
        unmerging = self._scopes.unmerged_in_call()
        if unmerging and not self._told_of_unmerging:
            self._told_of_unmerging = True
            log.info(
                "a call inside disable_adapter() over a merged PEFT adapter has PEFT unmerge it during the "
                "forward, leaving base weights kvtier sees only afterwards: such calls run as plain generate, "
                "reusing and saving nothing"
            )
        hooked = user_hook(self._model)
        if hooked is not None and hooked != self._told_of_hook:
            self._told_of_hook = hooked
            log.warning(
                "%s is registered on the model: kvtier cannot see how it changes keys and values, so "
                "PrefixCache.generate reuses and saves nothing while it is (a call runs as plain generate)",
                hooked,
            )
        window = self._window_to_check
        unprobed = window is not None and pads is not None and input_ids.shape[1] - min(pads) > window
        limit = self._length_limit  # a call this long reuses nothing (rotary frequencies or a window of its own)
        rescaled = limit is not None and pads is not None and input_ids.shape[1] - min(pads) >= limit
        rescaled = rescaled or (unprobed and self._check_window(window))
        padded = pads is not None and max(pads) > 0 and self._layers.padding is not None
        if padded and not self._told_of_padding:
            self._told_of_padding = True
            log.info(
                "%s computes left-padded rows its own way (%s): calls with padding run as plain generate, "
                "reusing and saving nothing",
                type(self._model).__name__,
                self._layers.padding,
            )
        healing = bool(kwargs.get("token_healing", getattr(config, "token_healing", False)))
        if healing and not self._told_of_healing:
            self._told_of_healing = True
            log.info(
                "a call with token_healing=True has generate rewrite its prompt (the last tokens merged, the "
                "first one made padding) after kvtier matched it: such calls run as plain generate, reusing "
                "and saving nothing"
            )
        plain = noisy is not None or hooked is not None or unmerging or rescaled or padded or healing
        if pads is None or plain:
            reused = [0] * (input_ids.shape[0] * _num_sequences(config, kwargs))
            self._last.tokens = reused
            out = self._model.generate(input_ids, attention_mask=attention_mask, **kwargs)
            self._last.tokens = reused  # (a call made from inside this one, by a callback, set its own)
            return out
        with torch.no_grad():
            return self._generate(input_ids, attention_mask, mask, pads, kwargs, config)

    def _check_window(self, window: int) -> bool:
        """Before the first call longer than the cache layers' window: if the model's attention does
        not apply it, calls that long run as plain ``generate`` from now on (``kvtier.hf.window_check``).
        True when this call must run plainly (the window is not applied, or the probe failed)."""
        try:
            applied = applies_window(self._model, self._layers, window)
        except Exception:  # (out of memory: two rows of the window's length) this call runs plainly; probed again
            log.warning("the probe of the model's window failed: this call runs as plain generate", exc_info=True)
            return True
        self._window_to_check = None
        if applied:
            return False
        self._length_limit = window + 1 if self._length_limit is None else min(self._length_limit, window + 1)
        log.info(
            "%s keeps a sliding window of %d tokens in its cache (config.sliding_window) but attends to the whole "
            "prompt: calls longer than the window run as plain generate, reusing and saving nothing (set "
            "config.sliding_window = None before building the PrefixCache if the model has no window)",
            type(self._model).__name__,
            window,
        )
        return True

    def _generate(self, input_ids, attention_mask, mask, pads: list[int], kwargs: dict, config):
        mgr = self.manager
        host_ids = input_ids.detach().to("cpu")
        rows = []
        try:
            if self._zero_types_matter is None and kwargs.get("token_type_ids") is not None:
                self._zero_types_matter = zero_types_matter(self._model)  # once, at the first call with types
            scopes = [
                typed_scope(with_numerics(scope, mgr.device, self._model), kwargs, bool(self._zero_types_matter))
                for scope in self._scopes.for_rows(len(pads), kwargs)
            ]
            bounds = row_bounds(host_ids, mask, pads, kwargs, config, self._placeholders)
            for i, (pad, bound, scope) in enumerate(zip(pads, bounds, scopes, strict=True)):
                prompt = host_ids[i, pad:].numpy()
                keyed = prompt if bound is None else prompt[: bound + 1]  # a match never covers its last token
                rows.append(Row(i, pad, prompt, mgr.create_cache(keyed, scope), scope, bound=bound))
            stream = torch.cuda.current_stream(mgr.device) if mgr.device.type == "cuda" else None
            cache = RecordingCache(self._model.config)
            cache.initialize_attention(mgr.spec.dtype, mgr.device)
            whole = _asks_for_prompt_outputs(kwargs, config)
            if whole and not self._told_of_prompt_outputs:
                self._told_of_prompt_outputs = True
                log.info(
                    "a call asking generate for the prompt's hidden states or attentions computes its whole "
                    "prompt (they are returned for every position): such calls reuse nothing"
                )
            if whole:  # every row's match is recomputed
                for row in rows:
                    row.write.recompute_from(0)
            width = 0 if whole else choose_width(mgr, rows, input_ids.shape[1], stream)
            load_prefix(cache, self._layers, mgr, rows, width, self._packing, self._stacks)
            release_reads(rows)
            beams = _num_beams(config, kwargs)
            per_row = _num_sequences(config, kwargs)  # beam search's; sampled copies are rows already
            reused = [row.reused for row in rows for _ in range(per_row)]
            self._last.tokens = reused
            recorder = None if whole else self._recorder(cache, rows)  # whole: one forward over the prompt
            hooks = [self._runner.register_forward_hook(recorder)] if recorder is not None else []
            ends = self._snapshot_ends(input_ids.shape[1], rows, width) if recorder is not None else []
            split = ends[-1] if ends else width  # where generate's own forward starts
            timing = self._prefill
            if kwargs.get("prefill_chunk_size", getattr(config, "prefill_chunk_size", None)):
                timing = None  # generate's first forward computes one chunk of the prompt: no sample of the rate
            try:
                if timing is not None:  # positions the prompt's forwards compute, a row's beams each
                    timing.begin(len(rows) * (split - width + beams * (input_ids.shape[1] - split)))
                self._call_state.clear()  # the cache given is not empty: nothing of the last call may be trusted
                if ends:
                    self._prefill_to_snapshots(input_ids, mask, ends, width, cache, kwargs.get("adapter_names"))
                if beams > 1:  # each row's beams, in turn, as generate repeats the rows
                    cache.repeat_rows(beams)
                    if recorder is not None:
                        recorder.stride = beams
                if timing is not None:
                    hooks.append(self._runner.register_forward_hook(timing.hook))  # generate's first forward
                arguments = {**kwargs, **_own_cache(kwargs, self._model.generation_config)}
                arguments[self._layers.cache_argument] = cache
                out = self._model.generate(input_ids, attention_mask=attention_mask, **arguments)
                self._last.tokens = reused  # (a call made from inside this one, by a callback, set its own)
            except BaseException:
                self._last.tokens = [0] * len(reused)  # a call that raised gave nothing: it reused nothing
                _reused_nothing(rows)
                raise
            finally:
                for hook in hooks:
                    hook.remove()
            rate = timing.end() if timing is not None else None
            if rate is not None:
                mgr.set_prefill_rate(rate)
            if held_columns(cache, self._layers) < input_ids.shape[1]:  # generate set it aside: its own computed all
                self._last.tokens = [0] * len(reused)
                _reused_nothing(rows)
                if not self._told_of_dropped_cache:
                    self._told_of_dropped_cache = True
                    log.warning(
                        "the model's generate set aside the cache PrefixCache gave it (its "
                        "prepare_inputs_for_generation drops it for some calls): such calls reuse and save nothing"
                    )
                return out
            if whole and self._packing is not None:  # no states recorded at the snapshot points
                return out
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            if beams > 1:  # the returned beams' tokens are not the cache's rows: the prompts are saved
                sequences = input_ids
            records = recorder.records if recorder is not None else None
            save_rows(
                mgr, self._layers, rows, cache, sequences, width, records, self._packing, self._unsaved, stream, beams
            )
            cache.forget_written()
            return out
        finally:
            close_rows(rows)
            mgr.maintain()  # the rows' published pages go to host memory in the background (write-through)

    def _recorder(self, cache: RecordingCache, rows: list[Row]) -> StateRecorder | None:
        """For a model with linear-attention layers: a hook keeping each row's states at its snapshot points
        (multiples of ``snapshot_interval_blocks`` blocks and the end of its prompt) past its reused prefix."""
        if self._packing is None:
            return None
        interval = self.manager.config.snapshot_interval_blocks * self.manager.tokens_per_block

        def wanted(i: int, position: int) -> bool:
            row = rows[i]
            return position > row.reused and (position % interval == 0 or position == len(row.prompt))

        return StateRecorder(cache, self._layers, [row.pad for row in rows], self._packing.pack, wanted)

    def _snapshot_ends(self, num_columns: int, rows: list[Row], width: int) -> list[int]:
        """The columns in ``(width, L)`` where a stretch of the prompt ends before ``generate`` runs the
        last one: every snapshot point a row has there, none past a row's bound (the inputs that
        reach beyond it are ``generate``'s alone)."""
        interval = self.manager.config.snapshot_interval_blocks * self.manager.tokens_per_block
        pads = {row.pad for row in rows}
        last = min((row.pad + row.bound for row in rows if row.bound is not None), default=num_columns)
        return sorted(
            {pad + m for pad in pads for m in range(interval, num_columns - pad, interval) if width < pad + m <= last}
        )

    def _prefill_to_snapshots(
        self, input_ids, mask, ends: list[int], width: int, cache: RecordingCache, adapter_names: list | None
    ) -> None:
        """Run the prompt columns ``[width, ends[-1])`` in stretches ending at ``ends`` (``_snapshot_ends``),
        one forward each, as ``generate`` would (same mask and positions, and PEFT's per-row
        ``adapter_names`` when given)."""
        device = self.manager.device
        ids = input_ids.to(device)
        mask = mask.to(device=device, dtype=torch.long)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        padded = not bool(mask.all())
        start = width
        for end in ends:
            arguments = {"input_ids": ids[:, start:end], "use_cache": True, self._layers.cache_argument: cache}
            if "position_ids" in self._forward_arguments:
                arguments["position_ids"] = positions[:, start:end]
            if padded:
                arguments["attention_mask"] = mask[:, :end]
            if "logits_to_keep" in self._forward_arguments:
                arguments["logits_to_keep"] = 1
            if adapter_names is not None:
                arguments["adapter_names"] = adapter_names
            self._model(**arguments)
            start = end

    def _one_sequence_per_row(self, input_ids, attention_mask, kwargs: dict, config):
        """Sampling ``num_return_sequences=n``: each row repeated ``n`` times in place, as ``generate``
        expands them itself before the prompt's forward (so the draws are the same), and the call
        asks for one sequence per row. Anything else is returned as given, to be checked."""
        n = _num_sequences(config, kwargs)
        shaped = isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2
        if n <= 1 or not shaped or _generation_mode(config, kwargs) is not GenerationMode.SAMPLE:
            return input_ids, attention_mask, kwargs
        per_token = {name: kwargs[name] for name in _PER_TOKEN_INPUTS if isinstance(kwargs.get(name), torch.Tensor)}
        per_row = [
            name
            for name, value in kwargs.items()
            if (isinstance(value, torch.Tensor) and name not in per_token) or name == "adapter_names"
        ]
        if per_row:  # generate expands these by rules of each model (images, adapters): not repeated here
            raise NotImplementedError(f"num_return_sequences > 1 with per-row arguments {per_row} is not supported")
        if attention_mask is not None:
            attention_mask = attention_mask.repeat_interleave(n, dim=0)
        repeated = {name: value.repeat_interleave(n, dim=0) for name, value in per_token.items()}
        return input_ids.repeat_interleave(n, dim=0), attention_mask, {**kwargs, **repeated, "num_return_sequences": 1}

    def _check_arguments(self, kwargs: dict, config) -> None:
        for name, what in _UNSUPPORTED.items():
            if kwargs.get(name) is not None:
                raise NotImplementedError(f"{what} ({name}=) is not supported by PrefixCache.generate")

        def setting(name: str):
            return kwargs.get(name, getattr(config, name, None))

        mode = _generation_mode(config, kwargs)
        if (setting("num_return_sequences") or 1) > 1 and mode not in _BEAM_MODES:
            raise NotImplementedError(
                "num_return_sequences > 1 is supported with sampling (do_sample=True) or beam search only"
            )
        if mode is GenerationMode.ASSISTED_GENERATION:
            raise NotImplementedError(
                "assisted decoding (assistant_model=, prompt_lookup_num_tokens=, assistant_early_exit= or use_mtp=, "
                "as an argument or in the generation config) is not supported by PrefixCache.generate"
            )
        if mode not in _SUPPORTED_MODES:
            raise NotImplementedError(f"{mode.value} is not supported by PrefixCache.generate")
        if kwargs.get("use_cache") is False or getattr(kwargs.get("generation_config"), "use_cache", None) is False:
            raise ValueError("PrefixCache.generate needs use_cache=True")
        if config.use_cache is False and "use_cache" not in kwargs and not self._told_of_no_cache:
            self._told_of_no_cache = True  # checkpoints saved after training with gradient checkpointing carry it
            log.info(
                "the model's generation config presets use_cache=False (a training setting saved with the "
                "checkpoint); PrefixCache.generate runs as generate(use_cache=True) does"
            )
        asked = kwargs.get("cache_implementation")
        if asked not in (None, "dynamic"):
            raise NotImplementedError(f"cache_implementation={asked!r} is not supported (kvtier fills a DynamicCache)")
        preset = getattr(config, "cache_implementation", None)
        if "cache_implementation" not in kwargs and preset == "quantized":  # its rounded keys give other tokens
            raise NotImplementedError(
                "the generation config asks for cache_implementation='quantized', whose rounded keys and values "
                "give other tokens than kvtier's exact pages; set generation_config.cache_implementation=None"
            )
        if "cache_implementation" not in kwargs and preset not in (None, "dynamic") and not self._told_of_preset:
            self._told_of_preset = True
            log.info(
                "the model's generation config asks for cache_implementation=%r; PrefixCache.generate runs "
                "with its own dynamic cache instead (the same tokens; a static cache serves torch.compile)",
                preset,
            )

    def _generation_config(self, kwargs: dict):
        """The call's generation config as ``generate`` completes it: the one it passes, its unset
        (None) settings taken from the model's, else the model's (the call's own arguments, which
        override both, are read beside it)."""
        passed = kwargs.get("generation_config")
        model_config = self._model.generation_config
        if passed is None:
            return model_config
        config = copy.copy(passed)
        for name, value in model_config.to_dict().items():  # set, not ``update``: its validation warns
            if getattr(config, name, None) is None and not callable(getattr(config, name, None)):
                setattr(config, name, value)
        return config

    def _inferred_mask(self, input_ids: torch.Tensor, kwargs: dict, config) -> torch.Tensor:
        """The mask ``generate`` infers without one: padding wherever ``pad_token_id`` appears, if it is
        set and is not an end-of-sequence token; else all ones."""
        pad = kwargs.get("pad_token_id", config.pad_token_id)
        eos = kwargs.get("eos_token_id", config.eos_token_id)
        eos = [] if eos is None else [int(e) for e in torch.as_tensor(eos, device="cpu").reshape(-1).tolist()]
        if pad is not None and int(pad) not in eos and bool((input_ids == int(pad)).any()):
            return (input_ids != int(pad)).long()
        return torch.ones_like(input_ids, dtype=torch.long)

    def close(self) -> None:
        """Close the manager (a disk tier persists its pages for the next process). Idempotent; in a
        forked child it does nothing (the manager is the parent's)."""
        if os.getpid() != self._pid:
            return
        with self._calls:
            if self._closed:
                return
            self._closed = True
            self._unsaved.flush()
            self.manager.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_inputs(input_ids, attention_mask, kwargs: dict) -> None:
    """``TypeError``/``ValueError`` unless the call gives token ids (a 2-D integer tensor, not empty),
    a mask of their shape or none, and no cache or embeddings of its own."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        raise TypeError("input_ids must be a 2-D integer tensor [batch, tokens]")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids is empty: shape {tuple(input_ids.shape)}")
    if attention_mask is not None and (
        not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape
    ):
        raise ValueError("attention_mask must be a tensor of input_ids' shape")
    for name in _CACHE_ARGUMENTS:
        if name in kwargs:
            raise ValueError(f"PrefixCache.generate supplies the cache: do not pass {name}=")
    if "inputs_embeds" in kwargs or "inputs" in kwargs:
        raise ValueError("PrefixCache.generate takes input_ids (token ids), not inputs/inputs_embeds")


def _asks_for_prompt_outputs(kwargs: dict, config) -> bool:
    """Whether ``generate`` returns outputs for every prompt position (hidden states, attentions of
    its first forward), which only a forward over the whole prompt computes."""

    def setting(name: str) -> bool:
        return bool(kwargs.get(name, getattr(config, name, False)))

    return setting("return_dict_in_generate") and (setting("output_hidden_states") or setting("output_attentions"))


def _num_beams(config, kwargs: dict) -> int:
    """The beams per row of a beam search call (1 for any other decoding)."""
    if _generation_mode(config, kwargs) not in _BEAM_MODES:
        return 1
    return int(kwargs.get("num_beams", getattr(config, "num_beams", None) or 1))


def _num_sequences(config, kwargs: dict) -> int:
    """The sequences ``generate`` returns per row."""
    return int(kwargs.get("num_return_sequences", getattr(config, "num_return_sequences", None)) or 1)


def _generation_mode(config, kwargs: dict) -> GenerationMode:
    """The decoding ``generate`` runs for these arguments, by transformers' own rule, on a copy of
    ``config`` updated with them (arguments that are not settings are left out)."""
    effective = copy.copy(config)
    for name, value in kwargs.items():  # set, not ``update``: its validation would warn twice
        if hasattr(effective, name) and not callable(getattr(effective, name)):
            setattr(effective, name, value)
    return effective.get_generation_mode(kwargs.get("assistant_model"))


def _own_cache(kwargs: dict, model_config) -> dict:
    """Arguments that have ``generate`` decode with the cache kvtier filled: no
    ``cache_implementation`` (one beside a cache is an error), ``use_cache=True`` (over a generation
    config's ``use_cache=False``; the call's own was checked).

    A passed ``generation_config`` carries them, in a copy: transformers deprecates settings passed
    beside one (and warns of them as the caller's). Not where the model's own config presets a
    cache implementation: ``generate`` fills a passed config's unset fields from it, so the
    arguments must carry them."""
    passed = kwargs.get("generation_config")
    if passed is None or getattr(model_config, "cache_implementation", None) not in (None, "hybrid"):
        return dict(_OWN_CACHE)  # ("hybrid": generate unsets it)
    config = copy.deepcopy(passed)
    for name, value in _OWN_CACHE.items():
        setattr(config, name, value)
    # the call's own settings (None / "dynamic", True: checked) stay beside the config, as given
    return {"generation_config": config, **{name: value for name, value in _OWN_CACHE.items() if name in kwargs}}


def _open_manager(spec: ModelSpec, config: CacheConfig) -> KVCacheManager:
    """The manager of ``config``, its disk tier in the first replica directory of the tier's path that
    no other process of the model holds (``kvtier.storage.disk_replicas``: the ranks of a job)."""
    disk = next((tier for tier in config.tiers if isinstance(tier, DiskTier)), None)
    if disk is None:
        return KVCacheManager(spec, config)

    def at(path: str) -> KVCacheManager:
        tiers = [dataclasses.replace(tier, path=path) if tier is disk else tier for tier in config.tiers]
        return KVCacheManager(spec, dataclasses.replace(config, tiers=tiers))

    return open_first_free(os.fspath(disk.path), at)


def _reused_nothing(rows: list[Row]) -> None:
    """The call computed every row whole: the rows' matches count as recomputed, not as hits."""
    for row in rows:
        if row.write.state is not CacheState.CLOSED:
            row.write.recompute_from(0)
