"""Configuration of the scheduler process: one dataclass, validated on construction, and its command line.
Its fields are declared in three parts by role (config_limits.py, config_engine.py, config_service.py) and checked
here together.

Every field is a ``common.settings.setting`` (help text, ``--help`` section, range, choices), from which
``build_parser``/``load_config`` generate the flags (``--kv-blocks``) and environment variables
(``MMCAST_KV_BLOCKS``): a flag wins over its variable, a variable over the default, choices in any case — the same
mechanism as the worker's (worker_svc/config.py). A value of 0 for a cache budget means "take it from the ranks'
handshake" (the minimum over the group); see ``SchedulerConfig.effective`` for how configured and handshake values
combine.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
from collections.abc import Mapping, Sequence

from common import local_stream, settings, tls_settings
from scheduler_svc.config_engine import ENCODER_PLACEMENTS, PAYLOAD_ENCODINGS, TRANSFER_MODES, EngineSettings
from scheduler_svc.config_limits import DEFAULT_IMAGE_FORMATS, PROMPT_BYTES_PER_TOKEN, RequestLimits
from scheduler_svc.config_service import ServiceSettings
from scheduler_svc.media_domains import normalize_domain

__all__ = [
    "DEFAULT_IMAGE_FORMATS",
    "ENCODER_PLACEMENTS",
    "PAYLOAD_ENCODINGS",
    "PROMPT_BYTES_PER_TOKEN",
    "TRANSFER_MODES",
    "SchedulerConfig",
    "build_parser",
    "context_length",
    "load_config",
]

PROG = "mmcast-scheduler"
DESCRIPTION = "mmcast scheduler: serves mmcast.v1.GenerationService and drives one tensor-parallel worker group."


def context_length(*limits: int) -> int:
    """The context length requests must fit: the smallest of the known limits (--max-model-len, the model config's
    max_position_embeddings, what the ranks reported); 0 (unknown) is no limit, and 0 is returned when none is known."""
    known = [v for v in limits if v]
    return min(known) if known else 0


@dataclasses.dataclass
class SchedulerConfig(ServiceSettings, EngineSettings, RequestLimits):
    """Settings of the scheduler core (frontend, prefix cache, step builder) and of the service around it; the fields
    in declaration order are RequestLimits', EngineSettings', then ServiceSettings'."""

    def __post_init__(self) -> None:
        settings.check_fields(self)  # types, ranges, choices (any case), comma-separated lists
        self._check_image_formats()
        for i, address in enumerate(self.workers):
            if isinstance(address, str) and local_stream.is_local(address):
                path = local_stream.socket_path(address)
                if not os.path.isabs(path):
                    raise ValueError(f"workers[{i}]={address!r} (--workers): local: takes an absolute socket path")
                continue
            if not isinstance(address, str) or ":" not in address or not address.rsplit(":", 1)[1].isdigit():
                raise ValueError(
                    f"workers[{i}]={address!r} (--workers): must be HOST:PORT, or local:PATH for a rank's --step-socket"
                )
        if not self.metrics_host or not all(c.isalnum() or c in ".-_:" for c in self.metrics_host):
            raise ValueError(
                f"metrics_host={self.metrics_host!r} must be a host name or IP address without a port (--metrics-host)"
            )
        self._check_secret_files()
        self._check_media()
        if self.reconnect_backoff_max_seconds < self.reconnect_backoff_initial_seconds:
            raise ValueError(
                f"reconnect_backoff_max_seconds={self.reconnect_backoff_max_seconds} (--reconnect-backoff-max-seconds) "
                f"must be >= "
                f"reconnect_backoff_initial_seconds={self.reconnect_backoff_initial_seconds}"
            )

    def _check_image_formats(self) -> None:
        """Names Pillow can open (upper case); the list is never empty."""
        self.image_formats = [str(f).upper() for f in self.image_formats]
        if not self.image_formats:
            raise ValueError("image_formats is empty: allow at least one format (--image-formats JPEG,PNG)")
        from PIL import Image

        Image.init()
        unknown = [f for f in self.image_formats if f not in Image.OPEN]
        if unknown:
            raise ValueError(
                f"image_formats={','.join(unknown)} unknown to Pillow; choose from {','.join(sorted(Image.OPEN))}"
            )

    def _check_media(self) -> None:
        """Host names and CIDRs parse and the local media directory exists, so a typo fails at start-up rather than
        as every request's refusal. The rules themselves are scheduler_svc/media_domains.py's."""
        try:
            self.allowed_media_domains = [normalize_domain(str(d)) for d in self.allowed_media_domains]
        except ValueError as exc:
            raise ValueError(f"allowed_media_domains (--allowed-media-domains): {exc}") from None
        for cidr in self.allowed_media_networks:
            try:
                ipaddress.ip_network(str(cidr), strict=False)
            except ValueError:
                raise ValueError(
                    f"allowed_media_networks={cidr!r} (--allowed-media-networks): not a CIDR such as "
                    "10.0.0.0/8 or fd00::/8"
                ) from None
        if self.allowed_local_media_path and not os.path.isdir(self.allowed_local_media_path):
            raise ValueError(
                f"allowed_local_media_path={self.allowed_local_media_path!r} "
                "(--allowed-local-media-path): no such directory"
            )

    def _check_secret_files(self) -> None:
        """Pairs come together and named files exist; their contents are checked when the server starts."""
        tls_settings.check_server_tls(self)
        tls_settings.check_pair(self, prefix="worker_")
        for f in dataclasses.fields(self):
            if f.name.endswith("_file") and getattr(self, f.name) and not os.path.isfile(getattr(self, f.name)):
                raise ValueError(f"{f.name}={getattr(self, f.name)!r}: no such file ({settings.flag_of(f)})")

    @staticmethod
    def effective(configured: int, from_ranks: int, name: str) -> int:
        """The budget to use: the ranks' value when the setting is 0, else the setting, which may not exceed it."""
        if configured == 0:
            if from_ranks <= 0:
                raise ValueError(f"{name}=0 takes the ranks' value, but the ranks reported {from_ranks}")
            return from_ranks
        if from_ranks > 0 and configured > from_ranks:
            raise ValueError(
                f"{name}={configured} exceeds what the ranks reported ({from_ranks}); lower --{name.replace('_', '-')}"
            )
        return configured


def build_parser() -> argparse.ArgumentParser:
    """``mmcast-scheduler``'s command line: a flag per ``SchedulerConfig`` field, ``--version``, ``--print-config``."""
    return settings.build_parser(SchedulerConfig, prog=PROG, description=DESCRIPTION)


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> SchedulerConfig:
    """Flags over environment over defaults. A bad flag exits 2 (argparse); anything else raises ValueError naming
    the setting or variable."""
    return settings.load(SchedulerConfig, build_parser(), argv, environ)
