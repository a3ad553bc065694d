"""``kvtier demo --hf``: the multi-turn chat workload on a random-weight transformers Llama.

Every turn of every conversation runs twice: plain ``model.generate`` (the baseline: the whole
prompt is computed) and ``kvtier.hf.PrefixCache.generate`` over primary + host + disk tiers (the
disk in a temporary directory). It prints TTFT p50/p90 of both, prompt tokens reused, hits by
tier and bytes moved, writes a PNG of TTFT per turn, and checks that both produced the same
tokens (exactly in float64; by common prefix in lower precisions). TTFT is the time from the
call to the first generated token handed to a streamer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field

from kvtier.cli.run_summary import common_prefix_share, percentile

# A small Llama: 4 layers, 4 KV heads of 16 dims (4 KiB of float64 KV per token: a conversation of
# the default workload grows to 3.5 MiB, so with the demo's default tiers pages reach the disk).
HF_LLAMA = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)


class FirstTokenClock:
    """A ``generate`` streamer that notes when the first generated token arrives (the prompt comes first)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first_token_s: float | None = None
        self._puts = 0

    def put(self, value) -> None:
        self._puts += 1
        if self._puts == 2 and self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.start

    def end(self) -> None:
        pass


@dataclass(slots=True)
class HfRun:
    """What one side of the comparison produced, per (turn, conversation)."""

    label: str
    ttft_s: list[tuple[int, float]] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)
    prompt_tokens: int = 0
    reused_tokens: int = 0


def run_hf(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.progress import Progress
    from transformers import LlamaConfig, LlamaForCausalLM

    import kvtier
    from kvtier.cli.chat_workload import ChatWorkload
    from kvtier.hf import PrefixCache

    console = Console()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = LlamaForCausalLM(LlamaConfig(**HF_LLAMA)).to(dtype).eval()
    model.generation_config.eos_token_id = None  # answers of the asked length, as in the engine demo
    workload = ChatWorkload(
        args.conversations, args.turns, args.system_tokens, args.user_tokens, args.answer_tokens, args.seed
    )
    system, users = workload.user_texts(HF_LLAMA["vocab_size"])
    baseline, cached = HfRun("baseline"), HfRun("kvtier")
    mib = 1 << 20
    with tempfile.TemporaryDirectory(prefix="kvtier-hf-demo-") as disk_dir, Progress(console=console) as progress:
        tiers = [
            kvtier.PrimaryTier(int(args.primary_mib * mib)),
            kvtier.HostTier(int(args.host_mib * mib)),
            kvtier.DiskTier(int(args.disk_mib * mib), disk_dir),
        ]
        config = kvtier.CacheConfig(16, tiers, device=args.device)
        task = progress.add_task("turns", total=workload.turns * workload.conversations)
        with PrefixCache(model, config) as pc:
            if args.metrics_port:
                from kvtier.metrics import serve

                console.print(f"metrics: {serve(pc.manager, args.metrics_port).url}")
            history = [list(system) for _ in range(workload.conversations)]
            for turn in range(workload.turns):
                for c in range(workload.conversations):
                    prompt = history[c] + users[c][turn]
                    ids = torch.tensor([prompt], device=args.device)
                    for run, generate in ((baseline, model.generate), (cached, pc.generate)):
                        clock = FirstTokenClock()
                        out = generate(
                            ids,
                            attention_mask=torch.ones_like(ids),
                            max_new_tokens=args.answer_tokens,
                            do_sample=False,
                            streamer=clock,
                        )
                        run.ttft_s.append((turn, clock.first_token_s or time.perf_counter() - clock.start))
                        run.answers.append(out[0, len(prompt) :].tolist())
                        run.prompt_tokens += len(prompt)
                    cached.reused_tokens += pc.last_reused_tokens[0]
                    history[c] = prompt + cached.answers[-1]
                    progress.advance(task)
            stats = pc.manager.stats()
    summary = _summary(baseline, cached, stats, workload.turns)
    summary["identical_tokens"] = baseline.answers == cached.answers
    summary["common_prefix_share"] = common_prefix_share(baseline.answers, cached.answers)
    exact = args.dtype == "float64"
    _print(console, summary, exact)
    _plot(baseline, cached, workload.turns, args.plot)
    console.print(f"TTFT per turn plotted to {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if summary["identical_tokens"] or not exact else 1


def _summary(baseline: HfRun, cached: HfRun, stats, turns: int) -> dict:
    out: dict = {"model": "transformers LlamaForCausalLM " + json.dumps(HF_LLAMA), "runs": {}}
    for run in (baseline, cached):
        ttfts = [t * 1e3 for _, t in run.ttft_s]
        out["runs"][run.label] = {
            "ttft_p50_ms": percentile(ttfts, 0.5),
            "ttft_p90_ms": percentile(ttfts, 0.9),
            "prompt_tokens": run.prompt_tokens,
            "reused_prompt_tokens": run.reused_tokens,
            "ttft_ms_by_turn": [statistics.fmean(t * 1e3 for n, t in run.ttft_s if n == turn) for turn in range(turns)],
        }
    out["runs"]["kvtier"].update(
        hit_tokens_by_tier=stats.hit_tokens,
        bytes_copied=stats.bytes_copied,
        demotions=stats.demotions,
        promotions=stats.promotions,
    )
    return out


def _print(console, summary: dict, exact: bool) -> None:
    from rich.table import Table

    base, kv = summary["runs"]["baseline"], summary["runs"]["kvtier"]
    table = Table(title="kvtier demo --hf: transformers generate, plain vs kvtier.hf.PrefixCache")
    table.add_column("")
    table.add_column("model.generate", justify="right")
    table.add_column("PrefixCache", justify="right")
    table.add_row("TTFT p50 (ms)", f"{base['ttft_p50_ms']:.1f}", f"{kv['ttft_p50_ms']:.1f}")
    table.add_row("TTFT p90 (ms)", f"{base['ttft_p90_ms']:.1f}", f"{kv['ttft_p90_ms']:.1f}")
    table.add_row("prompt tokens", str(base["prompt_tokens"]), str(kv["prompt_tokens"]))
    table.add_row("prompt tokens reused", "0", str(kv["reused_prompt_tokens"]))
    for tier, n in kv["hit_tokens_by_tier"].items():
        table.add_row(f"reused from {tier}", "", str(n))
    for edge, n in sorted(kv["bytes_copied"].items()):
        table.add_row(f"bytes {edge}", "", f"{n / (1 << 20):.1f} MiB")
    console.print(table)
    if summary["identical_tokens"]:
        console.print("[green]both produced the same tokens[/green]")
    elif exact:
        console.print("[red]the runs produced different tokens: this is a bug[/red]")
    else:
        share = summary["common_prefix_share"]
        console.print(f"answers agree on {100 * share:.1f}% of their tokens (common prefix; not float64)")


def _plot(baseline: HfRun, cached: HfRun, turns: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in (baseline, cached):
        means = [statistics.fmean(t * 1e3 for n, t in run.ttft_s if n == turn) for turn in range(turns)]
        ax.plot(range(1, turns + 1), means, marker="o", label=run.label)
    ax.set_xticks(range(1, turns + 1))
    ax.set_xlabel("turn")
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_title("transformers Llama: time to first token per turn")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
