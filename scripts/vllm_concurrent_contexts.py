"""How much of a batch of long requests kvtier keeps when their contexts outgrow host memory.

vLLM's real ``Scheduler`` drives ``KVTierConnector`` (the stand-in runner of
``tests/vllm/harness.py``). A first engine, with host memory for ``--host-pages`` pages and a disk
tier, runs ``--requests`` requests at once, each a prompt of ``--blocks`` full blocks and one token
that decodes ``--decode`` tokens. It prints the blocks those requests computed, how many of them
kvtier holds when they finish (on any tier), and how many requests found no room for a save.
A second engine, started on the same disk directory, serves each prompt again with one more token
and prints the tokens its requests loaded instead of computing.

    bash .ci/vllm_env.sh
    PYTHONPATH=. .venv-vllm/bin/python scripts/vllm_concurrent_contexts.py
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import tests.vllm.harness as h


class NotSaved(logging.Handler):
    """Counts the DEBUG lines of saves that found no room in host memory."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.requests: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.endswith("; they are not saved"):
            self.requests.add(message.split()[2].rstrip(":"))


def engine(tmp: Path, host_pages: int, disk_pages: int, requests: int, blocks: int) -> h.Engine:
    extra = {
        "host_bytes": host_pages * h.HOST_PAGE,
        "disk_bytes": disk_pages * h.HOST_PAGE,
        "disk_path": str(tmp / "disk"),
    }
    config = h.vllm_config(tmp, extra, max_seqs=requests)
    device_blocks = requests * (blocks + 4) + 1
    return h.Engine(config, h.kv_cache_config(config, [(h.layer_names(3), h.attention_spec())], device_blocks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host-pages", type=int, default=64)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--decode", type=int, default=32)
    args = parser.parse_args()
    log = logging.getLogger("kvtier.vllm.scheduler")
    log.setLevel(logging.DEBUG)
    not_saved = NotSaved()
    log.addHandler(not_saved)
    prompts = [h.prompt(700 + i, args.blocks * h.BLOCK + 1) for i in range(args.requests)]
    disk_pages = 4 * args.requests * (args.blocks + 4)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        first = engine(tmp, args.host_pages, disk_pages, args.requests, args.blocks)
        for i, tokens in enumerate(prompts):
            first.add(f"r{i}", tokens, max_tokens=args.decode)
        start = time.perf_counter()
        first.run(max_steps=100_000)
        seconds = time.perf_counter() - start
        manager = first.kv_scheduler.manager
        computed = sum(len(first.tokens(f"r{i}")) // h.BLOCK for i in range(args.requests))
        kept = sum(manager.cached_tokens(first.tokens(f"r{i}")) // h.BLOCK for i in range(args.requests))
        first.shutdown()
        second = engine(tmp, args.host_pages, disk_pages, args.requests, args.blocks)
        for i, tokens in enumerate(prompts):
            second.add(f"s{i}", [*tokens, 1], max_tokens=2)
        second.run(max_steps=100_000)
        loaded = sum(
            next(s.computed[f"s{i}"][0] for s in second.log if f"s{i}" in s.computed) for i in range(args.requests)
        )
        second.shutdown()
    possible = args.requests * args.blocks * h.BLOCK
    print(
        f"host memory {args.host_pages} pages, {args.requests} requests of {args.blocks} blocks + {args.decode} "
        f"decoded at once ({seconds:.1f} s)"
    )
    print(
        f"blocks computed {computed}, kept by kvtier {kept}; saves found no room for {len(not_saved.requests)} requests"
    )
    print(f"second engine: {loaded} of {possible} prompt tokens loaded ({loaded / possible:.0%})")


if __name__ == "__main__":
    main()
