"""Security building blocks without processes: token files, the bearer check, TLS settings, tenant scoping, and
docs/SECURITY.md kept in step with the catalogue."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from common import tls
from common.auth import TokenFileError, TokenTable, parse_tokens, read_token_file
from common.errors import InvalidArgument, NotFound
from common.hashing import item_identifier
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.doors import request_parsing
from scheduler_svc.engine.tenancy import scoped_cache_salt, scoped_request_id
from scheduler_svc.engine.upload_store import UploadStore

ROOT = Path(__file__).resolve().parents[2]
A, B = "a" * 20, "b" * 24


def bearer(token):
    return (("authorization", f"Bearer {token}"),)


def test_token_files_in_both_forms():
    text = parse_tokens(f"# comment\n\nalpha {A}\nalpha {B}\n")
    as_json = parse_tokens(json.dumps({A: "alpha", B: "alpha"}))
    assert text == as_json and set(text.values()) == {"alpha"}  # two tokens, one tenant (rotation)
    assert A.encode() not in b"".join(text)  # only digests are kept


@pytest.mark.parametrize(
    "content, words",
    [
        ("alpha short", ("16",)),
        (f"alpha {A} extra", ("expected '<tenant> <token>'", ":1")),
        (f"al/pha {A}", ("tenant name",)),
        (json.dumps({A: "alpha\n"}), ("tenant name",)),
        (json.dumps({A + "\n": "alpha"}), ("printable ASCII",)),
        (f"alpha {A}\nbeta {A}", ("same token", "alpha", "beta")),
        ("# nothing\n", ("no tokens",)),
        ("{not json", ("not valid JSON",)),
        (json.dumps({A: 3}), ("tenant name (a string)",)),
    ],
)
def test_bad_token_files_name_the_problem(content, words):
    with pytest.raises(TokenFileError) as caught:
        parse_tokens(content, "tokens.txt")
    for word in words:
        assert word in str(caught.value), str(caught.value)


def test_authenticate():
    table = TokenTable.single(A, "scheduler")
    assert table.authenticate(bearer(A)) == ("scheduler", "")
    assert table.authenticate((("authorization", f"bearer   {A}  "),))[0] == "scheduler"
    assert table.authenticate((("authorization", f"Bearer {A}".encode()),))[0] == "scheduler"
    for metadata, word in [
        ((), "missing"),
        (bearer(B), "not valid"),
        ((("authorization", f"Basic {A}"),), "Bearer"),
        ((("authorization", "Bearer "),), "Bearer"),
        (bearer(A) + bearer(A), "more than one"),
    ]:
        tenant, problem = table.authenticate(metadata)
        assert tenant is None and word in problem, (metadata, problem)


def test_token_file_is_reloaded_when_it_changes_and_a_broken_one_is_ignored(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"alpha {A}\n")
    table = TokenTable(str(path), reload_seconds=0)
    assert table.tenant(A) == "alpha" and table.tenant(B) is None
    path.write_text(f"beta {B}\n")
    os.utime(path, ns=(1, 2))  # a different mtime even on coarse clocks
    assert table.tenant(B) == "beta" and table.tenant(A) is None  # rotated out
    path.write_text("garbage")
    os.utime(path, ns=(3, 4))
    assert table.tenant(B) == "beta"  # the last good table stays


def test_shared_token_file(tmp_path):
    (tmp_path / "t").write_text(f"  {A}\n")
    assert read_token_file(str(tmp_path / "t"), "--shared-token-file") == A
    (tmp_path / "short").write_text("abc")
    with pytest.raises(TokenFileError, match="--shared-token-file"):
        read_token_file(str(tmp_path / "short"), "--shared-token-file")


def test_tls_settings_are_checked(tmp_path):
    pem, junk = tmp_path / "c.pem", tmp_path / "junk"
    pem.write_text("-----BEGIN CERTIFICATE-----\nxx\n-----END CERTIFICATE-----\n")
    junk.write_text("not pem")
    with pytest.raises(tls.TlsConfigError, match="--tls-key-file"):
        tls.server_credentials(str(pem), "")
    with pytest.raises(tls.TlsConfigError, match="mutual TLS is TLS first"):
        tls.server_credentials("", "", str(pem))
    with pytest.raises(tls.TlsConfigError, match="--tls-cert-file=.*not a PEM"):
        tls.server_credentials(str(junk), str(pem))
    with pytest.raises(tls.TlsConfigError, match="--worker-tls-ca-file=.*cannot read"):
        tls.channel_credentials(str(tmp_path / "missing"), prefix="--worker-")
    assert tls.server_credentials("", "") is None and tls.channel_credentials("") is None


def test_scheduler_config_checks_secret_files(tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    with pytest.raises(ValueError, match="tls_cert_file is set but tls_key_file is not"):
        SchedulerConfig(tls_cert_file=str(cert))
    with pytest.raises(ValueError, match="tls_client_ca_file needs tls_cert_file"):
        SchedulerConfig(tls_client_ca_file=str(cert))
    with pytest.raises(ValueError, match=r"auth_tokens_file=.*no such file \(--auth-tokens-file\)"):
        SchedulerConfig(auth_tokens_file=str(tmp_path / "nope"))
    from scheduler_svc.main import config_from

    config = config_from([], environ={"MMCAST_WORKER_TOKEN_FILE": str(cert), "MMCAST_HEALTH_PORT": "8081"})
    assert config.worker_token_file == str(cert) and config.health_port == 8081


def test_worker_config_checks_secret_files(tmp_path):
    from worker_svc.config import load_config

    with pytest.raises(ValueError, match="tls_key_file"):
        load_config(["--model", "m", "--tls-key-file", __file__], environ={})
    with pytest.raises(ValueError, match="shared_token_file.*an existing file"):
        load_config(["--model", "m"], environ={"MMCAST_SHARED_TOKEN_FILE": str(tmp_path / "none")})


def test_tenant_scoping_helpers():
    assert scoped_request_id("", "r1") == "r1" and scoped_request_id("alpha", "a/b") == "alpha/a/b"
    assert scoped_cache_salt("", "") is None and scoped_cache_salt("", "s") == "s"
    assert scoped_cache_salt("alpha", "") != scoped_cache_salt("beta", "") != scoped_cache_salt("alpha", "x")
    settings = {"max_pixels": 100}
    plain = item_identifier(b"img", settings)
    assert plain == item_identifier(b"img", settings, scope="")  # no tenant: the identifiers of before
    assert (
        len({plain, item_identifier(b"img", settings, scope="alpha"), item_identifier(b"img", settings, scope="beta")})
        == 3
    )


def test_upload_store_is_per_tenant():
    store = UploadStore(1 << 20)
    sha, already = store.put(b"bytes", tenant="alpha")
    assert not already and store.put(b"bytes", tenant="beta") == (sha, False)  # beta learns nothing of alpha's
    assert store.get(sha, tenant="alpha") == b"bytes"
    with pytest.raises(NotFound) as other:
        store.get(sha, tenant="gamma")
    with pytest.raises(NotFound) as unknown:
        store.get("0" * 64, tenant="gamma")
    assert str(other.value).replace(sha, "H") == str(unknown.value).replace("0" * 64, "H")


def test_ids_with_a_trailing_newline_are_refused():
    with pytest.raises(InvalidArgument, match="request_id may contain only"):
        request_parsing.check_request_id("abc\n")
    from mmcast.v1 import generation_pb2 as pb

    msg = pb.ChatMessage(
        role=pb.ROLE_USER, content=[pb.ContentPart(image=pb.ImageInput(uploaded_sha256="0" * 64 + "\n"))]
    )
    with pytest.raises(InvalidArgument, match="64 lowercase hex"):
        request_parsing.parse_messages([msg], max_images=4)


def test_security_doc_lists_every_catalogue_case():
    from tests.support.security_catalogue import CASES

    doc = (ROOT / "docs" / "SECURITY.md").read_text()
    table = doc.split("<!-- cases:begin -->")[1].split("<!-- cases:end -->")[0]
    listed = re.findall(r"\| `([a-z0-9-]+)` \|", table)
    assert listed == [c.id for c in CASES], "docs/SECURITY.md is stale: regenerate it (scripts/security_doc.py)"
    assert "**UNEXPECTED**" not in table and "not run" not in table
