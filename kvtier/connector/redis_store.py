"""A block store in Redis: batched, one round trip per call, shared by every engine that reaches it.

Each call is one request to the server: ``get_many`` is one MGET, ``put_many`` one pipeline of
``SET key value [PX ttl]`` (not a transaction), ``contains_many`` one pipeline of EXISTS,
``delete_many`` one UNLINK. Values are framed by ``block_codec`` and verified on every read, so
a value that is damaged, foreign or of the wrong size is a miss.

The URL chooses the server and its security: ``redis://[[user]:password@]host[:port][/db]``,
``rediss://`` for TLS (e.g. ``?ssl_ca_certs=/path/ca.pem``), ``unix:///path.sock``. Query
arguments of the URL override the store's socket timeouts. The password never appears in logs.

A server failure never reaches the caller. A call that cannot connect, times out or loses its
connection answers misses (or failures, for puts) and starts a back-off: for ``retry_after_s``
calls answer misses at once without touching the network, then the next call tries again (and
the client reconnects). Socket timeouts are short (``socket_timeout_s``), so a dead or stalled
server costs a caller at most about that long per call. Failures are logged at WARNING at most
once per ``warn_interval_s`` (with a count of what was not logged); recovery is logged at INFO.
An error reply for one key (e.g. out of memory on a SET) fails that item only.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from kvtier.connector.block_codec import Buffer, decode_page, encode_page
from kvtier.connector.store import check_keys, check_sizes

log = logging.getLogger(__name__)

SOCKET_TIMEOUT_S = 1.0
RETRY_AFTER_S = 5.0
WARN_INTERVAL_S = 60.0
_SCHEMES = ("redis", "rediss", "unix")

T = TypeVar("T")


@dataclass(slots=True)
class _Outage:
    """Back-off and log rate limiting of one store: when to try the server again, when to warn again."""

    retry_after_s: float
    warn_interval_s: float
    down_until: float = -math.inf
    next_warning: float = -math.inf
    unlogged: int = 0
    failing: bool = False


class RedisStore:
    """Pages as Redis string values, optionally expiring after ``ttl_seconds``; a ``BlockStore``.

    ``ValueError`` for a malformed URL or settings; nothing connects until the first call.
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
        if not isinstance(url, str):
            raise TypeError(f"the Redis URL must be a str, got {url!r}")
        self.url = redact_url(url)
        _check_url(url, self.url)
        self._ttl_ms = None if ttl_seconds is None else max(1, round(_positive("ttl_seconds", ttl_seconds) * 1000))
        _positive("socket_timeout_s", socket_timeout_s)
        _positive("warn_interval_s", warn_interval_s)
        _positive("retry_after_s", retry_after_s, zero_ok=True)
        redis = _import_redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        try:
            self._client = redis.Redis.from_url(
                url,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s,
                retry=Retry(NoBackoff(), 0),  # the store's back-off decides when to try again
            )
            pool = self._client.connection_pool
            pool.connection_class(**pool.connection_kwargs)  # unknown URL arguments fail here, not on first use
        except (TypeError, ValueError, redis.RedisError) as exc:
            raise ValueError(f"bad Redis URL {self.url}: {exc}") from None
        self._server_errors: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._outage = _Outage(retry_after_s, warn_interval_s)
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r})"

    def get_many(self, keys: Sequence[str], expected_sizes: Sequence[int] | None = None) -> list[bytes | None]:
        """Per key its verified payload, or None: missing, expired, damaged, wrong size, or server down."""
        self._check_open()
        keys = check_keys(keys)
        sizes = check_sizes(expected_sizes, len(keys))
        blobs = self._call("get", lambda: self._client.mget(keys)) if keys else []
        if blobs is None:
            return [None] * len(keys)
        out: list[bytes | None] = []
        for key, blob, size in zip(keys, blobs, sizes, strict=True):
            payload = None if blob is None else decode_page(blob, size, key)
            out.append(None if payload is None else bytes(payload))
        damaged = sum(1 for blob, payload in zip(blobs, out, strict=True) if blob is not None and payload is None)
        if damaged:
            log.warning("kvtier redis store %s: %d of %d values failed verification", self.url, damaged, len(keys))
        return out

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """Store each payload under its key (with the TTL, if any); per item True if the server took it."""
        self._check_open()
        items = list(items)
        keys = check_keys([key for key, _ in items])
        blobs = [encode_page(data, key) for key, (_, data) in zip(keys, items, strict=True)]

        def send() -> list[Any]:
            with self._client.pipeline(transaction=False) as pipe:
                for key, blob in zip(keys, blobs, strict=True):
                    pipe.set(key, blob, px=self._ttl_ms)
                return pipe.execute(raise_on_error=False)

        replies = self._call("put", send) if keys else []
        if replies is None:
            return [False] * len(keys)
        rejected = [r for r in replies if isinstance(r, BaseException)]
        if rejected:
            log.warning(
                "kvtier redis store %s: %d of %d puts rejected: %s", self.url, len(rejected), len(keys), rejected[0]
            )
        return [r is True for r in replies]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Per key whether a value exists (not verified); False for every key while the server is down."""
        self._check_open()
        keys = check_keys(keys)

        def send() -> list[Any]:
            with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.exists(key)
                return pipe.execute()

        replies = self._call("contains", send) if keys else []
        return [False] * len(keys) if replies is None else [bool(r) for r in replies]

    def delete_many(self, keys: Sequence[str]) -> None:
        """Remove the values of ``keys`` (UNLINK: the server frees them in the background)."""
        self._check_open()
        keys = check_keys(keys)
        if keys:
            self._call("delete", lambda: self._client.unlink(*keys))

    def close(self) -> None:
        """Close the connections. Idempotent."""
        if not self._closed:
            self._closed = True
            self._client.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self!r} is closed")

    def _call(self, op: str, request: Callable[[], T]) -> T | None:
        """``request()``'s reply, or None when the server is backed off or the request failed (logged)."""
        now = time.monotonic()
        with self._lock:
            if now < self._outage.down_until:
                self._outage.unlogged += 1
                return None
        try:
            reply = request()
        except self._errors as exc:
            self._failed(op, exc)
            return None
        with self._lock:
            if self._outage.failing:
                self._outage.failing = False
                log.info("kvtier redis store %s: the server answers again", self.url)
        return reply

    def _failed(self, op: str, exc: BaseException) -> None:
        """Back off if the server is unreachable; warn, at most once per ``warn_interval_s``."""
        now = time.monotonic()
        o = self._outage
        with self._lock:
            server_down = isinstance(exc, self._server_errors)
            if server_down:
                o.down_until = now + o.retry_after_s
                o.failing = True
            if now < o.next_warning:
                o.unlogged += 1
                return
            o.next_warning = now + o.warn_interval_s
            unlogged, o.unlogged = o.unlogged, 0
        action = f"answering misses for {o.retry_after_s:g}s, then retrying" if server_down else "answering misses"
        log.warning(
            "kvtier redis store %s: %s failed (%s: %s); %s (%d more calls answered misses since the last warning)",
            self.url,
            op,
            type(exc).__name__,
            exc,
            action,
            unlogged,
        )


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs and errors)."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.hostname or ""
        host = f"[{host}]" if ":" in host else host
        port = f":{parts.port}" if parts.port is not None else ""
        return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))
    except ValueError:
        return "<malformed Redis URL>"


def _check_url(url: str, shown: str) -> None:
    """``ValueError`` for a scheme other than redis/rediss/unix, or a database that is not a number."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError as exc:
        raise ValueError(f"bad Redis URL {shown}: {exc}") from None
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"bad Redis URL {shown}: the scheme must be one of {', '.join(s + '://' for s in _SCHEMES)}")
    db = parts.path.lstrip("/")
    if parts.scheme != "unix" and db and not db.isdigit():
        raise ValueError(f"bad Redis URL {shown}: the database must be a number, got {db!r}")


def _positive(name: str, value: float, zero_ok: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{name} must be {'>= 0' if zero_ok else '> 0'}, got {value}")
    return float(value)


def _import_redis() -> Any:
    try:
        import redis
    except ImportError:
        raise ImportError("RedisStore needs the redis package: pip install 'kvtier[redis]'") from None
    return redis
