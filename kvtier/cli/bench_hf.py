"""``kvtier bench hf``: time to first token of a chat's second turn through ``kvtier.hf.PrefixCache``.

A Llama-3-8B-shaped transformers model (random weights, bf16, SDPA). For each history length the
second turn's prompt is the history plus a new suffix, timed five ways:

    recompute  plain ``model.generate``: the whole prompt is prefilled
    resident   ``model.generate`` with the history already in a ``DynamicCache`` on the GPU (the floor)
    gpu        ``pc.generate`` with the history's pages in the primary tier
    host       ``pc.generate`` with the history pushed out to pinned host memory
    disk       ``pc.generate`` on a cache without a host tier, the history pushed out to disk (the
               OS page cache dropped where the system allows it); it weighs loading against
               recomputing (``recompute_when_faster``), so once the disk's speed is measured (the
               warm-up call) a slow disk's blocks are recomputed
    disk-load  the same with ``recompute_when_faster=False``: every cached block is loaded
    restart    the first call of a new ``PrefixCache`` on the disk case's directory (the OS page cache
               dropped), as a restarted process makes it: it weighs its loads with the rates the
               last one kept in the directory (before they were kept, it loaded every block)

TTFT runs from the call to the first generated token handed to a streamer (``generate`` copies
it to the host, so the device is done with it); each timed call uses a suffix no call has used.
Prompts are passed on the host, as ``generate`` allows: a streamer given device ids copies them
back first, which would make the forward's launch wait for every copy queued before it.
``build`` is what ``pc.generate`` does before the model runs, timed on its own with device syncs:
``match`` (``create_cache``), ``resume`` (promoting the history's pages) and ``fill`` (the
transformers cache filled from the pages); its share of the TTFT is reported. The host target of
issue 11 is 1.3 x (history bytes / measured link) + the resident TTFT. Each case's last call is
compared with plain ``generate`` by first-token logits (relative error, same argmax).
``--tiny`` runs a two-layer model, for a smoke run on a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import tempfile
import time
import warnings

from kvtier.cli.arguments import at_least, device, gibibytes, kept_directory, lengths
from kvtier.cli.bench_machine import drop_page_cache, link_ceiling_gbps, link_ceiling_line

LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=65536,
    rope_theta=500000.0,
)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=65536,
)

TIER_GIB = {"primary_gib": 24.0, "host_gib": 12.0, "disk_gib": 12.0}
# what generate warns of for prompt ids on the host beside a GPU model: the bench's choice (module docstring)
HOST_IDS_WARNING = r"You are calling \.generate\(\) with the `input_ids` being on a device type different"
PREFILL_GIB = 16.0  # left for a 32K prompt's generate (its cache, activations) beside the tiers and resident caches
TINY_TIER_GIB = {"primary_gib": 0.5, "host_gib": 0.25, "disk_gib": 0.25}  # 256 bytes a token: 32K tokens are 8 MiB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", type=device, default=None, help="default: cuda; cpu with --tiny where CUDA is not available"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float64"])
    parser.add_argument("--histories", type=lengths, default=[4096, 16384, 32768], help="history lengths in tokens")
    parser.add_argument("--suffix", type=at_least(1), default=64, help="new prompt tokens of the second turn")
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--tokens-per-block", type=at_least(1), default=32)
    parser.add_argument(
        "--primary-gib",
        type=gibibytes,
        default=None,
        help="each of the three caches' GPU tier; default: 24, less where three do not fit the GPU's free memory "
        "beside the model and a prefill (0.5 with --tiny)",
    )
    parser.add_argument("--host-gib", type=gibibytes, default=None, help="default: 12 (0.25 with --tiny)")
    parser.add_argument("--disk-gib", type=gibibytes, default=None, help="default: 12 (0.25 with --tiny)")
    parser.add_argument(
        "--disk-path",
        type=kept_directory,
        default=None,
        help="disk tier directory, kept (default: a temporary one, removed after)",
    )
    parser.add_argument("--tiny", action="store_true", help="a two-layer model (a smoke run, e.g. on a CPU)")


def run(args: argparse.Namespace) -> int:
    import torch

    fit_primary = args.primary_gib is None and not args.tiny
    if not _fill_defaults(args, torch.cuda.is_available()):
        raise ValueError(
            "it times an 8B-shaped model and needs a CUDA device; none is available here "
            "(--tiny runs a two-layer model on the CPU; --device cpu runs the 8B shape there)"
        )
    bench = _Bench(args, fit_primary)
    ceiling = link_ceiling_gbps(bench.device)
    rows = []
    try:
        for length in args.histories:
            rows.extend(bench.history(length, ceiling))
    finally:
        bench.close()
    result = {"link_ceiling_gbps": ceiling, "rows": rows, "args": vars(args), "torch": torch.__version__}
    result["model"] = TINY if args.tiny else LLAMA_8B
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    _print_table(rows, ceiling)
    return 0


def _fill_defaults(args: argparse.Namespace, cuda: bool) -> bool:
    """Fill the defaults the parser left open: the device (cuda; cpu for a ``--tiny`` run where there
    is no CUDA) and the tier sizes (for the 8B model's histories, or the tiny model's). False when no
    device was given, there is no CUDA and the run is not ``--tiny``."""
    if args.device is None:
        if not (cuda or args.tiny):
            return False
        args.device = "cuda" if cuda else "cpu"
    for name, gib in (TINY_TIER_GIB if args.tiny else TIER_GIB).items():
        if getattr(args, name) is None:
            setattr(args, name, gib)
    return True


def _fitting_primary_gib(device, wanted: float, history_gib: float) -> float:
    """``wanted`` GiB, or less where three primary tiers of it would not fit the GPU memory free now
    (the model loaded) beside the resident case's two caches of the longest history (``history_gib``
    each) and ``PREFILL_GIB`` for a forward; ``ValueError`` where too little is free."""
    import torch

    free = torch.cuda.mem_get_info(device)[0] / (1 << 30)
    fits = (free - 2 * history_gib - PREFILL_GIB) / 3
    if fits < 1:
        raise ValueError(
            f"{free:.1f} GiB of the GPU is free beside the model: too little for the three caches' GPU tiers "
            "and a prefill; pass a smaller --primary-gib (and --histories)"
        )
    return min(wanted, float(int(fits * 2)) / 2)  # in half GiB steps


class _Bench:
    def __init__(self, args: argparse.Namespace, fit_primary: bool = False) -> None:
        import torch
        import transformers

        import kvtier
        from kvtier.hf import PrefixCache
        from kvtier.hf.model_layers import cache_argument

        self.torch = torch
        self.args = args
        self.device = torch.device(args.device)
        dtype = getattr(torch, args.dtype)
        config = transformers.LlamaConfig(**(TINY if args.tiny else LLAMA_8B))
        with self.device:
            self.model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        self.model.eval()
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = 0
        self.vocab = config.vocab_size
        self.gen = torch.Generator().manual_seed(1234)
        if fit_primary and self.device.type == "cuda":
            head_dim = config.hidden_size // config.num_attention_heads
            token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize
            history_gib = max(args.histories) * token_bytes / (1 << 30)
            args.primary_gib = _fitting_primary_gib(self.device, args.primary_gib, history_gib)
        self.cache_name = cache_argument(self.model)  # "cache", or "past_key_values" before transformers named it so
        model_id = kvtier.weights_fingerprint(self.model)
        gib = 1 << 30
        self._temporary = None if args.disk_path else tempfile.TemporaryDirectory(prefix="kvtier-bench-hf-")
        path = args.disk_path or self._temporary.name
        primary = kvtier.PrimaryTier(int(args.primary_gib * gib))
        host_tiers = [primary, kvtier.HostTier(int(args.host_gib * gib))]
        disk_tiers = [primary, kvtier.DiskTier(int(args.disk_gib * gib), os.path.join(path, "disk"))]
        load_tiers = [primary, kvtier.DiskTier(int(args.disk_gib * gib), os.path.join(path, "disk-load"))]
        tpb = args.tokens_per_block
        self.disk_config = kvtier.CacheConfig(tpb, disk_tiers, device=args.device)
        self.model_id = model_id
        with contextlib.ExitStack() as opened:  # one that cannot be opened closes those opened before it
            if self._temporary is not None:
                opened.callback(self._temporary.cleanup)
            self.host_pc = opened.enter_context(
                PrefixCache(self.model, kvtier.CacheConfig(tpb, host_tiers, device=args.device), model_id=model_id)
            )
            self.disk_pc = opened.enter_context(PrefixCache(self.model, self.disk_config, model_id=model_id))
            self.disk_load_pc = opened.enter_context(
                PrefixCache(
                    self.model,
                    kvtier.CacheConfig(tpb, load_tiers, device=args.device),
                    model_id=model_id,
                    recompute_when_faster=False,
                )
            )
            opened.pop_all()
        mgr = self.host_pc.manager
        self.bytes_per_token = sum(mgr.page_bytes(g.group_id) for g in mgr.layer_groups) // tpb

    def close(self) -> None:
        """Close the three prefix caches, then remove the disk tiers' directory unless it was given."""
        self.host_pc.close()
        self.disk_pc.close()
        self.disk_load_pc.close()
        if self._temporary is not None:
            self._temporary.cleanup()

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def tokens(self, n: int) -> list[int]:
        return self.torch.randint(1, self.vocab, (n,), generator=self.gen).tolist()

    def _ttft(self, generate, prompt: list[int], **kwargs) -> tuple[float, object]:
        """(seconds to the first generated token, generate's output with logits)."""
        from kvtier.cli.hf_demo import FirstTokenClock

        torch = self.torch
        ids = torch.tensor([prompt])  # on the host: the streamer gets the prompt without waiting for the device
        mask = torch.ones_like(ids)
        self.sync()
        clock = FirstTokenClock()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=HOST_IDS_WARNING, category=UserWarning)
            out = generate(
                ids,
                attention_mask=mask,
                max_new_tokens=1,
                do_sample=False,
                streamer=clock,
                return_dict_in_generate=True,
                output_logits=True,
                **kwargs,
            )
        return clock.first_token_s, out

    def history(self, length: int, ceiling: float) -> list[dict]:
        """Every case for one history length. Per case: ``suffixes[0]`` warms up, the next ``repeats``
        are timed, the last one times the build stages; the last timed call's logits are checked."""
        from transformers import DynamicCache

        torch = self.torch
        args = self.args
        history = self.tokens(length)
        suffixes = {case: [self.tokens(args.suffix) for _ in range(args.repeats + 2)] for case in _CASES}
        rows = []

        generate = self.model.generate
        times = [self._ttft(generate, history + s)[0] for s in suffixes["recompute"][: args.repeats + 1]][1:]
        recompute = statistics.median(times)
        rows.append(self._row(length, "recompute", times, recompute))

        resident_cache = DynamicCache(config=self.model.config)  # the history prefilled once, copied per call
        with torch.no_grad():
            ids = torch.tensor([history], device=self.device)
            self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self.cache_name: resident_cache})
        times = []
        for suffix in suffixes["resident"][: args.repeats + 1]:
            cache = copy.deepcopy(resident_cache)
            times.append(self._ttft(generate, history + suffix, **{self.cache_name: cache})[0])
            del cache
        del resident_cache
        resident = statistics.median(times[1:])
        rows.append(self._row(length, "resident", times[1:], recompute))

        pcs = {"gpu": self.host_pc, "host": self.host_pc, "disk": self.disk_pc, "disk-load": self.disk_load_pc}
        for case, pc in pcs.items():
            push = case != "gpu"
            if case != "host":  # the host case finds the history the gpu case saved
                pc.generate(torch.tensor([history], device=self.device), max_new_tokens=1)
            times, reused, out = [], [], None
            for suffix in suffixes[case][: args.repeats + 1]:
                self._push(pc, push)
                t, out = self._ttft(pc.generate, history + suffix)
                times.append(t)
                reused.append(pc.last_reused_tokens[0])
            logits = out.logits[0][0].float()
            expected = self._ttft(generate, history + suffixes[case][args.repeats])[1].logits[0][0].float()
            build, by_tier = self._build(pc, history + suffixes[case][-1], push)
            row = self._row(length, case, times[1:], recompute, build)
            row["reused_tokens"] = reused[-1]
            row["build_reused_by_tier"] = by_tier
            row["logit_rel_err"] = float((logits - expected).norm() / expected.norm())
            row["same_argmax"] = int(logits.argmax()) == int(expected.argmax())
            row["history_bytes"] = length * self.bytes_per_token
            if case == "host" and ceiling:
                row["target_ms"] = (1.3 * row["history_bytes"] / (ceiling * 1e9) + resident) * 1e3
            rows.append(row)
        rows.append(self._restart(history, suffixes["restart"], recompute))
        return rows

    def _restart(self, history: list[int], suffixes: list[list[int]], recompute: float) -> dict:
        """The first call of a new ``PrefixCache`` on the disk case's directory, ``repeats`` times."""
        from kvtier.hf import PrefixCache

        times, reused, out = [], [], None
        for suffix in suffixes[: self.args.repeats]:
            self.disk_pc.close()  # its pages and measured rates stay in the directory
            self.disk_pc = PrefixCache(self.model, self.disk_config, model_id=self.model_id)
            drop_page_cache()
            t, out = self._ttft(self.disk_pc.generate, history + suffix)
            times.append(t)
            reused.append(self.disk_pc.last_reused_tokens[0])
        logits = out.logits[0][0].float()
        expected = self._ttft(self.model.generate, history + suffixes[self.args.repeats - 1])[1].logits[0][0].float()
        row = self._row(len(history), "restart", times, recompute)
        row["reused_tokens"] = reused[-1]
        row["logit_rel_err"] = float((logits - expected).norm() / expected.norm())
        row["same_argmax"] = int(logits.argmax()) == int(expected.argmax())
        return row

    def _push(self, pc, push: bool) -> None:
        """Fill the primary tier with a cache of its own, as other traffic would: the history moves down."""
        if not push:
            return
        mgr = pc.manager
        filler = mgr.create_cache([0])
        assert filler.resume()
        pages = mgr.stats().tiers["primary"].pages_total // len(mgr.layer_groups)
        assert filler.resize(pages * mgr.tokens_per_block), "the primary tier could not be emptied"
        filler.close()
        self.sync()
        if pc is not self.host_pc:
            drop_page_cache()

    def _build(self, pc, prompt: list[int], push: bool) -> tuple[dict, dict]:
        """The stages of ``pc.generate`` before the model runs, each timed with device syncs; and the
        tokens the match found on each tier."""
        from kvtier.hf.batch_rows import Row, choose_width, close_rows
        from kvtier.hf.hf_cache import RecordingCache
        from kvtier.hf.prefix_load import load_prefix

        torch = self.torch
        self._push(pc, push)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        mgr = pc.manager
        self.sync()
        t0 = time.perf_counter()
        rows = [Row(0, 0, prompt, mgr.create_cache(prompt, pc.scope), pc.scope)]
        cache = RecordingCache(pc.model.config)
        cache.initialize_attention(mgr.spec.dtype, mgr.device)
        t1 = time.perf_counter()
        by_tier = dict(rows[0].write.reused_by_tier)
        width = choose_width(mgr, rows, len(prompt), stream)
        self.sync()
        t2 = time.perf_counter()
        # the adapter's own stages, timed apart
        load_prefix(cache, pc._layers, mgr, rows, width, pc._packing, pc._stacks)
        self.sync()
        t3 = time.perf_counter()
        close_rows(rows)
        del cache
        stages = {"match_ms": (t1 - t0) * 1e3, "resume_ms": (t2 - t1) * 1e3, "fill_ms": (t3 - t2) * 1e3}
        return stages, by_tier

    def _row(self, length, case, times, recompute, build=None) -> dict:
        ttft = statistics.median(times)
        row = {"history": length, "case": case, "ttft_ms": ttft * 1e3, "ttft_all_ms": [t * 1e3 for t in times]}
        row["speedup_vs_recompute"] = recompute / ttft
        if build is not None:
            row.update(build)
            row["build_ms"] = build["match_ms"] + build["resume_ms"] + build["fill_ms"]
            row["build_share"] = row["build_ms"] / row["ttft_ms"]
        return row


_CASES = ("recompute", "resident", "gpu", "host", "disk", "disk-load", "restart")


def _print_table(rows: list[dict], ceiling: float) -> None:
    print(link_ceiling_line(ceiling))
    header = f"{'history':>7} {'case':<9} {'TTFT ms':>8} {'x recomp':>8} {'build ms':>8} {'match':>6} {'resume':>6}"
    header += f" {'fill':>6} {'share':>5} {'target':>7} {'logit err':>9} {'argmax':>6} {'reused':>7}"
    print(header)
    nan = float("nan")
    for r in rows:
        print(
            f"{r['history']:>7} {r['case']:<9} {r['ttft_ms']:>8.1f} {r['speedup_vs_recompute']:>8.2f} "
            f"{r.get('build_ms', nan):>8.1f} {r.get('match_ms', nan):>6.1f} {r.get('resume_ms', nan):>6.1f} "
            f"{r.get('fill_ms', nan):>6.1f} {r.get('build_share', nan):>5.2f} {r.get('target_ms', nan):>7.1f} "
            f"{r.get('logit_rel_err', nan):>9.4f} {r.get('same_argmax', '')!s:>6} {r.get('reused_tokens', ''):>7}"
        )
