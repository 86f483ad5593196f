"""TLS credentials from PEM files, for the client port, the worker ports and the scheduler's rank streams.

Secrets are read from files (Kubernetes mounts Secrets as files), once, at start-up. A setting that names a
missing or unreadable file fails the start with a message naming the flag; so does half a pair (a certificate
without its key).
"""

from __future__ import annotations

from pathlib import Path

import grpc


class TlsConfigError(ValueError):
    """A TLS setting that cannot work; the message names the flag and what to change."""


def read_pem(path: str, flag: str) -> bytes:
    """The file's bytes; ``TlsConfigError`` naming ``flag`` when it is missing, unreadable or not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"{flag}={path}: cannot read the file ({exc.strerror or exc})") from None
    if b"-----BEGIN " not in data:
        raise TlsConfigError(f"{flag}={path}: not a PEM file (no '-----BEGIN' line)")
    return data


def check_pair(cert_file: str, key_file: str, cert_flag: str, key_flag: str) -> None:
    """A certificate and its key come together or not at all."""
    if bool(cert_file) != bool(key_file):
        given, missing = (cert_flag, key_flag) if cert_file else (key_flag, cert_flag)
        raise TlsConfigError(f"{given} is set but {missing} is not: a TLS certificate needs its private key")


def server_credentials(cert_file: str, key_file: str, client_ca_file: str = "", *, prefix: str = "--") -> (
    grpc.ServerCredentials | None
):
    """Server credentials, or None (plaintext) when no certificate is configured.

    ``client_ca_file`` set: mutual TLS — a client must present a certificate signed by that CA, or the handshake
    fails (the client sees UNAVAILABLE).
    """
    cert_flag, key_flag, ca_flag = f"{prefix}tls-cert-file", f"{prefix}tls-key-file", f"{prefix}tls-client-ca-file"
    check_pair(cert_file, key_file, cert_flag, key_flag)
    if not cert_file:
        if client_ca_file:
            raise TlsConfigError(f"{ca_flag} needs {cert_flag} and {key_flag}: mutual TLS is TLS first")
        return None
    pair = (read_pem(key_file, key_flag), read_pem(cert_file, cert_flag))
    if client_ca_file:
        return grpc.ssl_server_credentials(
            [pair], root_certificates=read_pem(client_ca_file, ca_flag), require_client_auth=True
        )
    return grpc.ssl_server_credentials([pair])


def channel_credentials(ca_file: str, cert_file: str = "", key_file: str = "", *, prefix: str = "--") -> (
    grpc.ChannelCredentials | None
):
    """Channel credentials, or None (plaintext) when neither a CA nor a client certificate is configured.

    ``ca_file`` empty with a client certificate: the server is verified against the system's roots.
    """
    ca_flag, cert_flag, key_flag = f"{prefix}tls-ca-file", f"{prefix}tls-cert-file", f"{prefix}tls-key-file"
    check_pair(cert_file, key_file, cert_flag, key_flag)
    if not ca_file and not cert_file:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca_file, ca_flag) if ca_file else None,
        private_key=read_pem(key_file, key_flag) if key_file else None,
        certificate_chain=read_pem(cert_file, cert_flag) if cert_file else None,
    )
