"""``rediss+cluster://``: TLS to every node of a cluster, the nodes' certificates verified
(splitbus/bus/core/cluster.py, splitbus/bus/core/connection.py). Its options, and the attack it stops: a
listener that is not a node of the cluster (a startup node that is someone else's, as a forged
``MOVED`` would point at) never receives the password, in clear or otherwise. A plain
``redis+cluster://`` client shows what it would receive (so that the check could fail)."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import RedisClusterException

from splitbus.bus.core.cluster import ClusterTls, ClusterUrl, cluster_url, parse_cluster_url
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect, connect_sync
from splitbus.cli.redis_cli_cmd import connection_options
from splitbus.cluster_tls import TlsFiles, ensure_tls_files
from splitbus.redis_cluster import EmbeddedCluster

TLS_URL = "rediss+cluster://u:pw@h:1,h:2?ssl_ca_certs=/a%20b/ca.crt&ssl_certfile=/c/client.crt&ssl_keyfile=/c/k"


def test_a_tls_cluster_url_names_its_ca_and_client_certificate() -> None:
    url = parse_cluster_url(TLS_URL)
    assert url == ClusterUrl(((("h", 1), ("h", 2))), "u", "pw", ClusterTls("/a b/ca.crt", "/c/client.crt", "/c/k"))
    assert url.tls is not None and url.tls.settings()["ssl_cert_reqs"] == "required"
    assert url.tls.settings()["ssl_check_hostname"]
    with pytest.raises(ValueError, match="certificate file /a b/ca.crt cannot be read"):
        url.client_settings()  # what a client would be built with: it would retry for ever, naming no file
    with pytest.raises(ValueError, match="certificate file /a b/ca.crt cannot be read"):
        BusConfig(redis_url=TLS_URL)  # a part's start: one line, not a traceback at its first command
    assert parse_cluster_url("rediss+cluster://h:1").tls == ClusterTls()  # the system's CAs
    unchecked = parse_cluster_url("rediss+cluster://h:1?ssl_ca_certs=/ca&ssl_check_hostname=false").tls
    assert unchecked is not None and not unchecked.check_hostname
    tls = ClusterTls("/a b/ca.crt", "/c/client.crt", "/c/k", check_hostname=False)
    assert parse_cluster_url(cluster_url("u", "p@w", [("h", 1), ("::1", 2)], tls)).tls == tls


@pytest.mark.parametrize(
    "url",
    [
        "rediss+cluster://h:1?ssl_cert_reqs=none",  # verification cannot be turned off
        "rediss+cluster://h:1?ssl_ca_cert=/ca",  # misspelt: refused, not ignored
        "rediss+cluster://h:1?ssl_ca_certs=/a&ssl_ca_certs=/b",
        "rediss+cluster://h:1?ssl_ca_certs=",
        "rediss+cluster://h:1?ssl_keyfile=/k",
        "rediss+cluster://h:1?ssl_check_hostname=maybe",
        "rediss+cluster://h:1?ssl_check_hostname=false",  # any public certificate would do, for any name
        "redis+cluster://h:1?ssl_ca_certs=/a",
    ],
)
def test_a_tls_cluster_url_with_an_option_it_cannot_honour_is_refused(url: str) -> None:
    with pytest.raises(ValueError):
        parse_cluster_url(url)


def test_redis_cli_gets_the_certificates_of_a_tls_cluster_url() -> None:
    options, password = connection_options(TLS_URL)
    assert options[:5] == ["-c", "-h", "h", "-p", "1"]
    assert options[options.index("--tls") :] == [
        *("--tls", "--cacert", "/a b/ca.crt", "--cert", "/c/client.crt", "--key", "/c/k"),
    ]
    assert password == "pw" and "pw" not in options


class Listener:
    """Someone else's port on loopback, posing as a node: it records every byte a client sends
    it (for a TLS one, every byte after a handshake, which only a certificate of the cluster's CA
    would let through) and answers nothing."""

    def __init__(self, tls: TlsFiles | None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.context = None if tls is None else ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        if self.context is not None and tls is not None:
            self.context.load_cert_chain(tls.node_cert, tls.node_key)
        self.received = bytearray()
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                self.connections += 1
                threading.Thread(target=self._record, args=(conn,), daemon=True).start()

    def _record(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            conn.settimeout(3)
            stream = conn if self.context is None else self.context.wrap_socket(conn, server_side=True)
            while chunk := stream.recv(65536):
                self.received += chunk

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(params=["plain", "foreign-ca", "system-ca"])
def listener(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Listener]:
    """A plain TCP listener, or a TLS one whose certificate another CA signed: one the process
    does not trust, or (``system-ca``) one of the system's trusted CAs, as a company's or mkcert's
    CA is (``SSL_CERT_FILE``, which ``ssl.create_default_context`` reads)."""
    other = None if request.param == "plain" else ensure_tls_files(tmp_path / "other-ca", "127.0.0.1")
    if request.param == "system-ca" and other is not None:
        monkeypatch.setenv("SSL_CERT_FILE", str(other.ca_cert))
    found = Listener(other)
    yield found
    found.close()


def _url_of(listener: Listener, cluster: EmbeddedCluster, tls: bool = True) -> str:
    """The cluster's URL, password and certificates, with the listener as its only startup node
    (redis-py shuffles startup nodes: with others, it might never dial the listener)."""
    return cluster_url(
        "splitbus", cluster.password, [("127.0.0.1", listener.port)], cluster.client_tls if tls else None
    )


def _sync_client_tries(url: str) -> None:
    with contextlib.suppress(RedisClusterException, redis.RedisError, OSError):  # no node answers
        connect_sync(url, socket_timeout=1, socket_connect_timeout=1).close()


def _received_no_credentials(listener: Listener, cluster: EmbeddedCluster) -> None:
    assert listener.connections >= 1  # it was dialled
    assert cluster.password.encode() not in listener.received
    assert b"AUTH" not in listener.received.upper() and b"HELLO" not in listener.received.upper()


def test_a_sync_tls_cluster_client_sends_no_credentials_to_a_listener_outside_the_cluster(
    redis_cluster: EmbeddedCluster, listener: Listener
) -> None:
    _sync_client_tries(_url_of(listener, redis_cluster))
    _received_no_credentials(listener, redis_cluster)


async def test_the_bus_client_sends_no_credentials_to_a_listener_outside_the_cluster(
    redis_cluster: EmbeddedCluster, listener: Listener
) -> None:
    client = connect(BusConfig(redis_url=_url_of(listener, redis_cluster), socket_timeout_s=1, block_ms=200))
    try:
        with pytest.raises((RedisClusterException, redis.RedisError, OSError)):
            await client.get("t-tls:{b}")
    finally:
        await client.aclose()
    _received_no_credentials(listener, redis_cluster)


def test_redis_pys_own_tls_client_would_send_the_password_to_a_listener_the_system_trusts(
    redis_cluster: EmbeddedCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why the bus's TLS connections trust the cluster's CA alone: redis-py's own load the system's
    CAs and add ``ssl_ca_certs`` to them, so a listener whose certificate one of the system's CAs
    signed is taken for a node (what the ``system-ca`` listener above shows the bus refusing)."""
    other = ensure_tls_files(tmp_path / "other-ca", "127.0.0.1")
    monkeypatch.setenv("SSL_CERT_FILE", str(other.ca_cert))
    listener = Listener(other)
    ca = tmp_path / "cluster-ca.crt"  # a path of its own: redis-py shares contexts by their files
    ca.write_bytes(Path(str(redis_cluster.client_tls.ca_certs if redis_cluster.client_tls else "")).read_bytes())
    assert redis_cluster.client_tls is not None
    tls = ClusterTls(str(ca), redis_cluster.client_tls.certfile, redis_cluster.client_tls.keyfile)
    try:
        with contextlib.suppress(RedisClusterException, redis.RedisError, OSError):
            redis.RedisCluster(
                startup_nodes=[redis.cluster.ClusterNode("127.0.0.1", listener.port)],
                username="splitbus",
                password=redis_cluster.password,
                socket_timeout=1,
                socket_connect_timeout=1,
                **tls.settings(),  # no connection_class: redis-py's SSLConnection
            ).close()
        assert redis_cluster.password.encode() in listener.received
    finally:
        listener.close()


def test_a_plain_cluster_client_would_send_the_password_to_that_listener(redis_cluster: EmbeddedCluster) -> None:
    """What ``redis+cluster://`` does (and ``rediss+cluster://`` above does not)."""
    listener = Listener(None)
    try:
        _sync_client_tries(_url_of(listener, redis_cluster, tls=False))
        assert redis_cluster.password.encode() in listener.received
    finally:
        listener.close()
