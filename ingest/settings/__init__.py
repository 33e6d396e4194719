"""The one place that reads configuration: environment first, then a TOML file.

Every key is ``DICOM_INGEST_<NAME>`` in the environment, or ``<name>`` in lower
case in the file given with ``--config``; the environment wins. Values are
validated here, once, and the frozen ``Settings`` is passed down; nothing else
reads the environment. A bad value raises ``ConfigError`` whose message names
the variable, so start-up fails with one clear line.

Each setting is declared once, in ``model.py``: its type, default, kind of value
(parser and bounds, ``kinds.py``) and what it does. The loader here,
``setting_names`` and docs/configuration.md's tables are derived from them.
"""

from __future__ import annotations

import difflib
import os
import socket
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, Final

from ingest.errors import ConfigError
from ingest.settings.kinds import parse_window
from ingest.settings.model import PREFIX, SETTINGS, Settings

__all__ = [
    "PREFIX",
    "SETTINGS",
    "Settings",
    "load_settings",
    "parse_setting",
    "parse_window",
    "plaintext",
    "setting_names",
]

# What the worker needs (``load_settings``' default; the `audit` and `dlq` commands ask less)
_REQUIRED: Final = tuple(name for name, declared in SETTINGS.items() if declared.required)
# Settings whose values are secrets (left out of ``Settings``' repr)
_SECRETS: Final = frozenset(f.name for f in fields(Settings) if not f.repr)


def parse_setting(name: str, raw: str) -> Any:
    """The value of setting ``name`` (a field of ``Settings``) given as ``raw``.

    Raises:
        ConfigError: ``raw`` is not a valid value; the message names the variable.
    """
    try:
        return SETTINGS[name].kind.parse(raw)
    except ConfigError as exc:
        raise ConfigError(f"{PREFIX}{name.upper()}: {exc}") from None


def load_settings(
    environ: Mapping[str, str] | None = None,
    config_file: Path | None = None,
    required: tuple[str, ...] = _REQUIRED,
) -> Settings:
    """Build ``Settings`` from a TOML file (optional) overlaid by the environment.

    Raises:
        ConfigError: a value is invalid, a required one is missing, the file
            cannot be read, or it holds a key we do not know.
    """
    env = os.environ if environ is None else environ
    raw: dict[str, str] = {}
    if config_file is not None:
        try:
            data = tomllib.loads(config_file.read_text())
            mode = config_file.stat().st_mode
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"--config {config_file}: {exc}") from exc
        for key, value in data.items():
            if key not in SETTINGS:
                hint = _nearest(key, list(SETTINGS))
                raise ConfigError(f"--config {config_file}: unknown key {key!r}{hint}")
            raw[key] = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        secrets = sorted(k for k in data if k in _SECRETS)
        if secrets and mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"--config {config_file}: holds {', '.join(secrets)} and others may read it; "
                "chmod 600 it"
            )
    _refuse_unknown(env)
    for key in SETTINGS:
        name = PREFIX + key.upper()
        if name in env:
            raw[key] = env[name]
    for key in required:
        if key not in raw:
            raise ConfigError(f"{PREFIX}{key.upper()}: required but not set")
    values = {key: parse_setting(key, text) for key, text in raw.items()}
    if not values.get("worker_id"):
        values["worker_id"] = socket.gethostname()
    settings = Settings(**values)
    _check_consistency(settings)
    if "output_url" in required:  # the worker's settings; `audit` reads a trail only
        _check_security(settings)
    return settings


def _refuse_unknown(env: Mapping[str, str]) -> None:
    """A ``DICOM_INGEST_*`` variable that is no setting is a typo (``PARTSIZE``) or a
    setting of another version: refused, not ignored, so the worker never runs on a
    default the operator meant to change.

    Raises:
        ConfigError: names the first unknown variable and the nearest known one.
    """
    known = setting_names()
    for name in sorted(env):
        if name.startswith(PREFIX) and name not in known:
            raise ConfigError(f"{name}: not a setting{_nearest(name, known)}")


def _nearest(name: str, known: list[str]) -> str:
    match = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean {match[0]}?" if match else f" (the settings: {PREFIX}*, see --help)"


def _check_consistency(settings: Settings) -> None:
    if settings.part_size % (64 * 1024):
        raise ConfigError(f"{PREFIX}PART_SIZE: must be a multiple of 64 KiB")
    if settings.heartbeat_interval_ms >= settings.session_timeout_ms:
        raise ConfigError(f"{PREFIX}HEARTBEAT_INTERVAL_MS: must be below SESSION_TIMEOUT_MS")
    if settings.ring_slots < 2:
        raise ConfigError(f"{PREFIX}RING_SLOTS: at least 2")


def _check_security(s: Settings) -> None:
    sources = [bool(s.audit_key), s.audit_keyring_file is not None, s.audit_kms_key_id is not None]
    if sum(sources) != 1:
        raise ConfigError(
            f"{PREFIX}AUDIT_KEY: set exactly one of AUDIT_KEY, AUDIT_KEYRING_FILE, AUDIT_KMS_KEY_ID"
        )
    if s.kafka_security_protocol.startswith("SASL") and not (
        s.kafka_sasl_username and s.kafka_sasl_password
    ):
        raise ConfigError(f"{PREFIX}KAFKA_SASL_USERNAME: SASL needs a username and a password")
    if (s.kafka_ssl_certfile is None) != (s.kafka_ssl_keyfile is None):
        raise ConfigError(f"{PREFIX}KAFKA_SSL_KEYFILE: a client certificate needs its key file")
    if s.output_sse_kms_key_id and s.output_sse != "aws:kms":
        raise ConfigError(f"{PREFIX}OUTPUT_SSE_KMS_KEY_ID: needs OUTPUT_SSE=aws:kms")
    if s.audit_signing_key_file is not None and s.audit_signing_kms_key_id:
        raise ConfigError(
            f"{PREFIX}AUDIT_SIGNING_KEY_FILE: set one of it and AUDIT_SIGNING_KMS_KEY_ID"
        )
    if s.posture == "production":
        _check_production(s)
    if s.require_tls or s.posture == "production":
        check_tls(s)


def _check_production(s: Settings) -> None:
    """An audit trail that an auditor can trust, or no start."""
    if s.audit_signing_key_file is None and not s.audit_signing_kms_key_id:
        raise ConfigError(
            f"{PREFIX}AUDIT_SIGNING_KMS_KEY_ID: POSTURE=production needs a signing key outside "
            "the worker (AUDIT_SIGNING_KMS_KEY_ID or AUDIT_SIGNING_KEY_FILE)"
        )
    if s.audit_key:
        raise ConfigError(
            f"{PREFIX}AUDIT_KEY: POSTURE=production needs AUDIT_KMS_KEY_ID or AUDIT_KEYRING_FILE"
        )
    if s.audit_spool_dir is None:
        raise ConfigError(
            f"{PREFIX}AUDIT_SPOOL_DIR: POSTURE=production needs it (the spool, and where each "
            "trail continues its worker's previous one)"
        )


def plaintext(s: Settings) -> list[str]:
    """The connections the settings ask for without TLS, each named by its variable."""
    found = []
    if s.kafka_security_protocol not in ("SSL", "SASL_SSL"):
        plain: str = s.kafka_security_protocol
        if plain == "SASL_PLAINTEXT" and s.kafka_sasl_mechanism == "PLAIN":
            plain += " with SASL PLAIN (the password in the clear)"
        found.append(f"{PREFIX}KAFKA_SECURITY_PROTOCOL: {plain} is plaintext")
    for name in ("s3_endpoint_url", "audit_kms_endpoint_url"):
        url = getattr(s, name)
        if url is not None and not url.lower().startswith("https://"):
            found.append(f"{PREFIX}{name.upper()}: http is plaintext")
    return found


def check_tls(s: Settings) -> None:
    """``REQUIRE_TLS``: no plaintext Kafka (SASL PLAIN included) and no http endpoints.

    Raises:
        ConfigError: the first plaintext connection the settings ask for.
    """
    for problem in plaintext(s)[:1]:
        raise ConfigError(f"{problem} (REQUIRE_TLS: SSL or SASL_SSL, and https)")


def setting_names() -> list[str]:
    """Every environment variable this module reads, for ``--help`` and docs."""
    return [PREFIX + name.upper() for name in SETTINGS]
