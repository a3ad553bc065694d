"""``kvtier demo``: the main job. A multi-turn chat workload, kvtier against a no-reuse baseline.

On the embedded default, a small random-weight model runs on the CPU in float64 over primary +
host + disk tiers (the disk in a temporary directory), sized so that pages really move down the
tiers between turns. It prints TTFT p50/p90, prompt tokens computed and reused, hit rates by tier
and bytes moved, writes a PNG of TTFT per turn, and checks that both runs produced the same
tokens (exactly in float64; by common prefix in lower precisions, where a different reduction
order may flip a near-tie). ``--hf`` runs the workload on a transformers Llama through
``kvtier.hf.PrefixCache`` instead, against plain ``model.generate`` (``kvtier/cli/hf_demo.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile

from kvtier.cli.arguments import at_least, between, device, free_port, mebibytes, non_empty, output_file, plot_file
from kvtier.cli.run_summary import common_prefix_share, percentile

MAX_PART_TOKENS = 1 << 20  # a system prompt, user turn or answer: longer than any model's context
DEFAULT_MODEL = "small-llama"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=non_empty,
        default=DEFAULT_MODEL,
        help="a kvtier.models name or a Llama/Mistral checkpoint directory (the engine's demo; not with --hf)",
    )
    parser.add_argument("--device", type=device, default="cpu")
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32", "bfloat16", "float16"])
    parser.add_argument("--conversations", type=at_least(1), default=8)
    parser.add_argument("--turns", type=at_least(1), default=5)
    parser.add_argument("--system-tokens", type=between(0, MAX_PART_TOKENS), default=512)
    parser.add_argument("--user-tokens", type=between(1, MAX_PART_TOKENS), default=48)
    parser.add_argument("--answer-tokens", type=between(1, MAX_PART_TOKENS), default=24)
    parser.add_argument("--primary-mib", type=mebibytes, default=4.0)
    parser.add_argument("--host-mib", type=mebibytes, default=3.0)
    parser.add_argument("--disk-mib", type=mebibytes, default=64.0)
    parser.add_argument("--plot", type=plot_file, default="kvtier-demo-ttft.png", help="where to write the TTFT plot")
    parser.add_argument("--json", metavar="PATH", type=output_file, help="write the figures as JSON")
    parser.add_argument("--metrics-port", type=free_port, help="serve kvtier's Prometheus metrics on this port")
    parser.add_argument("--seed", type=between(-(1 << 63), (1 << 64) - 1), default=0, help="in torch's seed range")
    parser.add_argument("--hf", action="store_true", help="the workload on a transformers Llama via kvtier.hf")


def run(args: argparse.Namespace) -> int:
    if args.hf:
        from kvtier.cli.hf_demo import run_hf

        if args.model != DEFAULT_MODEL:
            raise ValueError(
                f"--model {args.model!r} is the engine's; --hf runs a random transformers Llama of its own"
            )

        return run_hf(args)
    import torch
    from rich.console import Console
    from rich.progress import Progress

    import kvtier
    from kvtier.cli.chat_workload import ChatWorkload, run_workload
    from kvtier.engine import LLMEngine, SchedulerConfig
    from kvtier.models import build_model

    console = Console()
    workload = ChatWorkload(
        args.conversations, args.turns, args.system_tokens, args.user_tokens, args.answer_tokens, args.seed
    )
    model = build_model(args.model, args.device, getattr(torch, args.dtype), seed=args.seed)
    mib = 1 << 20
    records, stats = {}, {}
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as disk_dir, Progress(console=console) as progress:
        total = workload.conversations * workload.turns
        for label, reuse in (("baseline", False), ("kvtier", True)):
            tiers = [
                kvtier.PrimaryTier(int(args.primary_mib * mib)),
                kvtier.HostTier(int(args.host_mib * mib)),
                kvtier.DiskTier(int(args.disk_mib * mib), f"{disk_dir}/{label}"),
            ]
            config = kvtier.CacheConfig(16, tiers, device=args.device, enable_reuse=reuse)
            with LLMEngine(model, config, SchedulerConfig(policy="max_utilization", max_num_tokens=1024)) as engine:
                if args.metrics_port and reuse:
                    from kvtier.metrics import serve

                    console.print(f"metrics: {serve(engine.cache_manager, args.metrics_port).url}")
                task = progress.add_task(f"{label:<8}", total=total)
                records[label] = run_workload(engine, workload, label, lambda task=task: progress.advance(task))
                stats[label] = engine.cache_manager.stats()
    base_answers, kv_answers = records["baseline"].answers(), records["kvtier"].answers()
    same, agreement = base_answers == kv_answers, common_prefix_share(base_answers, kv_answers)
    exact = args.dtype == "float64"
    summary = _summary(records, stats, workload, vars(args))
    summary["identical_tokens"] = same
    summary["common_prefix_share"] = agreement
    _print(console, summary, exact)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    _plot(records, args.plot)
    console.print(f"TTFT per turn plotted to {args.plot}")
    return 0 if same or not exact else 1


def _summary(records: dict, stats: dict, workload, args: dict) -> dict:
    """The runs' figures, beside the workload and the command's arguments that made them."""
    out: dict = {"workload": dataclasses.asdict(workload), "args": args, "runs": {}}
    for label, record in records.items():
        ttfts = [t.output.ttft_s * 1e3 for t in record.turns]
        computed = sum(t.output.num_computed_prompt_tokens for t in record.turns)
        prompt = sum(t.output.num_prompt_tokens for t in record.turns)
        st = stats[label]
        out["runs"][label] = {
            "ttft_p50_ms": percentile(ttfts, 0.5),
            "ttft_p90_ms": percentile(ttfts, 0.9),
            "prompt_tokens": prompt,
            "computed_prompt_tokens": computed,
            "reused_prompt_tokens": prompt - computed,
            "hit_tokens_by_tier": st.hit_tokens,
            "hit_rate": st.hit_rate,
            "bytes_copied": st.bytes_copied,
            "demotions": st.demotions,
            "promotions": st.promotions,
            "wall_s": record.wall_s,
            "ttft_ms_by_turn": [
                statistics.fmean(t.output.ttft_s * 1e3 for t in record.turns if t.turn == turn)
                for turn in range(workload.turns)
            ],
        }
    return out


def _print(console, summary: dict, exact: bool) -> None:
    from rich.table import Table

    base, kv = summary["runs"]["baseline"], summary["runs"]["kvtier"]
    table = Table(title="kvtier demo: multi-turn chat, no reuse vs kvtier")
    table.add_column("")
    table.add_column("baseline", justify="right")
    table.add_column("kvtier", justify="right")
    table.add_row("TTFT p50 (ms)", f"{base['ttft_p50_ms']:.1f}", f"{kv['ttft_p50_ms']:.1f}")
    table.add_row("TTFT p90 (ms)", f"{base['ttft_p90_ms']:.1f}", f"{kv['ttft_p90_ms']:.1f}")
    table.add_row("prompt tokens computed", str(base["computed_prompt_tokens"]), str(kv["computed_prompt_tokens"]))
    table.add_row("prompt tokens reused", str(base["reused_prompt_tokens"]), str(kv["reused_prompt_tokens"]))
    for tier in kv["hit_tokens_by_tier"]:
        lookups = max(1, kv["prompt_tokens"])
        table.add_row(f"hit rate, {tier}", "0.0%", f"{100 * kv['hit_tokens_by_tier'][tier] / lookups:.1f}%")
    for edge, n in sorted(kv["bytes_copied"].items()):
        table.add_row(f"bytes {edge}", "", f"{n / (1 << 20):.1f} MiB")
    table.add_row("wall time (s)", f"{base['wall_s']:.1f}", f"{kv['wall_s']:.1f}")
    console.print(table)
    if summary["identical_tokens"]:
        console.print("[green]both runs produced the same tokens[/green]")
    elif exact:
        console.print("[red]the runs produced different tokens: this is a bug[/red]")
    else:
        share = summary["common_prefix_share"]
        console.print(f"answers agree on {100 * share:.1f}% of their tokens (common prefix; not float64)")


def _plot(records: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, record in records.items():
        turns = sorted({t.turn for t in record.turns})
        means = [statistics.fmean(t.output.ttft_s * 1e3 for t in record.turns if t.turn == n) for n in turns]
        ax.plot([n + 1 for n in turns], means, marker="o", label=label)
    ax.set_xticks([n + 1 for n in sorted({t.turn for r in records.values() for t in r.turns})])
    ax.set_xlabel("turn")
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_title("Time to first token per turn")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
