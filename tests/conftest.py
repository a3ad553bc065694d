"""Shared fixtures: real Redis servers for the Redis store tests.

- ``redis_url``: one server for the session. ``KVTIER_TEST_REDIS_URL`` if set (CI starts one;
  it must answer), otherwise a ``redis-server`` from PATH started on a free loopback port in a
  temporary directory, without persistence, and stopped at the end. Without either, the tests
  that use it are skipped with the reason. Tests share it, so each uses keys of its own and
  never flushes it.
- ``start_redis``: a factory of dedicated servers for tests that stop, stall or restart one.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.connector.redis_store import redact_url

REDIS_URL_ENV = "KVTIER_TEST_REDIS_URL"
START_TIMEOUT_S = 10.0


def free_port() -> int:
    """A loopback TCP port that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A ``redis-server`` process on a fixed loopback port; it can be killed, stalled and restarted there.

    ``tls``: (certificate, key) files; the port then speaks only TLS and ``url`` is ``rediss://``,
    trusting that certificate.
    """

    def __init__(self, directory: Path, extra_args: tuple[str, ...] = (), tls: tuple[Path, Path] | None = None) -> None:
        self.directory = directory
        self.extra_args = extra_args
        self.tls = tls
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls[0]}"
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start on ``self.port`` (again, after ``kill``) and wait until it accepts connections."""
        args = ["redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        if self.tls is None:
            args += ["--port", str(self.port)]
        else:
            cert, key = self.tls
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert)]
            args += ["--tls-key-file", str(key), "--tls-auth-clients", "no"]
        log_path = self.directory / f"redis-{self.port}.log"
        with open(log_path, "ab") as log_file:
            self.proc = subprocess.Popen(
                [*args, "--dir", str(self.directory), *self.extra_args], stdout=log_file, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not listen on port {self.port} within {START_TIMEOUT_S}s")

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is flushed (and nothing is persisted anyway)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing is answered."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def _require_redis_server(why: str) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip(f"redis-server is not on PATH (install the redis-server package): {why}")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a Redis server shared by the session's tests."""
    url = os.environ.get(REDIS_URL_ENV)
    if url:
        redis = pytest.importorskip("redis")
        try:
            with redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2) as client:
                client.ping()
        except (redis.RedisError, OSError) as exc:
            pytest.fail(f"{REDIS_URL_ENV}={redact_url(url)} does not answer: {exc}")
        yield url
        return
    _require_redis_server(f"no Redis for the tests, and {REDIS_URL_ENV} is unset")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def start_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., RedisServer]]:
    """``start_redis(*extra_args, tls=None) -> RedisServer``: a dedicated, started server, stopped after the test."""
    _require_redis_server("this test stops, stalls or configures a server of its own")
    servers: list[RedisServer] = []

    def start(*extra_args: str, tls: tuple[Path, Path] | None = None) -> RedisServer:
        server = RedisServer(tmp_path_factory.mktemp("redis"), extra_args, tls)
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.stop()
