"""Throughput of the Redis block store on loopback: one server against a three-node Redis Cluster.

For each store and block size, writes ``--mib`` MiB of fresh random blocks with ``put_many`` in
batches of ``--batch-mib`` MiB, reads them back with ``get_many`` (verified, as the connector
does), and reports blocks/s and MB/s (10^6 bytes) of each, the best of ``--repeat`` rounds.
Without URLs it starts its own servers (``redis-server`` and ``redis-cli`` from PATH, no
persistence, in a temporary directory) and stops them at the end.

    python3 scripts/bench_store.py [--server-url redis://...] [--cluster-url redis-cluster://...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from kvtier.config import DEFAULT_SCOPE
from kvtier.connector import BlockKeyspace, RedisStore

BLOCK_SIZES = {"64KiB": 64 << 10, "2MiB": 2 << 20}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(directory: Path, *args: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    directory.mkdir(parents=True)
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        + ["--dir", str(directory), *args],
        stdout=subprocess.DEVNULL,
    )
    wait(lambda: subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout.strip() == b"PONG")
    return proc, port


def wait(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("a Redis server did not come up")
        time.sleep(0.05)


def local_servers(stack: ExitStack) -> tuple[str, str]:
    """Start one server and a three-node cluster; their URLs. ``stack`` stops them."""
    root = Path(stack.enter_context(tempfile.TemporaryDirectory()))
    procs = []
    stack.callback(lambda: [(p.terminate(), p.wait()) for p in procs])
    proc, port = start_server(root / "single")
    procs.append(proc)
    ports = []
    for i in range(3):
        cluster_args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
        proc, node_port = start_server(root / f"node{i}", *cluster_args, "--cluster-port", str(free_port()))
        procs.append(proc)
        ports.append(node_port)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    subprocess.run(
        ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
        check=True,
        capture_output=True,
    )
    for p in ports:
        wait(
            lambda p=p: (
                b"cluster_state:ok"
                in subprocess.run(["redis-cli", "-p", str(p), "cluster", "info"], capture_output=True).stdout
            )
        )
    return f"redis://127.0.0.1:{port}/0", "redis-cluster://" + ",".join(addresses)


def measure(url: str, block_bytes: int, total_mib: int, batch_mib: int, repeat: int) -> dict:
    """Best-of-``repeat`` put and get rates of ``total_mib`` MiB in blocks of ``block_bytes``."""
    store = RedisStore(url, socket_timeout_s=30)
    count = max(1, (total_mib << 20) // block_bytes)
    per_call = max(1, (batch_mib << 20) // block_bytes)
    rng = np.random.default_rng(0)
    blocks = [rng.integers(1, 256, block_bytes, dtype=np.uint8) for _ in range(min(count, per_call))]
    best_put = best_get = float("inf")
    for _ in range(repeat):
        space = BlockKeyspace(uuid.uuid4().hex, 16)
        keys = [space.key(DEFAULT_SCOPE, i.to_bytes(16, "little"), 0) for i in range(count)]
        batches = [keys[i : i + per_call] for i in range(0, count, per_call)]
        start = time.perf_counter()
        for batch in batches:
            assert all(store.put_many([(k, blocks[j]) for j, k in enumerate(batch)])), "a put failed"
        best_put = min(best_put, time.perf_counter() - start)
        start = time.perf_counter()
        for batch in batches:
            got = store.get_many(batch, [block_bytes] * len(batch))
            assert all(g is not None for g in got), "a block did not come back"
        best_get = min(best_get, time.perf_counter() - start)
        store.delete_many(keys)
    store.close()
    return {
        "blocks": count,
        "blocks_per_call": per_call,
        "put_blocks_per_s": count / best_put,
        "put_MB_per_s": count * block_bytes / best_put / 1e6,
        "get_blocks_per_s": count / best_get,
        "get_MB_per_s": count * block_bytes / best_get / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-url", help="one server (default: start one)")
    parser.add_argument("--cluster-url", help="a Redis Cluster (default: start three nodes)")
    parser.add_argument("--mib", type=int, default=256, help="MiB written and read per round")
    parser.add_argument("--batch-mib", type=int, default=32, help="MiB per put_many / get_many call")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    with ExitStack() as stack:
        server_url, cluster_url = args.server_url, args.cluster_url
        if server_url is None or cluster_url is None:
            local_server, local_cluster = local_servers(stack)
            server_url, cluster_url = server_url or local_server, cluster_url or local_cluster
        rows = []
        for store_name, url in (("one server", server_url), ("3-node cluster", cluster_url)):
            for size_name, size in BLOCK_SIZES.items():
                figures = measure(url, size, args.mib, args.batch_mib, args.repeat)
                rows.append({"store": store_name, "block": size_name, **figures})
                print(
                    f"{store_name:15} {size_name:>5}  put {figures['put_blocks_per_s']:9.0f} blocks/s "
                    f"{figures['put_MB_per_s']:7.0f} MB/s   get {figures['get_blocks_per_s']:9.0f} blocks/s "
                    f"{figures['get_MB_per_s']:7.0f} MB/s",
                    flush=True,
                )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
