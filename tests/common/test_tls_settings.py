"""The server port's TLS settings, declared once (common/tls_settings.py): both binaries take the same flags and
variables from them and refuse the same half-configurations."""

from __future__ import annotations

import dataclasses

import pytest

from common import settings
from scheduler_svc.config import SchedulerConfig
from worker_svc.config import WorkerConfig

_TLS = ("tls_cert_file", "tls_key_file", "tls_client_ca_file")


def _worker(**tls):
    return WorkerConfig(model="m", insecure_allow_unauthenticated=True, **tls)


def test_both_binaries_declare_the_same_tls_settings():
    fields = {cls: {f.name: f for f in dataclasses.fields(cls)} for cls in (SchedulerConfig, WorkerConfig)}
    for name in _TLS:
        sched, worker = fields[SchedulerConfig][name], fields[WorkerConfig][name]
        assert settings.flag_of(sched) == settings.flag_of(worker) == "--" + name.replace("_", "-")
        assert settings.env_of(sched) == settings.env_of(worker) == "MMCAST_" + name.upper()
        assert sched.default == worker.default == ""
        assert {k: v for k, v in sched.metadata.items() if k != "help"} == {
            k: v for k, v in worker.metadata.items() if k != "help"
        }


@pytest.mark.parametrize("build", [SchedulerConfig, _worker])
def test_half_a_pair_or_a_client_ca_alone_is_refused(build, tmp_path):
    pem = tmp_path / "c.pem"
    pem.write_text("x")
    with pytest.raises(ValueError, match=r"tls_key_file is set but tls_cert_file is not.*\(--tls-cert-file\)"):
        build(tls_key_file=str(pem))
    with pytest.raises(ValueError, match="tls_client_ca_file needs tls_cert_file and tls_key_file"):
        build(tls_client_ca_file=str(pem))
    assert build(tls_cert_file=str(pem), tls_key_file=str(pem), tls_client_ca_file=str(pem)).tls_client_ca_file


def test_the_scheduler_checks_its_channel_pair_too(tmp_path):
    pem = tmp_path / "c.pem"
    pem.write_text("x")
    with pytest.raises(ValueError, match=r"worker_tls_cert_file is set but worker_tls_key_file is not"):
        SchedulerConfig(worker_tls_cert_file=str(pem))
