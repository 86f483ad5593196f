"""The TLS settings of a server port, declared once for both binaries.

The scheduler's client port and a rank's Step port take ``--tls-cert-file``, ``--tls-key-file`` and
``--tls-client-ca-file`` (``MMCAST_TLS_*``) from these fields, filed under the same ``--help`` section, and check
them with ``check_server_tls`` when their config is built; only the help text saying which port and which peers
differs. The files' contents are read and checked when the port starts (common/tls.py).
"""

from __future__ import annotations

from typing import Any

from common.settings import setting

SECURITY = "security (docs/SECURITY.md; secrets are files)"  # the --help section of every secret and TLS setting


def cert_file(help: str) -> Any:
    """The ``tls_cert_file`` field: the port's PEM certificate (chain); ``help`` names the port."""
    return setting("", help, section=SECURITY, metavar="PEM")


def key_file() -> Any:
    """The ``tls_key_file`` field."""
    return setting("", "PEM private key of --tls-cert-file", section=SECURITY, metavar="PEM")


def client_ca_file(help: str) -> Any:
    """The ``tls_client_ca_file`` field: set, the port asks its peers for a certificate this CA signed."""
    return setting("", help, section=SECURITY, metavar="PEM")


def check_pair(config: Any, prefix: str = "") -> None:
    """``{prefix}tls_cert_file`` and ``{prefix}tls_key_file`` are set together or not at all."""
    cert, key = f"{prefix}tls_cert_file", f"{prefix}tls_key_file"
    if bool(getattr(config, cert)) != bool(getattr(config, key)):
        given, missing = (cert, key) if getattr(config, cert) else (key, cert)
        flag = "--" + missing.replace("_", "-")
        raise ValueError(f"{given} is set but {missing} is not: a TLS certificate needs its private key ({flag})")


def check_server_tls(config: Any) -> None:
    """The server port's certificate comes with its key, and a client CA (mutual TLS) only with both."""
    check_pair(config)
    if config.tls_client_ca_file and not config.tls_cert_file:
        raise ValueError(
            "tls_client_ca_file needs tls_cert_file and tls_key_file: mutual TLS is TLS first "
            "(--tls-cert-file, --tls-key-file)"
        )
