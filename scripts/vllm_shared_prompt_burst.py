"""Requests sharing a long prompt that arrive together, with device blocks for a few at a time.

vLLM's real ``Scheduler`` drives ``KVTierConnector`` (the stand-in runner of
``tests/vllm/harness.py``). ``--requests`` requests, each the same prompt of ``--blocks`` full
blocks and a token of its own, arrive at once; vLLM's device has blocks for ``--room`` of them
at a time, so the rest wait for a slot while the first ones compute the prompt. Prints, with
vLLM's own prefix caching on and off, the prompt tokens the runner computed, the requests that
loaded blocks from kvtier, and the engine's wall time. To compare two trees, run it from each in turn.

    bash .ci/vllm_env.sh
    PYTHONPATH=. .venv-vllm/bin/python scripts/vllm_shared_prompt_burst.py
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import tests.vllm.harness as h


def burst(tmp: Path, prefix_caching: bool, requests: int, blocks: int, room: int, decode: int) -> str:
    config = h.vllm_config(tmp, {"host_bytes": 4 * requests * blocks * h.HOST_PAGE}, max_seqs=requests)
    config.cache_config.enable_prefix_caching = prefix_caching
    per_request = blocks + 1 + -(-decode // h.BLOCK)
    e = h.Engine(config, h.kv_cache_config(config, [(h.layer_names(3), h.attention_spec())], room * per_request + 1))
    shared = h.prompt(800, blocks * h.BLOCK)
    prompt_len = len(shared) + 1
    for i in range(requests):
        e.add(f"r{i}", [*shared, 1 + i], max_tokens=decode)
    start = time.perf_counter()
    e.run(max_steps=100_000)
    seconds = time.perf_counter() - start
    computed = sum(
        max(0, min(end, prompt_len) - begin) for step in e.log for begin, end in step.computed.values()
    )  # prompt positions only: each request decodes the same
    loads = sum(1 for rid in e.requests if any(rid in step.loaded for step in e.log))
    e.shutdown()
    possible = requests * prompt_len
    return (
        f"vLLM prefix caching {'on ' if prefix_caching else 'off'}: prompt tokens computed {computed} of {possible}; "
        f"requests that loaded from kvtier {loads} ({seconds:.1f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--room", type=int, default=1)
    parser.add_argument("--decode", type=int, default=16)
    args = parser.parse_args()
    print(
        f"{args.requests} requests of one {args.blocks}-block prompt and a token of their own, device blocks for "
        f"{args.room} at a time, {args.decode} tokens decoded each"
    )
    for prefix_caching in (True, False):
        with tempfile.TemporaryDirectory() as d:
            print(burst(Path(d), prefix_caching, args.requests, args.blocks, args.room, args.decode))


if __name__ == "__main__":
    main()
