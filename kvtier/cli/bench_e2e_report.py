"""The e2e bench's targets (targets 3-5 of docs/benchmarks.md) and its table."""

from __future__ import annotations

from kvtier.cli.bench_machine import link_ceiling_line

NAN = float("nan")


def add_targets(rows: list[dict], ceiling: float) -> None:
    """Give each row with a target a ``target`` record: what is compared, the value, the bound, met or not.

    host: TTFT <= 1.2 x prefix bytes / link ceiling + the gpu case's TTFT (target 3);
    host-full-*: reload link share >= 0.9 (target 4); disk: TTFT <= 1.05 x the engine's own
    recompute of a prompt as long (``recompute-engine``: what the request costs when the cache
    loads nothing); disk-queued: TTFT / host-queued TTFT <= 1.2 (target 5). Link targets need a
    CUDA device. Every row keeps its ratio to the dense path's recompute beside.
    """
    gpu = {r["prefix"]: r["ttft_ms"] for r in rows if r["case"] == "gpu"}
    engine = {r["prefix"]: r["ttft_ms"] for r in rows if r["case"] == "recompute-engine"}
    for r in rows:
        case = r["case"]
        if case == "host" and ceiling and r["prefix"] in gpu:
            bound = 1.2 * r["prefix_bytes"] / (ceiling * 1e9) * 1e3 + gpu[r["prefix"]]
            r["target"] = _target("TTFT ms", r["ttft_ms"], "<=", bound)
        elif case.startswith("host-full") and ceiling:
            r["target"] = _target("link", r["link_share"], ">=", 0.9)
        elif case == "disk" and r["prefix"] in engine:
            r["ttft_over_engine_recompute"] = r["ttft_ms"] / engine[r["prefix"]]
            r["target"] = _target("TTFT/engine", r["ttft_over_engine_recompute"], "<=", 1.05)
        elif case == "disk-queued":
            r["target"] = _target("TTFT/host-q", r["ttft_vs_host"], "<=", 1.2)


def _target(what: str, value: float, op: str, bound: float) -> dict:
    met = value <= bound if op == "<=" else value >= bound
    return {"what": what, "value": value, "op": op, "bound": bound, "met": met}


CASE = len("recompute-engine")  # the case column's width: the longest case's name


def print_table(rows: list[dict], ceiling: float) -> None:
    """One line per row: TTFT and its ratios to recompute, the reload, the target, the agreement."""
    print(link_ceiling_line(ceiling))
    print("recomp/TTFT: speedup over recomputing the prompt on the dense path; TTFT/recomp: its inverse")
    print("disk target: TTFT <= 1.05 x recompute-engine (the same engine recomputing a prompt as long)")
    header = f"{'prefix':>7} {'case':<{CASE}} {'TTFT ms':>9} {'own ms':>8} {'recomp/TTFT':>11} {'TTFT/recomp':>11}"
    header += f" {'reload ms':>9} {'GB/s':>6} {'link':>5} {'target':<30} {'logit err':>9} {'argmax':>6} {'greedy':>6}"
    print(header)
    for r in rows:
        a = r.get("agreement", {})
        print(
            f"{r['prefix']:>7} {r['case']:<{CASE}} {r['ttft_ms']:>9.1f} {r.get('own_ms', NAN):>8.1f} "
            f"{r['speedup_vs_recompute']:>11.2f} {r['ttft_over_recompute']:>11.2f} "
            f"{r.get('reload_ms', NAN):>9.1f} {r.get('reload_gbps', NAN):>6.1f} {r.get('link_share', NAN):>5.2f} "
            f"{_target_text(r.get('target')):<30} {a.get('logit_rel_err', NAN):>9.4f} "
            f"{a.get('same_argmax', '')!s:>6} {str(a.get('common_prefix', '')) + '/' + str(a.get('of', '')):>6}"
        )
    _print_reuse_lines(rows)


def _target_text(target: dict | None) -> str:
    if target is None:
        return ""
    met = "met" if target["met"] else "MISSED"
    return f"{target['what']} {target['value']:.2f} {target['op']} {target['bound']:.2f} {met}"


def _print_reuse_lines(rows: list[dict]) -> None:
    """Where the disk, queued and host-full requests' reused tokens came from (nothing: the engine
    recomputed), and what the victims moved."""
    for r in rows:
        if r["case"] == "disk" or r["case"].endswith("-queued") or r["case"].startswith("host-full"):
            reused = ", ".join(f"{tier} {n}" for tier, n in r["reused_by_tier"].items() if n)
            line = f"{r['prefix']:>7} {r['case']:<{CASE}} reused: {reused or 'nothing (recomputed)'}"
            if "victim_bytes_down" in r:
                line += f"; primary full: {r['primary_full']}; bytes down during resume: {r['victim_bytes_down']:,.0f}"
            if "prefix_placement_before" in r:
                where = ", ".join(f"{tier} {n}" for tier, n in r["prefix_placement_before"].items())
                line += f"; prefix before: {where}"
            if "prefetch_policy" in r:
                line += f"; prefetch policy: {r['prefetch_policy'] or 'engine default'}"
            print(line)
