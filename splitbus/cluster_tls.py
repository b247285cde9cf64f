"""The embedded Redis Cluster's certificates: one CA, a node certificate every node serves (client
port and cluster bus, and presents when it connects to another node or replicates), and a client
certificate for splitbus's parts. With ``tls-auth-clients yes`` a node takes a connection only
from a peer holding a certificate this CA signed, so a node started by anyone else can neither
join the cluster nor take a slot, and a client that verifies the nodes sends its password to no
other listener (docs/cluster.md, "TLS").

All in one 0700 folder (the cluster's ``tls/``), every file 0600, the CA key too: whoever reads
it can mint a node. Made at the cluster's first start and reused after; a certificate that no
longer covers the host, expires within :data:`RENEW_BEFORE`, was not signed by the CA or does not
match its key (a start interrupted between the two writes) is issued again by the same CA; a CA
that expires within :data:`RENEW_BEFORE` is made anew, with everything it signed. A folder that
cannot be read or written is a :class:`~splitbus.redis_server.RedisServerError` naming it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from splitbus.redis_server import RedisServerError, make_private_folder, write_private

CA_DAYS = 3650
CERT_DAYS = 825
"""Node and client certificates: what browsers cap a server certificate at; reissued at start."""
RENEW_BEFORE = datetime.timedelta(days=30)
LOOPBACK_NAMES = ("127.0.0.1", "::1", "localhost")
"""Names every node certificate covers, besides the host the cluster binds."""


@dataclass(frozen=True)
class TlsFiles:
    """Where the cluster's certificates and keys are (PEM)."""

    folder: Path

    @property
    def ca_cert(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.folder / "ca.key"

    @property
    def node_cert(self) -> Path:
        """Served by every node, and presented by it to the others (bus, replication)."""
        return self.folder / "node.crt"

    @property
    def node_key(self) -> Path:
        return self.folder / "node.key"

    @property
    def client_cert(self) -> Path:
        """What splitbus's parts, ``status`` and ``redis-cli`` present to the nodes."""
        return self.folder / "client.crt"

    @property
    def client_key(self) -> Path:
        return self.folder / "client.key"


def ensure_tls_files(folder: Path, host: str) -> TlsFiles:
    """The certificates of ``folder``, made or renewed where needed (see the module's text)."""
    try:
        return _ensure(TlsFiles(folder), host)
    except (OSError, ValueError, TypeError) as exc:  # unreadable, unwritable, or a key that is not PEM
        raise RedisServerError(
            f"cannot make or read the cluster's certificates in {folder} ({type(exc).__name__}: {exc}); "
            "delete that folder to make new ones"
        ) from exc


def _ensure(files: TlsFiles, host: str) -> TlsFiles:
    make_private_folder(files.folder)
    ca = _valid_ca(files)
    if ca is None:  # what the old CA signed is worthless now
        ca = _write_ca(files)
    names = tuple(dict.fromkeys((host, *LOOPBACK_NAMES)))
    for cert, key, common_name, covers in (
        (files.node_cert, files.node_key, "splitbus cluster node", names),
        (files.client_cert, files.client_key, "splitbus client", ()),
    ):
        if _needs_issue(ca, cert, key, covers):
            _issue(files, cert, key, common_name, covers)
    return files


def _valid_ca(files: TlsFiles) -> x509.Certificate | None:
    """The CA, if both its files are there and it does not expire within :data:`RENEW_BEFORE`."""
    if not (files.ca_cert.exists() and files.ca_key.exists()):
        return None
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    return ca if ca.not_valid_after_utc - RENEW_BEFORE > _now() else None


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _write_ca(files: TlsFiles) -> x509.Certificate:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"splitbus cluster CA {os.urandom(4).hex()}")])
    cert = (
        _builder(name, name, key.public_key(), CA_DAYS)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .sign(key, hashes.SHA256())
    )
    _write_key(files.ca_key, key)
    write_private(files.ca_cert, cert.public_bytes(serialization.Encoding.PEM).decode())
    return cert


def _builder(
    subject: x509.Name, issuer: x509.Name, public: ec.EllipticCurvePublicKey, days: int
) -> x509.CertificateBuilder:
    now = _now()
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # a peer's clock a little behind
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
    )


def _usage(cert_sign: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not cert_sign,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _issue(files: TlsFiles, cert_path: Path, key_path: Path, common_name: str, names: Sequence[str]) -> None:
    """A certificate for ``names`` (none: a client's), good for both ends of a connection: a node
    serves it and presents it when it dials another node."""
    ca_key = serialization.load_pem_private_key(files.ca_key.read_bytes(), password=None)
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if names else [])
    builder = (
        _builder(subject, ca.subject, key.public_key(), CERT_DAYS)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]), critical=False)
    _write_key(key_path, key)
    write_private(cert_path, builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode())


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    write_private(path, pem.decode())


def _needs_issue(ca: x509.Certificate, cert_path: Path, key_path: Path, names: Sequence[str]) -> bool:
    """Whether a certificate is missing, unreadable, expiring soon, not signed by ``ca``, not the
    certificate of its key, or misses one of ``names``."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        cert.verify_directly_issued_by(ca)
    except (OSError, ValueError, TypeError, InvalidSignature):
        return True
    if key.public_key() != cert.public_key() or cert.not_valid_after_utc - RENEW_BEFORE < _now():
        return True
    if not names:
        return False
    try:
        covered = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return True
    have = {str(v) for v in covered.get_values_for_type(x509.IPAddress)}
    have |= set(covered.get_values_for_type(x509.DNSName))
    return not {str(_general_name(n).value) for n in names} <= have
