"""The catalogue group, shared by the gRPC catalogue (test_catalogue.py) and the HTTP one (test_openai_catalogue.py):
one scheduler + one rank with bearer tokens and small limits (tests/support/security_catalogue.py), and a standalone
rank for the step-stream cases. Starting them costs tens of seconds on a loaded machine, so the session starts them
once."""

from __future__ import annotations

import pytest

from mmcast_local.supervisor import LocalGroup
from tests.support import security_catalogue as cat
from tests.support.security_support import WorkerProcess, new_token, secret_file


@pytest.fixture(scope="session")
def catalogue_secrets(tmp_path_factory):
    """(folder, tenant token, worker token, second tenant's token)."""
    folder = tmp_path_factory.mktemp("catalogue-secrets")
    tenant, worker, other = new_token(), new_token(), new_token()
    secret_file(folder / "tokens.txt", f"# tenant token\ncatalogue {tenant}\ncatalogue-b {other}\n")
    secret_file(folder / "worker-token", worker + "\n")
    return folder, tenant, worker, other


@pytest.fixture(scope="session")
def catalogue_group(tiny_model_dir, catalogue_secrets, tmp_path_factory):
    """(LocalGroup, standalone WorkerProcess). Image URLs: remote fetches allowed for the hosts the SSRF cases
    name, so that the address rules, not the allow-list, refuse them."""
    folder = catalogue_secrets[0]
    logs = tmp_path_factory.mktemp("catalogue-logs")
    rank = WorkerProcess(
        tiny_model_dir,
        logs / "standalone-rank.log",
        [x for k, v in cat.WORKER_LIMITS.items() for x in (k, str(v))]
        + ["--shared-token-file", str(folder / "worker-token")],
    )
    limits = [x for k, v in cat.SCHEDULER_LIMITS.items() for x in (k, str(v))]
    group = LocalGroup(
        tiny_model_dir,
        1,
        "lazy",
        kv_blocks=256,
        log_dir=logs,
        scheduler_args=[
            *limits,
            "--auth-tokens-file",
            str(folder / "tokens.txt"),
            "--worker-token-file",
            str(folder / "worker-token"),
            "--allowed-media-domains",
            cat.MEDIA_DOMAINS,
            "--media-fetch-timeout-seconds",
            "3",
        ],
        worker_args=["--shared-token-file", str(folder / "worker-token")],
    )
    try:
        with group:
            rank.wait_ready()
            yield group, rank
    finally:
        rank.stop()
