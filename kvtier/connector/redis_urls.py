"""Where a Redis store lives: the URL forms ``RedisStore`` accepts, parsed and checked.

- ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` (TLS, e.g.
  ``?ssl_ca_certs=/path/ca.pem``) and ``unix:///path.sock``: one server. These go to
  ``redis.Redis.from_url`` as they are, so its query arguments work, but for the socket timeouts
  kvtier sets from the store's own timeout (``ValueError``).
- ``redis-cluster://[[user]:password@]host[:port][,host[:port]...]``: any nodes of a Redis
  Cluster (the client discovers the rest); default port 6379; no database (a cluster has only 0).
- ``redis-sentinel://[[user]:password@]host[:port][,host[:port]...]/service_name[/db]``: the
  Sentinels that watch ``service_name``; the primary is asked of them. Default port 26379. The
  user and password are the data servers'; the Sentinels are reached without one.

Valkey servers speak the same protocol and take the same URLs. A password never appears in
``redact_url``'s output, which is what logs and errors show.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import parse_qsl, unquote, urlsplit

SERVER_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEME = "redis-cluster"
SENTINEL_SCHEME = "redis-sentinel"
SCHEMES = (*SERVER_SCHEMES, CLUSTER_SCHEME, SENTINEL_SCHEME)
DEFAULT_PORTS = {CLUSTER_SCHEME: 6379, SENTINEL_SCHEME: 26379}
KVTIER_SETS = frozenset({"socket_timeout", "socket_connect_timeout"})  # set from the store's timeout
_QUERY_PASSWORD = re.compile(r"([?&](?:[a-z_]*_)?password=)[^&#]*", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A parsed store URL. ``kind`` says which client reaches it; ``shown`` is the URL without its password.

    For ``server``, ``url`` is handed to redis-py unchanged; for ``cluster`` and ``sentinel``,
    ``nodes`` are the addresses to start from (cluster nodes, or Sentinels).
    """

    kind: Literal["server", "cluster", "sentinel"]
    url: str
    shown: str
    nodes: tuple[tuple[str, int], ...] = ()
    service_name: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None


def parse_redis_url(url: str) -> RedisTarget:
    """The target of ``url``; ``TypeError`` unless a str, ``ValueError`` (password redacted) if malformed."""
    if not isinstance(url, str):
        raise TypeError(f"the Redis URL must be a str, got {url!r}")
    shown = redact_url(url)
    if _password_cut_short(url):  # refused before a parse could read part of the password as an address
        raise ValueError(f"bad Redis URL {shown}: {_ENCODE_IT}")
    try:
        return _parse(url, shown)
    except ValueError as exc:
        hidden = _hidden_text(url)
        quoted = re.findall(r"'([^']*)'", str(exc).removeprefix(f"bad Redis URL {shown}"))
        if hidden and any(_reveals(value, hidden) for value in quoted):
            raise ValueError(f"bad Redis URL {shown}: it cannot be read ({_ENCODE_IT})") from None
        raise


_ENCODE_IT = (
    "a user or password holding '/', '?', '#' or '@' must be percent-encoded (urllib.parse.quote(password, safe='')), "
    "and so must an '@' in a query value"
)


def _password_cut_short(url: str) -> bool:
    """Whether a password (text between a ':' and a later '@') holds an unescaped '/', '?' or '#'
    that cut the URL short: a '#' anywhere (no Redis URL has a fragment), an '@' in the path (a
    database or service name has none), a query part that is no ``name=value``, or an address cut to
    no host or port (``:Zx9``, ``user:Zx9``). An '@' inside a query value (``client_name=svc@pod``)
    is none of these."""
    rest = _QUERY_PASSWORD.sub(r"\1", url.partition("://")[2])
    if not rest.rpartition("@")[0].partition(":")[2]:
        return False
    address, path, query = _split(rest)
    if "#" in rest or "@" in path or any("=" not in part for part in query.split("&") if query):
        return True
    if "@" not in address:  # the '@' is in a query value: no password here
        return False
    hosts = address.rpartition("@")[2]
    if not hosts:
        return True
    # A port that is no number is the parse's to name, unless an '@' in the query means a '?' in
    # the password may have cut it short before its last '@' (then that "port" may be the password's).
    any_port = "@" not in query
    return not all(_is_address(entry, any_port) for entry in hosts.split(","))


def _split(rest: str) -> tuple[str, str, str]:
    """A URL after its ``scheme://``: the address, the path, the query (each '' if absent)."""
    rest = rest.partition("#")[0]
    rest, _, query = rest.partition("?")
    address, slash, path = rest.partition("/")
    return address, slash + path, query


def _hidden_text(url: str) -> str:
    """The text ``redact_url`` hides as the password: after the first ':' of everything between
    ``://`` and the last '@' (a password's unescaped '?' or '/' may have cut the parsed address
    short before it), or ''."""
    rest = _QUERY_PASSWORD.sub(r"\1", url.partition("://")[2])
    return rest.rpartition("@")[0].partition(":")[2]


def _is_address(entry: str, any_port: bool = False) -> bool:
    """Whether a ``host[:port]`` entry names a host and, unless ``any_port``, a port that is a number."""
    parts = _host_and_port(entry)
    return parts is not None and bool(parts[0]) and (any_port or parts[1] is None or parts[1].isdigit())


def _host_and_port(entry: str) -> tuple[str, str | None] | None:
    """A ``host[:port]`` entry (IPv6 in brackets) as (host, port text or None); None when malformed."""
    if entry.startswith("["):
        host, bracket, rest = entry[1:].partition("]")
        port_text = rest[1:] if bracket and rest.startswith(":") else None
        return None if not bracket or (rest and port_text is None) else (host, port_text)
    host, colon, port_text = entry.partition(":")
    return host, (port_text if colon else None)


def _reveals(value: str, secret: str, span: int = 3) -> bool:  # (a value quoted by a message)
    """Whether ``value`` shows part of ``secret``: it lies within it, or holds ``span`` consecutive
    characters of it (all of a shorter one)."""
    if value and value in secret:
        return True
    return any(secret[i : i + span] in value for i in range(max(1, len(secret) - span + 1)))


def _parse(url: str, shown: str) -> RedisTarget:
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"bad Redis URL {shown}: {exc}") from None
    if parts.scheme not in SCHEMES:
        raise ValueError(f"bad Redis URL {shown}: the scheme must be one of {', '.join(s + '://' for s in SCHEMES)}")
    if parts.scheme in SERVER_SCHEMES:
        _check_server_url(parts, shown)
        return RedisTarget("server", url, shown)
    if parts.query or parts.fragment:
        raise ValueError(f"bad Redis URL {shown}: {parts.scheme}:// takes no query arguments")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, password = _credentials(userinfo)
    nodes = _addresses(hosts, DEFAULT_PORTS[parts.scheme], shown)
    path = [p for p in parts.path.split("/") if p]
    if parts.scheme == CLUSTER_SCHEME:
        if path not in ([], ["0"]):
            raise ValueError(f"bad Redis URL {shown}: a cluster has only database 0, got path {parts.path!r}")
        return RedisTarget("cluster", url, shown, nodes, username=username, password=password)
    if not path or len(path) > 2:
        raise ValueError(f"bad Redis URL {shown}: expected /service_name[/db] after the Sentinels")
    db = _database(path[1] if len(path) == 2 else "", shown)
    return RedisTarget("sentinel", url, shown, nodes, unquote(path[0]), db, username, password)


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs and errors).

    Works on the text, not on a parse: a password holding ``#``, ``/`` or ``?`` unescaped ends a
    parsed authority early, and would be shown. Everything between ``://`` and the last ``@`` is
    the user and password then (hiding more than the password is the safe side), and a
    ``password=`` query argument is hidden too.
    """
    url = _QUERY_PASSWORD.sub(r"\1***", url)  # first: a query password may hold '@'
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        userinfo, _, tail = rest.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        if colon:
            url = f"{scheme}://{user}:***@{tail}"
    return url


def _check_server_url(parts, shown: str) -> None:
    """A port that is a number in range, a database that is a number (redis://, rediss://), and
    no query argument of those kvtier sets itself (``KVTIER_SETS``)."""
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError as exc:
        raise ValueError(f"bad Redis URL {shown}: {exc}") from None
    taken = sorted({name for name, _ in parse_qsl(parts.query, keep_blank_values=True)} & KVTIER_SETS)
    if taken:
        raise ValueError(
            f"bad Redis URL {shown}: {', '.join(taken)} would override the limit kvtier sets from the "
            "store's timeout (a slow server must degrade to misses within it): give "
            "RedisConnector(url, timeout_s=...) or RedisStore(url, socket_timeout_s=...) instead"
        )
    if parts.scheme != "unix":
        _database(parts.path.lstrip("/"), shown)


def _database(text: str, shown: str) -> int:
    if not text:
        return 0
    if not text.isdigit():
        raise ValueError(f"bad Redis URL {shown}: the database must be a number, got {text!r}")
    return int(text)


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    if not userinfo:
        return None, None
    user, colon, password = userinfo.partition(":")
    return (unquote(user) or None), (unquote(password) if colon else None)


def _addresses(hosts: str, default_port: int, shown: str) -> tuple[tuple[str, int], ...]:
    """``host[:port]`` entries separated by commas (IPv6 in brackets), each checked."""
    out = []
    for entry in hosts.split(","):
        parts = _host_and_port(entry)
        if parts is None:
            raise ValueError(f"bad Redis URL {shown}: bad address {entry!r}")
        host, port_text = parts
        if not host:
            raise ValueError(f"bad Redis URL {shown}: an empty host in {hosts!r}")
        port = default_port
        if port_text is not None:
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise ValueError(f"bad Redis URL {shown}: the port must be a number in 1..65535, got {port_text!r}")
            port = int(port_text)
        out.append((host, port))
    return tuple(out)


_NO_PASSWORD_GIVEN = ("NOAUTH", "Authentication required", "HELLO must be called with the client already authenticated")


def explained(exc: BaseException) -> BaseException:
    """``exc``, or for a server that asks for a password the URL did not give, an exception of its
    type whose text says so (redis-py's own names the HELLO handshake, not the URL)."""
    text = str(exc)
    if not any(sign in text for sign in _NO_PASSWORD_GIVEN):
        return exc
    try:
        return type(exc)(
            f"the server asks for a password, and the URL gives none: redis://[user]:password@host ({text})"
        )
    except Exception:  # an exception type built otherwise: as it is
        return exc
