"""Redis topologies on loopback for the tests: a Redis Cluster, and a primary + replica watched by a Sentinel.

Each data server is a ``RedisServer`` (tests/conftest.py), so one node can be killed, stalled
(SIGSTOP) or restarted. Cluster nodes keep serving their own slots while another node is down
(``cluster-require-full-coverage no``), as docs/stores.md tells users to configure.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis

from tests.conftest import START_TIMEOUT_S, RedisServer, free_port

SERVICE = "kvtier"


def wait_until(condition, timeout_s: float, what: str, interval_s: float = 0.05):
    """``condition()``'s first truthy value within ``timeout_s``, else ``TimeoutError`` naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = condition()
        except (redis.RedisError, OSError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting {timeout_s}s for {what}")
        time.sleep(interval_s)


def client(port: int) -> redis.Redis:
    return redis.Redis("127.0.0.1", port, socket_timeout=5, socket_connect_timeout=5)


class LocalCluster:
    """``size`` primaries, no replicas, each in its own directory with its own cluster bus port."""

    def __init__(self, root: Path, size: int = 3, node_timeout_ms: int = 3000) -> None:
        self.nodes = []
        for i in range(size):
            directory = root / f"node{i}"
            directory.mkdir(parents=True)
            args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
            args += ("--cluster-port", str(free_port()), "--cluster-node-timeout", str(node_timeout_ms))
            args += ("--cluster-require-full-coverage", "no")
            self.nodes.append(RedisServer(directory, args))

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        for node in self.nodes:
            wait_until(lambda n=node: self._sees_all(n.port), START_TIMEOUT_S * 3, f"cluster node {node.port}")

    def _sees_all(self, port: int) -> bool:
        with client(port) as c:
            info = c.cluster("info")
        return info["cluster_state"] == "ok" and int(info["cluster_known_nodes"]) == len(self.nodes)

    def node_id(self, node: RedisServer) -> str:
        with client(node.port) as c:
            return c.execute_command("CLUSTER", "MYID").decode()

    def keys_on(self, node: RedisServer, match: str) -> set[str]:
        """The keys matching ``match`` that ``node`` holds."""
        with client(node.port) as c:
            return {k.decode() for k in c.scan_iter(match=match, count=1000)}

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class LocalSentinel:
    """A primary, its replica, and one Sentinel watching them as service ``SERVICE`` (quorum 1)."""

    def __init__(self, root: Path, down_after_ms: int = 1000) -> None:
        self.root = root
        self.down_after_ms = down_after_ms
        (root / "primary").mkdir(parents=True)
        (root / "replica").mkdir(parents=True)
        self.primary = RedisServer(root / "primary", ("--repl-diskless-sync-delay", "0"))
        self.replica = RedisServer(root / "replica")
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis-sentinel://127.0.0.1:{self.port}/{SERVICE}"

    def start(self) -> None:
        self.primary.start()
        self.replica.extra_args = ("--replicaof", "127.0.0.1", str(self.primary.port))
        self.replica.start()
        conf = self.root / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.root}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} 10000\n"
        )
        with open(self.root / "sentinel.log", "ab") as log_file:
            self.proc = subprocess.Popen(
                ["redis-server", str(conf), "--sentinel"], stdout=log_file, stderr=subprocess.STDOUT
            )
        wait_until(self._replica_ready, START_TIMEOUT_S * 3, "the Sentinel to see a synced replica")

    def _replica_ready(self) -> bool:
        with client(self.replica.port) as c:
            synced = c.info("replication").get("master_link_status") == "up"
        with client(self.port) as s:
            seen = [r for r in s.sentinel_slaves(SERVICE) if r["port"] == self.replica.port and not r["is_sdown"]]
        return synced and bool(seen)

    def primary_port(self) -> int:
        with client(self.port) as s:
            return int(s.sentinel_get_master_addr_by_name(SERVICE)[1])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self.primary.stop()
        self.replica.stop()
