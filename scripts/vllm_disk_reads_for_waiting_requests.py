"""How many disk reads and steps it takes to serve prefixes on disk through little host memory.

vLLM's real ``Scheduler`` drives ``KVTierConnector`` (the stand-in runner of
``tests/vllm/harness.py``). A first engine serves ``--prompts`` (12 unless given) 120-token
prompts and leaves them on disk at shutdown; a second engine on the same directory, with host
memory for 40 pages (five prefixes of 7 blocks at once), serves them again with 2 more tokens
each, every request willing to wait ``--wait-s`` (``disk_read_wait_s``, 600 s unless given) for
room to read its prefix into. Per run it prints the second engine's steps and seconds, the reads
started (``prefetch_to_host`` calls that read something), the most any one request started, the
tokens recomputed, and the median and longest ``schedule()`` call of vLLM's scheduler thread
(its asks of the waiting requests included). ``--busy N`` keeps N
processes spinning on the CPU meanwhile: the reads then land at other moments relative to the
steps, as on a busy CI machine.

    bash .ci/vllm_env.sh
    PYTHONPATH=. .venv-vllm/bin/python scripts/vllm_disk_reads_for_waiting_requests.py --runs 10 --busy 3
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import tests.vllm.harness as h

HOST_PAGES = 40
MAX_STEPS = 100_000


def spin() -> None:
    while True:
        pass


def engine(tmp: Path, host_pages: int, disk_pages: int, wait_s: float = 1.0) -> h.Engine:
    extra = {
        "host_bytes": host_pages * h.HOST_PAGE,
        "disk_bytes": disk_pages * h.HOST_PAGE,
        "disk_path": str(tmp / "disk"),
        "disk_read_wait_s": wait_s,
    }
    config = h.vllm_config(tmp, extra)
    return h.Engine(config, h.kv_cache_config(config, [(h.layer_names(3), h.attention_spec())], 128))


def one_run(tmp: Path, prompts: int, wait_s: float) -> dict[str, float]:
    prefixes = [h.prompt(30 + k, 120) for k in range(prompts)]
    first = engine(tmp, 8 * prompts + 100, 16 * prompts)
    for i, prefix in enumerate(prefixes):
        first.add(f"a{i}", prefix, max_tokens=2)
    first.run(max_steps=100 * prompts)
    first.shutdown()
    second = engine(tmp, HOST_PAGES, 16 * prompts, wait_s)
    manager = second.kv_scheduler.manager
    reads: collections.Counter[tuple[int, ...]] = collections.Counter()
    start_read = manager.prefetch_to_host

    def counted(tokens, scope, **kwargs):
        read = start_read(tokens, scope, **kwargs)
        if read is not None:
            reads[tuple(tokens[:8])] += 1
        return read

    manager.prefetch_to_host = counted
    for i, prefix in enumerate(prefixes):
        second.add(f"b{i}", prefix + [1, 2], max_tokens=3)
    began = time.monotonic()
    schedule_s = second.timed_run(MAX_STEPS)
    seconds = time.monotonic() - began
    recomputed = manager.stats().recomputed_tokens
    second.shutdown()
    return {
        "steps": len(schedule_s),
        "seconds": seconds,
        "reads": sum(reads.values()),
        "most_reads_of_one": max(reads.values(), default=0),
        "recomputed_tokens": recomputed,
        "schedule_ms_median": 1e3 * statistics.median(schedule_s),
        "schedule_ms_longest": 1e3 * max(schedule_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU meanwhile")
    parser.add_argument("--wait-s", type=float, default=600.0, help="disk_read_wait_s")
    args = parser.parse_args()
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    rows = []
    try:
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                rows.append(one_run(Path(tmp), args.prompts, args.wait_s))
            print("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()))
    finally:
        for p in spinners:
            p.terminate()
    print(f"\n{'':20}{'median':>10}{'max':>10}")
    for key in rows[0]:
        values = [row[key] for row in rows]
        print(f"{key:20}{statistics.median(values):>10.4g}{max(values):>10.4g}")


if __name__ == "__main__":
    main()
