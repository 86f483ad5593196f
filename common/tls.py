"""TLS credentials from PEM files, for the client port, the worker ports and the scheduler's rank streams, re-read
when the files change.

Secrets are files (Kubernetes mounts Secrets as files). A setting that names a missing or unreadable file, a file
that is not PEM, or a key that does not belong to its certificate fails the start with a message naming the flag;
so does half a pair (a certificate without its key).

Rotation without a restart (cert-manager renews a Secret in place; the kubelet swaps the mounted folder's
``..data`` symlink, so every file changes at once; other tools rewrite the files themselves):

- **Servers** use ``grpc.dynamic_ssl_server_credentials``: gRPC asks ``ServerCertificateFiles.fetch`` before the
  TLS handshake of every new connection. It reads the files (through any symlinks) and compares their bytes with
  those last seen; only on a change does it check them (the key belongs to the certificate, the CA bundle holds a
  certificate) and hand gRPC the new key, certificate and client CA bundle, which that handshake already uses.
  Connections open before keep the session they negotiated (TLS does not re-handshake an HTTP/2 connection; an
  expired certificate does not end one) until they close.
- **The scheduler's channels to the ranks** (``ChannelCertificateFiles``) re-read the CA, client certificate and
  key when the files changed each time a channel is made, i.e. when the scheduler (re)connects the group; the rank
  streams already open keep theirs.
- A half-written rotation (a certificate whose key has not arrived, a truncated file) is refused, logged once and
  the previous files stay in use until the files change again; nothing fails at that moment.
"""

from __future__ import annotations

import logging
import ssl
import threading
from pathlib import Path

import grpc

log = logging.getLogger("mmcast.tls")


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


class _PemFiles:
    """A certificate, its key and a CA bundle (each optional) read together and checked to fit each other."""

    def __init__(self, cert: tuple[str, str], key: tuple[str, str], ca: tuple[str, str]) -> None:
        self._flags = {path: flag for path, flag in (ca, key, cert) if path}  # one file for both: the cert's flag
        self.cert_file, self.key_file, self.ca_file = cert[0], key[0], ca[0]
        self._lock = threading.Lock()
        self.seen = self._snapshot()  # the bytes last judged, good or bad
        # (cert, key, ca) in use, replaced as one tuple so a reader never mixes two rotations.
        self.current = self._check(self.seen)  # TlsConfigError at start: the process does not start
        self.reloads = 0  # how many times changed files were taken into use

    cert = property(lambda self: self.current[0])
    key = property(lambda self: self.current[1])
    ca = property(lambda self: self.current[2])

    def _snapshot(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """The files' bytes now. Bytes rather than mtimes: a rewrite within one timestamp tick keeps the mtime
        (and often the size); a few KB read per new connection is small beside the handshake's own work."""
        return tuple(
            read_pem(path, self._flags[path]) if path else None
            for path in (self.cert_file, self.key_file, self.ca_file)
        )  # type: ignore[return-value]

    def _check(self, snapshot: tuple[bytes | None, bytes | None, bytes | None]) -> tuple:
        """``snapshot`` if its certificate and key belong together and its CA bundle holds a certificate."""
        cert, key, ca = snapshot
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        if cert is not None:
            try:  # from the paths, as OpenSSL reads files; a change meanwhile shows as different bytes below
                context.load_cert_chain(self.cert_file, self.key_file, password=lambda: "")
            except (ssl.SSLError, OSError) as exc:
                flags = self._flags
                names = f"{flags[self.cert_file]}={self.cert_file} and {flags[self.key_file]}={self.key_file}"
                raise TlsConfigError(f"{names}: not a certificate and its unencrypted private key ({exc})") from None
            if self._snapshot()[:2] != (cert, key):
                raise TlsConfigError(f"{self._flags[self.cert_file]}={self.cert_file}: changed while being read")
        if ca is not None:
            try:
                context.load_verify_locations(cadata=ca.decode("ascii", "replace"))
            except ssl.SSLError as exc:
                flag = self._flags[self.ca_file]
                raise TlsConfigError(f"{flag}={self.ca_file}: no CA certificate in it ({exc})") from None
        return snapshot

    def refresh(self) -> tuple | None:
        """Re-read the files; the new (cert, key, ca) when changed contents were checked and taken into use.

        Never raises: files that cannot be used (mid-rotation, missing for a moment) are logged once per content
        and the previous contents stay.
        """
        try:
            snapshot = self._snapshot()
        except TlsConfigError:  # missing or cut short while being replaced: look again on the next connection
            return None
        if snapshot == self.seen:
            return None
        with self._lock:
            if snapshot == self.seen:  # another thread judged it meanwhile
                return None
            self.seen = snapshot
            try:
                self._check(snapshot)
            except TlsConfigError as exc:
                log.warning("TLS files changed but cannot be used; the previous ones stay in use: %s", exc)
                return None
            if snapshot == self.current:  # back to what is in use
                return None
            self.current = snapshot
            self.reloads += 1
        log.info("TLS files reloaded", extra={"files": ",".join(self._flags), "reloads": self.reloads})
        return snapshot


class ServerCertificateFiles:
    """The key, certificate and optional client-CA files of one server port, for
    ``grpc.dynamic_ssl_server_credentials``."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str = "", *, prefix: str = "--") -> None:
        self.files = _PemFiles(
            (cert_file, f"{prefix}tls-cert-file"),
            (key_file, f"{prefix}tls-key-file"),
            (client_ca_file, f"{prefix}tls-client-ca-file"),
        )
        self.mutual = bool(client_ca_file)

    @staticmethod
    def configuration(files: tuple) -> grpc.ServerCertificateConfiguration:
        cert, key, ca = files
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC calls this before every new connection's handshake: new files, or None for "keep the current"."""
        changed = self.files.refresh()
        return None if changed is None else self.configuration(changed)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.configuration(self.files.current), self.fetch, require_client_authentication=self.mutual
        )


def server_credentials(
    cert_file: str, key_file: str, client_ca_file: str = "", *, prefix: str = "--"
) -> grpc.ServerCredentials | None:
    """Server credentials that follow the files (module docstring), or None (plaintext) when no certificate is set.

    ``client_ca_file`` set: mutual TLS — a client must present a certificate signed by that CA, or the handshake
    fails (the client sees UNAVAILABLE).
    """
    if not _server_tls_on(cert_file, key_file, client_ca_file, prefix):
        return None
    return ServerCertificateFiles(cert_file, key_file, client_ca_file, prefix=prefix).credentials()


def _server_tls_on(cert_file: str, key_file: str, client_ca_file: str, prefix: str) -> bool:
    """Whether a server port's files turn TLS on; ``TlsConfigError`` for half a pair or a client CA without TLS."""
    cert_flag, key_flag, ca_flag = f"{prefix}tls-cert-file", f"{prefix}tls-key-file", f"{prefix}tls-client-ca-file"
    check_pair(cert_file, key_file, cert_flag, key_flag)
    if not cert_file and client_ca_file:
        raise TlsConfigError(f"{ca_flag} needs {cert_flag} and {key_flag}: mutual TLS is TLS first")
    return bool(cert_file)


class HttpsContext:
    """The ``ssl.SSLContext`` of an HTTP server port (the OpenAI API) that follows its files like the gRPC ports do.

    ``refresh()``, called by the server every ``HTTPS_REFRESH_SECONDS``, loads changed, checked files into the same
    context, which every later handshake uses (OpenSSL copies a context's certificate into each new connection);
    connections already open keep theirs. A rotated client CA is added to the trusted ones: a CA taken out of the
    file stays trusted on this port until the process restarts.
    """

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str = "", *, prefix: str = "--") -> None:
        self.files = _PemFiles(
            (cert_file, f"{prefix}tls-cert-file"),
            (key_file, f"{prefix}tls-key-file"),
            (client_ca_file, f"{prefix}tls-client-ca-file"),
        )
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        if client_ca_file:
            self.context.verify_mode = ssl.CERT_REQUIRED
        self._load(self.files.current)

    def _load(self, files: tuple) -> None:
        _, _, ca = files
        self.context.load_cert_chain(self.files.cert_file, self.files.key_file, password=lambda: "")
        if ca is not None:
            self.context.load_verify_locations(cadata=ca.decode("ascii", "replace"))

    def refresh(self) -> bool:
        """True when changed files were taken into use. Never raises (see ``_PemFiles.refresh``)."""
        changed = self.files.refresh()
        if changed is None:
            return False
        try:
            self._load(changed)
        except (ssl.SSLError, OSError) as exc:  # changed again between the check and the load: next time
            log.warning("TLS files changed while being loaded for the HTTP port; retrying later: %s", exc)
            return False
        return True


HTTPS_REFRESH_SECONDS = 2.0  # how often an HTTP port looks for rotated TLS files


def https_context(
    cert_file: str, key_file: str, client_ca_file: str = "", *, prefix: str = "--"
) -> HttpsContext | None:
    """The HTTP port's TLS (the same files and rules as ``server_credentials``), or None (plaintext)."""
    if not _server_tls_on(cert_file, key_file, client_ca_file, prefix):
        return None
    return HttpsContext(cert_file, key_file, client_ca_file, prefix=prefix)


class ChannelCertificateFiles:
    """The CA and optional client certificate/key a channel presents; ``credentials()`` for each new channel."""

    def __init__(self, ca_file: str, cert_file: str = "", key_file: str = "", *, prefix: str = "--") -> None:
        self.files = _PemFiles(
            (cert_file, f"{prefix}tls-cert-file"),
            (key_file, f"{prefix}tls-key-file"),
            (ca_file, f"{prefix}tls-ca-file"),
        )
        self._credentials = self._build(self.files.current)

    @staticmethod
    def _build(files: tuple) -> grpc.ChannelCredentials:
        cert, key, ca = files
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def credentials(self) -> grpc.ChannelCredentials:
        """Credentials from the files as they are now (rebuilt only when they changed)."""
        changed = self.files.refresh()
        if changed is not None:
            self._credentials = self._build(changed)
        return self._credentials


def channel_files(
    ca_file: str, cert_file: str = "", key_file: str = "", *, prefix: str = "--"
) -> ChannelCertificateFiles | None:
    """The files a channel's credentials come from, or None (plaintext) when neither a CA nor a client certificate
    is configured. ``ca_file`` empty with a client certificate: the server is verified against the system's roots."""
    check_pair(cert_file, key_file, f"{prefix}tls-cert-file", f"{prefix}tls-key-file")
    if not ca_file and not cert_file:
        return None
    return ChannelCertificateFiles(ca_file, cert_file, key_file, prefix=prefix)


def channel_credentials(
    ca_file: str, cert_file: str = "", key_file: str = "", *, prefix: str = "--"
) -> grpc.ChannelCredentials | None:
    """Channel credentials from the files as they are now, or None (plaintext); see ``channel_files``."""
    files = channel_files(ca_file, cert_file, key_file, prefix=prefix)
    return None if files is None else files.credentials()
