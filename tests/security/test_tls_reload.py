"""TLS files reloaded on change, without a restart (common/tls.py).

Units drive the certificate fetcher gRPC calls before each handshake through the two ways files rotate — the
kubelet's symlink swap of a mounted Secret and a rewrite in place — and through a half-finished rotation. The
process test starts a real ``mmcast-worker`` serving mutual TLS from a Secret-like folder, rotates its certificate
twice (same CA, then a new CA) and reads the certificate each new handshake presents; the process never restarts,
and a connection opened before the rotations keeps working.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import tls
from tests.support.pki import Issuer, Leaf, new_ca, serial_of
from tests.support.security_support import WorkerProcess, new_token, secret_file, wait_for


class SecretMount:
    """A folder laid out as the kubelet mounts a Secret: ``name -> ..data/name``, ``..data -> ..<version>``.

    ``publish`` writes a new version folder and swaps ``..data`` with one rename, as the kubelet does, so every file
    changes at once; ``rewrite`` writes one file of the current version in place (a tool that edits files).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.version = 0
        root.mkdir(parents=True)

    def path(self, name: str) -> str:
        return str(self.root / name)

    def publish(self, files: dict[str, bytes]) -> None:
        self.version += 1
        folder = self.root / f"..v{self.version}"
        folder.mkdir()
        for name, data in files.items():
            (folder / name).write_bytes(data)
        os.symlink(folder.name, self.root / "..data_tmp")
        os.replace(self.root / "..data_tmp", self.root / "..data")
        for name in files:
            if not (self.root / name).is_symlink():
                os.symlink(f"..data/{name}", self.root / name)

    def rewrite(self, name: str, data: bytes) -> None:
        with open(self.root / name, "wb") as fh:  # through the symlinks: same inode, new content and mtime
            fh.write(data)


def leaf_files(leaf: Leaf, ca: Issuer) -> dict[str, bytes]:
    return {"tls.crt": leaf.cert_bytes, "tls.key": leaf.key_bytes, "ca.crt": ca.path.read_bytes()}


@pytest.fixture
def pki(tmp_path):
    ca = new_ca(tmp_path / "pki", "ca")
    return ca, ca.server(tmp_path / "pki", "server-a"), ca.server(tmp_path / "pki", "server-b")


def test_a_symlink_swap_is_taken_at_the_next_handshake_and_only_then(tmp_path, pki):
    ca, a, b = pki
    mount = SecretMount(tmp_path / "secret")
    mount.publish(leaf_files(a, ca))
    files = tls.ServerCertificateFiles(mount.path("tls.crt"), mount.path("tls.key"), mount.path("ca.crt"))
    assert files.fetch() is None and files.fetch() is None  # unchanged: gRPC keeps what it has
    mount.publish(leaf_files(b, ca))
    assert isinstance(files.fetch(), grpc.ServerCertificateConfiguration)
    assert serial_of(files.files.cert) == serial_of(b.cert_bytes) and files.files.key == b.key_bytes
    assert files.fetch() is None and files.files.reloads == 1


def test_a_rewrite_in_place_is_taken_and_a_half_rotation_keeps_the_old_pair(tmp_path, pki, caplog):
    ca, a, b = pki
    mount = SecretMount(tmp_path / "secret")
    mount.publish(leaf_files(a, ca))
    files = tls.ServerCertificateFiles(mount.path("tls.crt"), mount.path("tls.key"))
    mount.rewrite("tls.crt", b.cert_bytes)  # the new certificate, its key not yet written
    with caplog.at_level(logging.WARNING, logger="mmcast.tls"):
        assert files.fetch() is None
        assert files.fetch() is None  # judged once: no warning per connection
    warnings = [r.getMessage() for r in caplog.records if r.name == "mmcast.tls"]
    assert len(warnings) == 1 and "--tls-cert-file" in warnings[0] and "--tls-key-file" in warnings[0]
    assert files.files.cert == a.cert_bytes  # the previous pair stays in use
    mount.rewrite("tls.key", b.key_bytes)
    assert files.fetch() is not None and files.files.cert == b.cert_bytes and files.files.key == b.key_bytes


def test_a_file_missing_for_a_moment_changes_nothing(tmp_path, pki):
    ca, a, _ = pki
    folder = tmp_path / "plain"
    folder.mkdir()
    cert, key = folder / "tls.crt", folder / "tls.key"
    cert.write_bytes(a.cert_bytes)
    key.write_bytes(a.key_bytes)
    files = tls.ServerCertificateFiles(str(cert), str(key))
    cert.unlink()
    assert files.fetch() is None and files.files.cert == a.cert_bytes
    cert.write_bytes(a.cert_bytes)  # the same bytes back (a new inode): nothing to reload
    assert files.fetch() is None and files.files.reloads == 0


def test_a_key_of_another_certificate_stops_the_start_naming_both_flags(pki):
    _, a, b = pki
    with pytest.raises(tls.TlsConfigError, match=r"--tls-cert-file=.* and --tls-key-file=.*: not a certificate and"):
        tls.server_credentials(str(a.cert), str(b.key))
    with pytest.raises(tls.TlsConfigError, match=r"--worker-tls-cert-file=.*--worker-tls-key-file"):
        tls.channel_credentials(str(a.cert), str(a.cert), str(b.key), prefix="--worker-")


def test_channel_credentials_follow_the_files_for_each_new_channel(tmp_path, pki):
    ca, _, _ = pki
    mount = SecretMount(tmp_path / "secret")
    client_a, client_b = ca.client(tmp_path / "pki", "client-a"), ca.client(tmp_path / "pki", "client-b")
    mount.publish(leaf_files(client_a, ca))
    files = tls.channel_files(mount.path("ca.crt"), mount.path("tls.crt"), mount.path("tls.key"), prefix="--worker-")
    first = files.credentials()
    assert files.credentials() is first  # unchanged files: the same credentials object
    mount.publish(leaf_files(client_b, ca))
    second = files.credentials()
    assert second is not first and files.files.cert == client_b.cert_bytes


# --- a real rank ------------------------------------------------------------------------------------------------
def handshake_serial(port: int, trust: Path, client: Leaf) -> int:
    """The serial of the certificate a new TLS connection to the port is served."""
    context = ssl.create_default_context(cafile=str(trust))
    context.load_cert_chain(str(client.cert), str(client.key))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as conn:
            return serial_of(conn.getpeercert(binary_form=True))


def check(channel: grpc.Channel) -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return reply.status


@pytest.mark.slow
def test_a_rank_serves_rotated_certificates_without_a_restart(tiny_model_dir, tmp_path, pki):
    ca, a, b = pki
    new = new_ca(tmp_path / "pki", "ca-next")
    c = new.server(tmp_path / "pki", "server-c")
    client = ca.client(tmp_path / "pki", "client")
    mount = SecretMount(tmp_path / "secret")
    mount.publish(leaf_files(a, ca))
    token = secret_file(tmp_path / "token", new_token())
    rank = WorkerProcess(
        tiny_model_dir,
        tmp_path / "rank.log",
        [
            "--tls-cert-file",
            mount.path("tls.crt"),
            "--tls-key-file",
            mount.path("tls.key"),
            "--tls-client-ca-file",
            mount.path("ca.crt"),
            "--shared-token-file",
            str(token),
        ],
    )
    old = None
    try:
        wait_for(lambda: _serial_or_none(rank, ca.path, client), 60, f"rank TLS port:\n{rank.log_tail()}")
        pid = rank.process.pid
        assert handshake_serial(rank.port, ca.path, client) == serial_of(a.cert_bytes)
        credentials = grpc.ssl_channel_credentials(ca.path.read_bytes(), client.key_bytes, client.cert_bytes)
        old = grpc.secure_channel(rank.target, credentials)
        assert check(old) == health_pb2.HealthCheckResponse.SERVING

        mount.publish(leaf_files(b, ca))  # cert-manager renewal: same CA, new key and serial, a symlink swap
        assert handshake_serial(rank.port, ca.path, client) == serial_of(b.cert_bytes)

        mount.rewrite("tls.key", c.key_bytes)  # a new CA's certificate, written in place, key first
        mount.rewrite("tls.crt", c.cert_bytes)
        assert handshake_serial(rank.port, new.path, client) == serial_of(c.cert_bytes)
        with pytest.raises(ssl.SSLCertVerificationError):  # a client trusting only the old CA now fails
            handshake_serial(rank.port, ca.path, client)
        # The connection opened under certificate A keeps its TLS session: it still answers, although a new
        # connection trusting the old CA alone could no longer be made.
        assert check(old) == health_pb2.HealthCheckResponse.SERVING
        assert rank.process.poll() is None and rank.process.pid == pid
        records = [json.loads(line) for line in rank.log_tail(1_000_000).splitlines() if line.startswith("{")]
        assert [r["msg"] for r in records].count("TLS files reloaded") == 2
    finally:
        if old is not None:
            old.close()
        rank.process.kill()  # SIGTERM waits for the model load this test does not need
        rank.process.wait(10)


def _serial_or_none(rank: WorkerProcess, trust: Path, client: Leaf) -> int | None:
    if rank.process.poll() is not None:
        raise AssertionError(f"the rank exited ({rank.process.returncode}): {rank.log_tail()}")
    try:
        return handshake_serial(rank.port, trust, client)
    except OSError:
        return None


def _presented_serial(context, ca_path: str) -> int:
    """The serial of the certificate a server with ``context`` presents to a new TLS connection (in process)."""
    import socket
    import ssl
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            with context.wrap_socket(conn, server_side=True):
                pass
        except (ssl.SSLError, OSError):
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = ssl.create_default_context(cafile=ca_path)
    try:
        with (
            socket.create_connection(("127.0.0.1", port)) as raw,
            client.wrap_socket(raw, server_hostname="localhost") as tls_sock,
        ):
            return serial_of(tls_sock.getpeercert(binary_form=True))
    finally:
        thread.join(5)
        listener.close()


def test_the_http_ports_context_takes_a_rotation_at_its_next_refresh(tmp_path, pki):
    """The HTTP API's port (``HttpsContext``): a symlink swap changes nothing until ``refresh()``, after which every
    new handshake presents the new certificate; a half rotation keeps the old one."""
    ca, a, b = pki
    mount = SecretMount(tmp_path / "secret")
    mount.publish(leaf_files(a, ca))
    https = tls.https_context(mount.path("tls.crt"), mount.path("tls.key"))
    assert _presented_serial(https.context, str(ca.path)) == serial_of(a.cert_bytes)
    mount.publish(leaf_files(b, ca))
    assert _presented_serial(https.context, str(ca.path)) == serial_of(a.cert_bytes)  # not refreshed yet
    assert https.refresh() is True and https.refresh() is False
    assert _presented_serial(https.context, str(ca.path)) == serial_of(b.cert_bytes)
    mount.rewrite("tls.crt", a.cert_bytes)  # a certificate without its key: refused, b stays
    assert https.refresh() is False
    assert _presented_serial(https.context, str(ca.path)) == serial_of(b.cert_bytes)
