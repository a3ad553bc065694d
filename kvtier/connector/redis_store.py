"""A block store in Redis: batched, one round trip per call (per node), shared by every engine that reaches it.

On one server (``redis://``, ``rediss://``, ``unix://``, or the primary that Sentinel names),
``get_many`` is one MGET, ``put_many`` one pipeline of ``SET key value [PX ttl]`` (not a
transaction), ``contains_many`` one pipeline of EXISTS, ``delete_many`` one UNLINK. On a Redis
Cluster (``redis-cluster://``), the keys go to the nodes that own them, one pipeline per node,
the nodes asked at once (``redis_cluster``). The URL forms are in ``redis_urls``. Values are
framed by ``block_codec`` and verified on every read, so a value that is damaged, foreign or of
the wrong size is a miss.

A server failure never reaches the caller. A call that cannot connect, times out or loses its
connection answers misses (or failures, for puts) and starts a back-off (``store_health``): for
``retry_after_s`` calls answer misses at once without touching the network, then the next call
tries again (and the client reconnects; through Sentinel it asks for the primary again, so a
failover is followed). On a cluster this holds per node: a node that is down costs the misses
of its own keys only. Socket timeouts are short (``socket_timeout_s``), so a dead or hung
server costs a call at most about that long. Failures are logged at WARNING at most once per
``warn_interval_s`` (a server's, and each kind of failed item: values that fail verification,
puts the server rejects); recovery is logged at INFO. An error reply for one key (e.g. out of
memory on a SET) fails that item only. The password never appears in logs.

Values travel as bytes: a URL that asks redis-py to decode replies (``decode_responses``) is
refused.
"""

from __future__ import annotations

import logging
import math
import reprlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from kvtier.connector.block_codec import Buffer, decode_page, encode_page
from kvtier.connector.redis_cluster import ClusterTransport
from kvtier.connector.redis_urls import RedisTarget, explained, parse_redis_url, redact_url
from kvtier.connector.store import check_keys, check_sizes
from kvtier.connector.store_health import ServerHealth
from kvtier.storage.log_limit import RateLimitedWarning

log = logging.getLogger(__name__)

SOCKET_TIMEOUT_S = 1.0
RETRY_AFTER_S = 5.0
WARN_INTERVAL_S = 60.0

T = TypeVar("T")

__all__ = ["RedisStore", "redact_url"]


MAX_TTL_MS = 1 << 62  # the longest expiry kept (146 million years): Redis refuses one past 2**63 ms with the clock


class _Transport(Protocol):
    """How the store's four operations reach the servers; failures are answered, never raised."""

    def get(self, keys: list[str]) -> list[bytes | None]: ...

    def set(self, items: list[tuple[str, bytes]], ttl_ms: int | None) -> list[Any]: ...

    def types(self, keys: list[str]) -> list[Any]: ...  # per key its TYPE reply (another value where it failed)

    def unlink(self, keys: list[str]) -> None: ...

    def close(self) -> None: ...


class RedisStore:
    """Pages as Redis string values, optionally expiring after ``ttl_seconds``; a ``BlockStore``.

    ``url``: any form of ``redis_urls``. ``ValueError`` for a malformed URL or settings; nothing
    connects until the first call.
    """

    def __init__(
        self,
        url: str,
        ttl_seconds: float | None = None,
        *,
        socket_timeout_s: float = SOCKET_TIMEOUT_S,
        retry_after_s: float = RETRY_AFTER_S,
        warn_interval_s: float = WARN_INTERVAL_S,
    ) -> None:
        target = parse_redis_url(url)
        self.url = target.shown
        self._ttl_ms = None if ttl_seconds is None else max(1, round(_positive("ttl_seconds", ttl_seconds) * 1000))
        if self._ttl_ms is not None and self._ttl_ms > MAX_TTL_MS:
            raise ValueError(
                f"ttl_seconds must be at most {MAX_TTL_MS // 1000} (2**62 ms; Redis refuses longer), got {ttl_seconds}"
            )
        _positive("socket_timeout_s (RedisConnector's timeout_s)", socket_timeout_s)
        _positive("warn_interval_s", warn_interval_s)
        _positive("retry_after_s", retry_after_s, zero_ok=True)
        _import_redis()
        self._transport: _Transport
        if target.kind == "cluster":
            self._transport = ClusterTransport(target, socket_timeout_s, retry_after_s, warn_interval_s, log)
        else:
            health = ServerHealth(self.url, log, retry_after_s, warn_interval_s)
            self._transport = _ServerTransport(target, socket_timeout_s, health)
        self._verify_failures = RateLimitedWarning(log, f"redis store {self.url}", warn_interval_s)
        self._put_failures = RateLimitedWarning(log, f"redis store {self.url}", warn_interval_s)
        self._closed = False

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r})"

    def get_many(self, keys: Sequence[str], expected_sizes: Sequence[int] | None = None) -> list[bytes | None]:
        """Per key its verified payload, or None: missing, expired, damaged, wrong size, or server down."""
        self._check_open()
        keys = check_keys(keys)
        sizes = check_sizes(expected_sizes, len(keys))
        blobs = self._sent(self._transport.get, keys) if keys else []
        out: list[bytes | None] = []
        for key, blob, size in zip(keys, blobs, sizes, strict=True):
            payload = None if blob is None else decode_page(blob, size, key)
            out.append(None if payload is None else bytes(payload))
        rejected = [
            (key, blob)
            for key, blob, payload in zip(keys, blobs, out, strict=True)
            if blob is not None and payload is None
        ]
        if rejected:
            self._verify_failures(f"{len(rejected)} of {len(keys)} values failed verification")
            damaged = [key for key, blob in rejected if decode_page(blob, None, key) is None]  # not just another size
            if damaged:
                self._sent(self._transport.unlink, damaged)  # so that the next put of their keys writes them again
        return out

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """Store each payload under its key (with the TTL, if any); per item True if the server took it."""
        self._check_open()
        items = list(items)
        keys = check_keys([key for key, _ in items])
        blobs = [encode_page(data, key) for key, (_, data) in zip(keys, items, strict=True)]
        replies = self._sent(self._transport.set, list(zip(keys, blobs, strict=True)), self._ttl_ms) if keys else []
        rejected = [r for r in replies if isinstance(r, BaseException)]
        if rejected:
            self._put_failures(f"{len(rejected)} of {len(keys)} puts rejected: {rejected[0]}")
        return [r is True for r in replies]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Per key whether a value exists (not verified); False for every key while its server is down."""
        self._check_open()
        keys = check_keys(keys)
        return [holds_a_value(reply) for reply in self._sent(self._transport.types, keys)] if keys else []

    def delete_many(self, keys: Sequence[str]) -> None:
        """Remove the values of ``keys`` (UNLINK: the server frees them in the background)."""
        self._check_open()
        keys = check_keys(keys)
        if keys:
            self._sent(self._transport.unlink, keys)

    def close(self) -> None:
        """Close the connections. Idempotent."""
        if not self._closed:
            self._closed = True
            self._transport.close()
            self._verify_failures.flush()
            self._put_failures.flush()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self!r} is closed")

    def _sent(self, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)`` on the transport. A call that ``close`` from another thread cut short (a
        connection gone, a thread pool shut down) raises the closed store's ``ValueError``, not the
        client's error."""
        try:
            return call(*args)
        except Exception:
            self._check_open()
            raise


class _ServerTransport:
    """One server: plain, TLS or a Unix socket from the URL, or the primary that Sentinel names."""

    def __init__(self, target: RedisTarget, timeout_s: float, health: ServerHealth) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._health = health
        self._sentinel: Any = None
        settings = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "retry": Retry(NoBackoff(), 0),  # the back-off decides when to try again
        }
        try:
            if target.kind == "sentinel":
                from redis.sentinel import Sentinel

                self._sentinel = Sentinel(
                    target.nodes,
                    sentinel_kwargs={"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s},
                    username=target.username,
                    password=target.password,
                    db=target.db,
                    **settings,
                )
                self._client = self._sentinel.master_for(target.service_name)
            else:
                self._client = redis.Redis.from_url(target.url, **settings)
            pool = self._client.connection_pool
            if self._sentinel is None:  # unknown URL arguments fail here, not on first use
                pool.connection_class(**pool.connection_kwargs)
        except (TypeError, ValueError, redis.RedisError) as exc:
            raise ValueError(f"bad Redis URL {target.shown}: {exc}") from None
        if pool.connection_kwargs.get("decode_responses"):  # as redis-py reads it: any non-empty string is on
            self._client.close()
            raise ValueError(f"bad Redis URL {target.shown}: values are bytes; decode_responses must be off")
        self._server_errors: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)

    def get(self, keys: list[str]) -> list[bytes | None]:
        blobs = self._call("get", lambda: self._client.mget(keys))
        return [None] * len(keys) if blobs is None else blobs

    def set(self, items: list[tuple[str, bytes]], ttl_ms: int | None) -> list[Any]:
        def send() -> list[Any]:
            with self._client.pipeline(transaction=False) as pipe:
                for key, blob in items:
                    pipe.set(key, blob, px=ttl_ms)
                return pipe.execute(raise_on_error=False)

        replies = self._call("put", send)
        return [False] * len(items) if replies is None else replies

    def types(self, keys: list[str]) -> list[Any]:
        def send() -> list[Any]:
            with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.type(key)
                return pipe.execute()

        replies = self._call("contains", send)
        return [None] * len(keys) if replies is None else replies

    def unlink(self, keys: list[str]) -> None:
        self._call("delete", lambda: self._client.unlink(*keys))

    def close(self) -> None:
        self._client.close()
        if self._sentinel is not None:
            _close_sentinel(self._sentinel)

    def _call(self, op: str, request: Callable[[], T]) -> T | None:
        """``request()``'s reply, or None when the server is backed off or the request failed (logged)."""
        if not self._health.available():
            return None
        try:
            reply = request()
        except self._errors as exc:
            self._health.failed(op, explained(exc), server_down=isinstance(exc, self._server_errors))
            return None
        self._health.answered()
        return reply


def holds_a_value(type_reply: Any) -> bool:
    """Whether a ``TYPE`` reply names a string, the one type kvtier stores. A key of another type under
    kvtier's prefix (another tool's list or set) counts as absent, so the next save overwrites it
    (``SET`` replaces any type); ``EXISTS`` counted it present, and its block missed for good."""
    return type_reply in (b"string", "string")


def _positive(name: str, value: float, zero_ok: bool = False) -> float:
    """``value`` as a float > 0 (>= 0 with ``zero_ok``); ``ValueError`` naming ``name`` for anything
    else: a non-number, nan, an infinity, an int too large for a float."""
    try:
        finite = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    except OverflowError:  # an int past float's range
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number, got {reprlib.repr(value)}")
    if value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{name} must be {'>= 0' if zero_ok else '> 0'}, got {value}")
    return float(value)


def _import_redis() -> Any:
    try:
        import redis
    except ImportError:
        raise ImportError("RedisStore needs the redis package: pip install 'kvtier[redis]'") from None
    return redis


def _close_sentinel(sentinel: Any) -> None:
    """Close a ``redis.sentinel.Sentinel``'s connections to its sentinels: its own ``close`` (redis-py
    8.1), else each sentinel's client on its own."""
    close = getattr(sentinel, "close", None)
    if close is not None:
        close()
        return
    for client in sentinel.sentinels:
        client.close()
