"""Store URLs: every form parsed to its target, malformed ones refused with a ValueError that hides the password."""

from __future__ import annotations

import pytest

from kvtier.connector import RedisConnector, RedisStore
from kvtier.connector.redis_urls import parse_redis_url, redact_url

pytest.importorskip("redis")


@pytest.mark.parametrize(
    "url, kind, nodes",
    [
        ("redis://127.0.0.1:6379/0", "server", ()),
        ("rediss://cache.example:6380/2?ssl_ca_certs=/tmp/ca.pem", "server", ()),
        ("unix:///run/redis.sock", "server", ()),
        (
            "redis-cluster://10.0.0.1:7000,10.0.0.2:7001,10.0.0.3",
            "cluster",
            (("10.0.0.1", 7000), ("10.0.0.2", 7001), ("10.0.0.3", 6379)),
        ),
        ("redis-cluster://[::1]:7000,[fe80::2]/", "cluster", (("::1", 7000), ("fe80::2", 6379))),
        ("redis-sentinel://s1:26380,s2/mymaster", "sentinel", (("s1", 26380), ("s2", 26379))),
    ],
)
def test_each_form_parses_to_its_target(url, kind, nodes):
    target = parse_redis_url(url)
    assert (target.kind, target.nodes) == (kind, nodes)
    assert target.shown == url  # nothing to hide


def test_credentials_service_and_database():
    target = parse_redis_url("redis-sentinel://app:p%40ss@127.0.0.1:26379/my%20service/3")
    assert (target.username, target.password, target.service_name, target.db) == ("app", "p@ss", "my service", 3)
    assert "p%40ss" not in target.shown and target.shown.startswith("redis-sentinel://app:***@127.0.0.1:26379/")
    cluster = parse_redis_url("redis-cluster://:s3cret@a:1,b:2")
    assert (cluster.username, cluster.password) == (None, "s3cret")
    assert redact_url("redis-cluster://:s3cret@a:1,b:2") == "redis-cluster://:***@a:1,b:2"
    assert parse_redis_url("redis-sentinel://h/svc").db == 0


@pytest.mark.parametrize(
    "url",
    [
        "redis-cluster://",
        "redis-cluster://a:1,,b:2",
        "redis-cluster://a:0",
        "redis-cluster://a:70000",
        "redis-cluster://a:port",
        "redis-cluster://[::1:7000",
        "redis-cluster://a:1/3",
        "redis-cluster://a:1?socket_timeout=2",
        "redis-sentinel://s:26379",
        "redis-sentinel://s:26379/",
        "redis-sentinel://s:26379/svc/zero",
        "redis-sentinel://s:26379/svc/0/extra",
        "redis+cluster://a:1",
    ],
)
def test_a_malformed_url_is_a_value_error(url):
    with pytest.raises(ValueError, match="Redis URL"):
        parse_redis_url(url)
    with pytest.raises(ValueError, match="Redis URL"):
        RedisStore(url)


@pytest.mark.parametrize(
    "url",
    [
        "redis://h:6379/0?socket_timeout=3",
        "rediss://h:6379/0?ssl_cert_reqs=none&socket_connect_timeout=3",
        "unix:///tmp/r.sock?socket_timeout=30",
    ],
)
def test_a_url_overriding_the_stores_timeout_is_refused(url):
    """The store's own timeout bounds a stall on a hung server (``RedisConnector(timeout_s=...)``);
    redis-py lets a URL's query arguments win over it. Before, a ``socket_timeout`` in the URL
    silently replaced it: a hung server stalled each call for the URL's 3 s, not the 0.2 s given."""
    with pytest.raises(ValueError, match="timeout_s"):
        parse_redis_url(url)
    with pytest.raises(ValueError, match="would override"):
        RedisConnector(url, timeout_s=0.2)


def test_the_password_never_shows_in_errors():
    for url in ("redis-cluster://:topsecret@a:bad", "redis-sentinel://u:topsecret@s:1/svc/x"):
        with pytest.raises(ValueError) as info:
            RedisStore(url)
        assert "topsecret" not in str(info.value) and "***" in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://:p#ss-topsecret@127.0.0.1:bad/0",  # '#', '/' and '?' end a parsed authority early
        "redis://user:a/topsecret@127.0.0.1:bad/0",
        "redis://:top?secret@127.0.0.1:bad/0",
        "redis-cluster://:top#secret@a:bad",
        "redis://127.0.0.1:bad/0?password=topsecret",
    ],
)
def test_a_password_with_url_delimiters_never_shows(url):
    assert "secret" not in redact_url(url) and "***" in redact_url(url)
    with pytest.raises(ValueError) as info:
        RedisStore(url)
    assert "secret" not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://:Zx9/Qw7+Lm@127.0.0.1:6420/0",  # a generated base64 secret: '/' unescaped
        "redis://user:Zx9/Qw7+Lm@127.0.0.1:6420/0",
        "redis-cluster://:Zx9/Qw7+Lm@127.0.0.1:6420",
        "redis-sentinel://:Zx9/Qw7+Lm@127.0.0.1:6420/svc",
        "redis://:p@ss/w0rd@localhost:6379/0",
        "redis://:Zx9?Qw7@127.0.0.1:6420/0",
        "redis://default:2024#Summer@host:6379/0",  # the part before the delimiter looks like host:port
        "redis://default:1234?x@host:6379/0",
        "redis://default:12/34@host:6379/0",
    ],
)
def test_no_part_of_a_password_with_an_unescaped_delimiter_shows_and_the_fix_is_named(url):
    """Before, the parse error's detail showed the part of the password before the '/' ("Port could
    not be cast to integer value as 'Zx9'"; "the database must be a number, got 'w0rd@...'")."""
    secret = url.split("://")[1].rpartition("@")[0].partition(":")[2]
    with pytest.raises(ValueError, match="percent-encode") as info:
        RedisStore(url)
    shown = str(info.value)
    pieces = {secret[i : i + 3] for i in range(len(secret) - 2)}
    assert not [piece for piece in pieces if piece in shown], shown


@pytest.mark.parametrize(
    "url",
    [
        "redis://host:6379/0?password=p@ss",
        "unix:///run/redis.sock?password=s3cr@t",
        "redis://host/0?client_name=svc@pod",
    ],
)
def test_an_at_sign_in_the_query_is_no_password_delimiter(url):
    """Before, the check for a delimiter in the password took these valid URLs for broken ones, and
    ``redact_url`` showed the part of a query password after its '@'."""
    target = parse_redis_url(url)
    assert ("password" not in url) or (target.shown.endswith("password=***") and "@" not in target.shown)


def test_a_percent_encoded_password_with_delimiters_is_taken():
    from urllib.parse import quote

    target = parse_redis_url(f"redis-cluster://:{quote('Zx9/Qw7+Lm', safe='')}@127.0.0.1:6420")
    assert target.password == "Zx9/Qw7+Lm" and target.nodes == (("127.0.0.1", 6420),)


def test_nothing_connects_before_the_first_call():
    for url in ("redis-cluster://127.0.0.1:1,127.0.0.1:2", "redis-sentinel://127.0.0.1:1/svc"):
        store = RedisStore(url)
        assert repr(store) == f"RedisStore({url!r})"
        store.close()
        store.close()
        with pytest.raises(ValueError, match="closed"):
            store.get_many(["k"])


def test_connector_settings_are_checked():
    with pytest.raises(ValueError, match="timeout"):
        RedisConnector("redis://127.0.0.1:1/0", timeout_s=0)
    with pytest.raises(ValueError, match="save policy"):
        RedisConnector("redis://127.0.0.1:1/0", save_policy="hot")
    with pytest.raises(TypeError):
        RedisConnector(None)


@pytest.mark.parametrize(
    ("url", "detail"),
    [
        ("redis://:number9@host:6379/x", "the database must be a number, got 'x'"),
        ("redis://:porter@host:99999/0", "Port out of range"),
    ],
)
def test_an_ordinary_mistake_keeps_its_own_message(url, detail):
    """The advice about delimiters in a password replaces only messages that would show part of one."""
    with pytest.raises(ValueError) as info:
        parse_redis_url(url)
    assert detail in str(info.value) and "percent-encoded" not in str(info.value)


def test_a_port_that_is_no_number_is_named_as_such_beside_a_password():
    """``redis://u:pw@h:notaport``: the error names the port. Before, it told to percent-encode the
    password. Where the query holds an '@', a '?' in the password may have cut it short before it:
    what looks like a port there may be the password's, and the advice stays."""
    for url, port in (("redis://u:pw@h:notaport", "notaport"), ("redis-cluster://u:pw@h1:1,h2:x", "x")):
        with pytest.raises(ValueError, match=f"'{port}'") as error:
            parse_redis_url(url)
        assert "percent-encoded" not in str(error.value) and "pw" not in str(error.value)
    # a '?' in the password with an '@' after it: what looks like a port may be the password's
    for url, secret in (
        ("redis://:Pa@h:Xq7z?k=v@host:6379/0", "Xq7z"),
        ("rediss://user:x@y:SeCrEt?a=b@host:6380", "SeCrEt"),
        ("redis://:Pa@SecretPart:?client_name=Zq@real.example:6379/0", "SecretPart"),
        # an '@' in the query alone: redact_url hides up to it, so the message names none of that
        ("redis://host:63a9/0?client_name=svc@pod", "63a9"),
    ):
        with pytest.raises(ValueError, match="percent-encoded") as error:
            parse_redis_url(url)
        assert secret.lower() not in str(error.value).lower()


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("redis://u:2Z04K&?J=X@h:6379", "2Z04K&"),  # the '?' left no '@' in the address: 'u' read as the host
        ("redis://:7/:192=[4=ZZ?@a:1,b:2/0?client_name=x@y", "192=[4=ZZ"),  # read as the database
        ("rediss://:[X]Q@[::1]:7000?a=b", "[X]"),  # one character of it, read as an address
    ],
)
def test_no_part_of_a_password_cut_short_shows_in_the_error(url, secret):
    """A password whose unescaped delimiters cut the parsed address short: the error quotes none of
    what ``redact_url`` hides. Before, a port, a database or an address read from the password's
    text (a whole one of up to two characters, or more where no '@' was left in the address) was
    quoted back (1,286 of 150,000 fuzzed URLs)."""
    with pytest.raises(ValueError, match="percent-encoded") as error:
        parse_redis_url(url)
    shown = f"bad Redis URL {redact_url(url)}: "
    assert str(error.value).startswith(shown)
    reason = str(error.value).removeprefix(shown)
    assert secret not in reason and "X" not in reason
