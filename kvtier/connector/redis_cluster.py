"""The transport of a ``RedisStore`` on a Redis Cluster: keys routed to their nodes, one pipeline per node.

redis-py's ``RedisCluster`` client knows the cluster: it discovers the nodes from the URL's
addresses, keeps the slot table, hashes keys to slots and follows ``MOVED``/``ASK`` redirects.
This transport uses it for all of that, and sends each call itself:

- A call's keys are grouped by the node that owns their slot; each node gets one pipeline (one
  round trip), and the nodes are asked at the same time (the caller's thread takes one node,
  a small pool the others), so a call costs about one round trip to the slowest node.
- Every node has its own back-off (``ServerHealth``): a node that is down or hung answers
  misses for its own keys only, for ``retry_after_s``; the other nodes' keys are served. A node
  that failed makes the slot table be read again in the background (a replica may have taken
  its slots over), so no call waits for that.
- A reply that redirects (``MOVED``, ``ASK``: slots being moved between nodes) sends that command
  once more, in one pipeline per node the replies name (``ASKING`` first for an ``ASK``), under
  that node's back-off; a ``MOVED`` also makes the slot table be read again in the background. A
  ``TRYAGAIN``, a redirect to a node the table does not know, or a second redirect is a miss.
- The client is made (which connects) on a background thread at the first call; a call waits
  for it at most ``timeout_s`` and answers misses meanwhile. Nothing connects before. The
  threads are daemons (``DaemonPool``): the interpreter's exit waits for none of them.

So a node that hangs costs a call at most about ``timeout_s`` (twice, for keys redirected to it),
and nothing more while it is backed off. Keys carry no ``{hash tag}``
(``BlockKeyspace``), so a model's blocks spread over every node.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from kvtier.connector.daemon_pool import DaemonPool
from kvtier.connector.redis_urls import RedisTarget, explained
from kvtier.connector.store_health import ServerHealth

FAILED = object()
"""A command's reply when its node was not asked or did not answer (a miss, or a failed put)."""

MAX_FANOUT_THREADS = 16


class ClusterTransport:
    """Per-key commands on a Redis Cluster, batched per node; see the module docstring."""

    def __init__(
        self, target: RedisTarget, timeout_s: float, retry_after_s: float, warn_interval_s: float, log: logging.Logger
    ) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.retry import Retry

        self._shown = target.shown
        self._timeout_s = timeout_s
        self._retry_after_s = retry_after_s
        self._warn_interval_s = warn_interval_s
        self._log = log
        self._make_client = lambda: RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
            username=target.username,
            password=target.password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # the per-node back-off decides when to try again
            require_full_coverage=False,  # a cluster with a node down still serves the other nodes' slots
        )
        self._redirects = (redis.exceptions.AskError, redis.exceptions.TryAgainError)  # MovedError is an AskError
        self._moved = redis.exceptions.MovedError
        self._server_errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._errors = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)
        self._client: Any = None
        self._connecting: Future | None = None
        self._refreshing: Future | None = None
        self._discovery = ServerHealth(target.shown, log, retry_after_s, warn_interval_s)
        self._nodes: dict[str, ServerHealth] = {}
        self._lock = threading.Lock()
        self._topology = DaemonPool(1, "kvtier-redis-cluster-topology")
        self._fanout = DaemonPool(MAX_FANOUT_THREADS, "kvtier-redis-cluster")

    def run(self, op: str, commands: Sequence[tuple]) -> list[Any]:
        """Each command's reply (an exception instance for an error reply), or ``FAILED``; in order."""
        replies: list[Any] = [FAILED] * len(commands)
        client = self._ready_client()
        if client is None or not commands:
            return replies
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i, command in enumerate(commands):
            try:
                node = client.nodes_manager.get_node_from_slot(client.keyslot(command[1]))
            except self._errors:  # a slot no node serves, as far as the table knows: a miss, and read it again
                self._refresh_slots("")
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        asked = [
            (node, idx, [commands[i] for i in idx])
            for node, idx in groups.values()
            if self._health(node.name).available()
        ]
        others = [self._fanout.submit(self._send, client, op, node, cmds) for node, _, cmds in asked[1:]]
        results = [self._send(client, op, asked[0][0], asked[0][2])] if asked else []
        results += [future.result() for future in others]
        for (_, idx, _), node_replies in zip(asked, results, strict=True):
            for i, reply in zip(idx, node_replies, strict=True):
                replies[i] = reply
        return replies

    def close(self) -> None:
        """Wait for the background threads (each bounded by the socket timeout) and close every connection."""
        self._fanout.shutdown(wait=True)
        self._topology.shutdown(wait=True)
        connecting = self._connecting
        if self._client is None and connecting is not None and connecting.exception() is None:
            self._client = connecting.result()  # made after the last call stopped waiting for it
        if self._client is not None:
            self._client.close()

    # -- the client and the slot table --------------------------------------------------------------

    def _ready_client(self) -> Any:
        """The cluster client, or None while it is being made (waited for up to the timeout) or backed off."""
        with self._lock:
            if self._client is not None:
                return self._client
            if self._connecting is None:
                if not self._discovery.available():
                    return None
                self._connecting = self._topology.submit(self._make_client)
            connecting = self._connecting
        try:
            client = connecting.result(timeout=self._timeout_s)
        except FutureTimeout:
            return None
        except self._errors as exc:
            with self._lock:
                if self._connecting is connecting:
                    self._connecting = None
            self._discovery.failed("connect", explained(exc), server_down=True)
            return None
        with self._lock:
            self._client, self._connecting = client, None
        self._discovery.answered()
        return client

    def _refresh_slots(self, failed_node: str) -> None:
        """Read the slot table again in the background (once at a time), asking ``failed_node`` last."""
        with self._lock:
            if self._refreshing is not None and not self._refreshing.done():
                return
            nodes_manager = self._client.nodes_manager
            self._refreshing = self._topology.submit(self._quietly, nodes_manager.initialize, failed_node)

    def _quietly(self, initialize: Callable[..., None], failed_node: str) -> None:
        try:
            initialize(last_failed_node_name=failed_node)
        except self._errors as exc:  # the next failure asks again
            self._log.debug("kvtier redis store %s: reading the slot table failed: %s", self._shown, exc)

    # -- one node -----------------------------------------------------------------------------------

    def _health(self, node_name: str) -> ServerHealth:
        with self._lock:
            health = self._nodes.get(node_name)
            if health is None:
                name = f"{self._shown} node {node_name}"
                health = self._nodes[node_name] = ServerHealth(
                    name, self._log, self._retry_after_s, self._warn_interval_s
                )
            return health

    def _send(self, client: Any, op: str, node: Any, commands: list[tuple]) -> list[Any]:
        """One pipeline to ``node``, then the redirected commands to the nodes named; ``FAILED`` where
        a node failed."""
        replies = self._pipeline(client, op, node, commands)
        if replies is None:
            return [FAILED] * len(commands)
        self._follow_redirects(client, op, commands, replies)
        return replies

    def _pipeline(self, client: Any, op: str, node: Any, commands: list[tuple], asking: bool = False) -> list | None:
        """``commands`` to ``node`` in one pipeline (each after ``ASKING`` with ``asking``): their replies
        (an exception instance for an error reply), or None when the node is backed off or failed."""
        health = self._health(node.name)
        if not health.available():
            return None
        try:
            with client.get_redis_connection(node).pipeline(transaction=False) as pipe:
                for command in commands:
                    if asking:
                        pipe.execute_command("ASKING")
                    pipe.execute_command(*command)
                replies = pipe.execute(raise_on_error=False)
        except self._errors as exc:
            server_down = isinstance(exc, self._server_errors)
            health.failed(op, explained(exc), server_down)
            if server_down:
                self._refresh_slots(node.name)
            return None
        health.answered()
        return replies[1::2] if asking else replies

    def _follow_redirects(self, client: Any, op: str, commands: list[tuple], replies: list[Any]) -> None:
        """Send the commands whose reply redirects once more, in one pipeline per node named, in
        place of those replies (``FAILED`` where that cannot be done, or the node failed). One node
        at a time: a call seldom has keys in slots moving to two nodes."""
        groups: dict[tuple[str, bool], tuple[Any, list[int]]] = {}
        for i, reply in enumerate(replies):
            if not isinstance(reply, self._redirects):
                continue
            replies[i] = FAILED
            moved = isinstance(reply, self._moved)
            address = getattr(reply, "node_addr", None)  # (none on a TRYAGAIN: the slot is busy now)
            node = None if address is None else client.get_node(host=address[0], port=address[1])
            if moved or (address is not None and node is None):
                self._refresh_slots("")
            if node is not None:
                groups.setdefault((node.name, not moved), (node, []))[1].append(i)
        for (_, asking), (node, idx) in groups.items():
            again = self._pipeline(client, op, node, [commands[i] for i in idx], asking)
            if again is not None:
                for i, reply in zip(idx, again, strict=True):
                    replies[i] = reply

    # -- the store's four operations ----------------------------------------------------------------

    def get(self, keys: list[str]) -> list[bytes | None]:
        """Per key its value, or None: missing, not a string, or its node did not answer."""
        replies = self.run("get", [("GET", key) for key in keys])
        return [reply if isinstance(reply, bytes) else None for reply in replies]

    def set(self, items: list[tuple[str, bytes]], ttl_ms: int | None) -> list[Any]:
        """Per item True (stored), False (its node did not answer) or the server's error reply."""
        expiry = ("PX", ttl_ms) if ttl_ms is not None else ()
        replies = self.run("put", [("SET", key, blob, *expiry) for key, blob in items])
        return [False if reply is FAILED else reply for reply in replies]

    def types(self, keys: list[str]) -> list[Any]:
        """Per key its ``TYPE`` reply (anything else where its node failed)."""
        return self.run("contains", [("TYPE", key) for key in keys])

    def unlink(self, keys: list[str]) -> None:
        self.run("delete", [("UNLINK", key) for key in keys])
