"""How long the running requests wait while another request's prefix comes from a store.

A store (``--store redis``: a redis-server started here on a free port; ``fs``: a directory;
``link``: a directory read as if over a link of ``--link-mbps`` MB/s, each fetch sleeping as long
as its bytes take on it, as a remote store's socket waits do) is seeded with one
``--prefix``-token prompt by a first engine. A second engine (tiny-llama, float32,
on the CPU) runs ``--running`` requests that decode; once they are past their prompts, the prompt
of the seeded prefix plus 8 tokens arrives. Every step's wall time is recorded from its arrival
until it has its first token. Prints, per round: the longest step then, the median step, the
new request's TTFT and the tokens it took from the connector; then the medians of the rounds.
Outputs are checked against the dense reference.

    PYTHONPATH=. python scripts/connector_stall.py [--store redis|fs|link] [--link-mbps 1000]
        [--prefix 4096] [--rounds 5]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

import torch

import kvtier
from kvtier.connector import FileSystemConnector, FileSystemStore, RedisConnector, StoreConnector
from kvtier.engine import LLMEngine, SamplingParams
from kvtier.models import build_model

TPB = 16


class OverALink(FileSystemStore):
    """A directory read as if over a link of ``mbps`` MB/s: each fetch also sleeps as long as its
    bytes take on it (the thread waits, as on a socket)."""

    def __init__(self, path: str, mbps: float) -> None:
        super().__init__(path)
        self.mbps = mbps

    def get_many(self, keys, expected_sizes=None):
        payloads = super().get_many(keys, expected_sizes)
        time.sleep(sum(len(p) for p in payloads if p is not None) / (self.mbps * 1e6))
        return payloads


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(directory: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", directory],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), 0.1).close()
            return server, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def run_round(model, connector_for, prefix: list[int], others: list[list[int]]) -> dict:
    """One engine over the seeded store: the running requests, then the prefix's request."""
    probe = kvtier.KVCacheManager(model.spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 24)]))
    page = sum(probe.page_bytes(g.group_id) for g in probe.layer_groups)
    probe.close()
    config = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(page * (len(prefix) // TPB + 64 * len(others) + 64))])
    prompt = prefix + list(range(1, 9))
    with LLMEngine(model, config, connector=connector_for()) as eng:
        running = [eng.add_request(p, SamplingParams(max_tokens=48)) for p in others]
        for _ in range(4):
            eng.step()  # past their prompts: decoding
        arrived = eng.add_request(prompt, SamplingParams(max_tokens=1))  # finishes with its first token
        steps, outputs = [], {}
        while arrived not in outputs:
            t0 = time.perf_counter()
            outputs.update((o.request_id, o) for o in eng.step())
            steps.append(time.perf_counter() - t0)
        while not set(running) <= outputs.keys():
            outputs.update((o.request_id, o) for o in eng.step())
    out = outputs[arrived]
    if out.token_ids != model.reference_generate(prompt, 1):
        raise RuntimeError("the prefix's request generated other tokens than the dense reference")
    return {
        "longest_step_ms": max(steps) * 1e3,
        "median_step_ms": statistics.median(steps) * 1e3,
        "ttft_ms": out.ttft_s * 1e3,
        "connector_tokens": out.reused_tokens_by_tier["connector"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", choices=("redis", "fs", "link"), default="redis")
    parser.add_argument("--link-mbps", type=float, default=1000.0)
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--running", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model = build_model("tiny-llama", "cpu", torch.float32, seed=0)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, model.vocab_size, (args.prefix,), generator=g).tolist()
    others = [torch.randint(0, model.vocab_size, (64,), generator=g).tolist() for _ in range(args.running)]
    directory = tempfile.mkdtemp(prefix="kvtier-stall-")
    server = None
    try:
        if args.store == "redis":
            server, url = start_redis(directory)

            def connector_for():
                return RedisConnector(url)
        elif args.store == "fs":

            def connector_for():
                return FileSystemConnector(directory)
        else:

            def connector_for():
                return StoreConnector(OverALink(directory, args.link_mbps))

        seed = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(64 << 20)])
        with LLMEngine(model, seed, connector=connector_for()) as eng:
            eng.generate([prefix + [1]], SamplingParams(max_tokens=1))
        rounds = [run_round(model, connector_for, prefix, others) for _ in range(args.rounds)]
    finally:
        if server is not None:
            server.terminate()
            server.wait()
        shutil.rmtree(directory, ignore_errors=True)
    for i, r in enumerate(rounds):
        print(
            f"round {i}: longest step {r['longest_step_ms']:.1f} ms, median step {r['median_step_ms']:.1f} ms, "
            f"TTFT {r['ttft_ms']:.1f} ms, connector tokens {r['connector_tokens']}"
        )
    for key in ("longest_step_ms", "median_step_ms", "ttft_ms"):
        print(f"median of the rounds, {key}: {statistics.median(r[key] for r in rounds):.1f}")


if __name__ == "__main__":
    main()
