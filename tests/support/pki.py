"""Throwaway certificates for TLS tests, generated at test time (no private key is ever committed).

``make_pki(folder)`` writes PEM files for two unrelated CAs — ``ca`` (trusted by the servers and clients under
test) and ``rogue`` (trusted by nobody) — and leaf certificates: ``server`` (SAN localhost, 127.0.0.1, ::1),
``client`` (signed by ``ca``), ``rogue_server`` and ``rogue_client`` (signed by ``rogue``), and ``wrong_name``
(signed by ``ca`` for another host name).
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclasses.dataclass(frozen=True)
class Leaf:
    cert: Path
    key: Path

    @property
    def cert_bytes(self) -> bytes:
        return self.cert.read_bytes()

    @property
    def key_bytes(self) -> bytes:
        return self.key.read_bytes()


@dataclasses.dataclass(frozen=True)
class Pki:
    ca: Path  # trusted CA certificate
    rogue_ca: Path  # a CA nobody trusts
    server: Leaf  # localhost / 127.0.0.1 / ::1, signed by ca
    client: Leaf  # client certificate signed by ca
    rogue_server: Leaf  # localhost, signed by the rogue CA
    rogue_client: Leaf  # client certificate signed by the rogue CA
    wrong_name: Leaf  # server certificate signed by ca for "not-this-host.example"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _ca(common_name: str, folder: Path, stem: str):
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    path = folder / f"{stem}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key, path


def _leaf(folder: Path, stem: str, common_name: str, issuer, *, hosts=(), client: bool = False) -> Leaf:
    ca_cert, ca_key = issuer
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH]),
            critical=False,
        )
    )
    if hosts:
        names = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    cert_path, key_path = folder / f"{stem}.pem", folder / f"{stem}.key"
    cert_path.write_bytes(
        cert.public_bytes(serialization.Encoding.PEM) + ca_cert.public_bytes(serialization.Encoding.PEM)
    )
    _write_key(key, key_path)
    return Leaf(cert_path, key_path)


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key, ca_path = _ca("mmcast test CA", folder, "ca")
    rogue_cert, rogue_key, rogue_path = _ca("mmcast rogue CA", folder, "rogue-ca")
    local = ("localhost", "127.0.0.1", "::1")
    return Pki(
        ca=ca_path,
        rogue_ca=rogue_path,
        server=_leaf(folder, "server", "mmcast-test-server", (ca_cert, ca_key), hosts=local),
        client=_leaf(folder, "client", "mmcast-test-client", (ca_cert, ca_key), client=True),
        rogue_server=_leaf(folder, "rogue-server", "mmcast-rogue-server", (rogue_cert, rogue_key), hosts=local),
        rogue_client=_leaf(folder, "rogue-client", "mmcast-rogue-client", (rogue_cert, rogue_key), client=True),
        wrong_name=_leaf(folder, "wrong-name", "not-this-host", (ca_cert, ca_key), hosts=("not-this-host.example",)),
    )


@dataclasses.dataclass(frozen=True)
class Issuer:
    """A CA that can sign more leaves (certificate rotation tests)."""

    path: Path  # its certificate, PEM
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def server(self, folder: Path, stem: str) -> Leaf:
        """A new server certificate (fresh key and serial) for localhost / 127.0.0.1 / ::1."""
        folder.mkdir(parents=True, exist_ok=True)
        local = ("localhost", "127.0.0.1", "::1")
        return _leaf(folder, stem, f"mmcast-test-{stem}", (self.cert, self.key), hosts=local)

    def client(self, folder: Path, stem: str) -> Leaf:
        folder.mkdir(parents=True, exist_ok=True)
        return _leaf(folder, stem, f"mmcast-test-{stem}", (self.cert, self.key), client=True)


def new_ca(folder: Path, stem: str, common_name: str | None = None) -> Issuer:
    folder.mkdir(parents=True, exist_ok=True)
    cert, key, path = _ca(common_name or f"mmcast test {stem}", folder, stem)
    return Issuer(path, cert, key)


def serial_of(pem_or_der: bytes) -> int:
    """The serial number of the first certificate in a PEM chain or of a DER certificate."""
    if pem_or_der.lstrip().startswith(b"-----BEGIN"):
        return x509.load_pem_x509_certificate(pem_or_der).serial_number
    return x509.load_der_x509_certificate(pem_or_der).serial_number
