"""Time vLLM's scheduler thread spends per step with the kvtier connector over a slow disk.

vLLM's real ``Scheduler`` drives ``KVTierConnector`` (the stand-in runner of
``tests/vllm/harness.py``, 8 layers of 8 KV heads x 128, float32: 1 MiB kvtier pages). Host
memory holds 40 pages. A first engine serves twelve 120-token prompts, which pushes blocks out to
disk; a second engine on the same directory serves the same prefixes again, read back from disk.
Every disk read and write also waits ``bytes / --disk-mbps`` (a slow disk; the page cache would
hide it). Prints, per engine, the steps, the total and the longest ``schedule()`` call (which
includes the connector's ask, alloc and per-step work), and the tokens the second engine loaded.
The second engine's directory is filled by an engine with room for every prefix (not timed), so
that both trees start it with every prefix on disk.

With ``--store-prompts N``, a third phase: an engine writes N prompts of ``STORE_PROMPT_TOKENS``
tokens through to a shared-directory store (not timed), and a fresh engine with no disk tier and
room in host memory serves them again from the store (``store_loading``): its ``schedule()``
calls include putting the fetched pages into host memory.

    bash .ci/vllm_env.sh && PYTHONPATH=. .venv-vllm/bin/python scripts/vllm_scheduler_stalls.py --disk-mbps 1000
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import tests.vllm.harness as h
from kvtier.storage.page_files import DiskStorage

LAYERS = 8
HOST_PAGES = 40
PROMPTS = 12
STORE_PROMPT_TOKENS = 1000


def slow_disk(bytes_per_second: float) -> None:
    """Make every disk read and write of the page files also wait bytes / ``bytes_per_second``."""
    write, read = DiskStorage.write, DiskStorage.read

    def slow_write(self, group, slots, pages):
        out = write(self, group, slots, pages)
        time.sleep(sum(len(p) for p in pages) / bytes_per_second)
        return out

    def slow_read(self, group, slots, into, checksums):
        out = read(self, group, slots, into, checksums)
        time.sleep(sum(len(p) for p in into) / bytes_per_second)
        return out

    DiskStorage.write, DiskStorage.read = slow_write, slow_read


def engine(tmp: Path, page: int, host_pages: int = HOST_PAGES) -> h.Engine:
    tmp.mkdir(exist_ok=True)
    extra = {"host_bytes": host_pages * page, "disk_bytes": 10 * HOST_PAGES * page, "disk_path": str(tmp / "disk")}
    config = h.vllm_config(tmp, extra)
    return h.Engine(config, h.kv_cache_config(config, [(h.layer_names(LAYERS), h.attention_spec())], 128))


def store_engine(tmp: Path, page: int, prompts: int, name: str) -> h.Engine:
    """An engine over a shared-directory store, with host memory for every block of ``prompts`` prompts."""
    host_pages = prompts * (STORE_PROMPT_TOKENS // h.BLOCK + 2)
    extra = {"host_bytes": host_pages * page, "store_url": f"file://{tmp / 'store'}"}
    config = h.vllm_config(tmp, extra)
    config.kv_transfer_config.engine_id = name
    return h.Engine(config, h.kv_cache_config(config, [(h.layer_names(LAYERS), h.attention_spec())], host_pages))


def store_phase(tmp: Path, page: int, prompts: int) -> dict:
    """Serve ``prompts`` long prompts from the store in a fresh engine; its ``schedule()`` times."""
    tmp.mkdir(exist_ok=True)
    texts = [h.prompt(60 + k, STORE_PROMPT_TOKENS) for k in range(prompts)]
    first = store_engine(tmp, page, prompts, "store-writer")
    for i, tokens in enumerate(texts):
        first.add(f"w{i}", tokens, max_tokens=2)
    first.run(max_steps=5000)
    first.shutdown()  # waits for the store writes
    second = store_engine(tmp, page, prompts, "store-reader")
    for i, tokens in enumerate(texts):
        second.add(f"r{i}", tokens + [1, 2], max_tokens=3)
    times = second.timed_run(5000)
    loaded = sum(next(s.computed[f"r{i}"][0] for s in second.log if f"r{i}" in s.computed) for i in range(prompts))
    second.shutdown()
    return {**summary(times), "tokens_loaded": loaded}


def summary(times: list[float]) -> dict:
    return {"steps": len(times), "total_ms": round(sum(times) * 1e3, 1), "max_ms": round(max(times) * 1e3, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--disk-mbps", type=float, default=1000.0, help="the slow disk's speed, MB/s (10^6 bytes)")
    parser.add_argument("--store-prompts", type=int, default=0, help="prompts served from a store (0: no store phase)")
    args = parser.parse_args()
    h.HEADS, h.HEAD_SIZE = 8, 128
    h.TINY_LLAMA.update(
        num_key_value_heads=8, head_dim=128, num_attention_heads=8, hidden_size=1024, num_hidden_layers=LAYERS
    )
    page = LAYERS * h.BLOCK * h.HEADS * 2 * h.HEAD_SIZE * 4
    slow_disk(args.disk_mbps * 1e6)
    prefixes = [h.prompt(30 + k, 120) for k in range(PROMPTS)]
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        first = engine(tmp / "saving", page)
        for i, tokens in enumerate(prefixes):
            first.add(f"a{i}", tokens, max_tokens=2)
        saves = first.timed_run(5000)
        dropped = first.kv_scheduler.manager.stats().drops  # pages pushed out of host memory but not to disk
        first.shutdown()
        setup = engine(tmp / "loading", page, host_pages=10 * HOST_PAGES)
        for i, tokens in enumerate(prefixes):
            setup.add(f"s{i}", tokens, max_tokens=2)
        setup.run(max_steps=5000)
        setup.shutdown()  # every prefix on disk
        second = engine(tmp / "loading", page)
        for i, tokens in enumerate(prefixes):
            second.add(f"b{i}", tokens + [1, 2], max_tokens=3)
        loads = second.timed_run(5000)
        loaded = sum(next(s.computed[f"b{i}"][0] for s in second.log if f"b{i}" in s.computed) for i in range(PROMPTS))
        second.shutdown()
        store = store_phase(tmp / "store", page, args.store_prompts) if args.store_prompts else None
    print(
        json.dumps(
            {
                "page_bytes": page,
                "disk_mbps": args.disk_mbps,
                "saving": {**summary(saves), "pages_dropped": dropped},
                "loading": summary(loads),
                "tokens_loaded": loaded,
                **({"store_loading": store} if store else {}),
            }
        )
    )


if __name__ == "__main__":
    main()
