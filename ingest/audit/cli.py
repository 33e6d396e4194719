"""``dicom-ingest audit verify | decrypt | export | keygen``: the trail for its auditors.

- ``verify``: check a whole topic (or ``--file``) and name the first break; with
  the keys in the settings (AUDIT_KEY, AUDIT_KEYRING_FILE, or KMS) it also
  decrypts and checks the plaintext chain. Exit status 0 only when nothing is
  wrong. ``--public-key`` pins the digest signing keys to trust.
- ``decrypt``: print every record as a JSON line, for a holder of the key.
- ``export``: write the topic to a file that ``verify --file`` checks later.
- ``keygen``: a new keyring (``--keyring``, or add a key with ``--rotate``) or an
  Ed25519 signing key (``--signing-key``, public half beside it as ``.pub``).

Keys are never taken from the command line (it shows in ``ps`` and shell
history): only from the settings' files and environment.
"""

from __future__ import annotations

import argparse
import base64
import json
from pathlib import Path
from typing import Any

from ingest.audit.digest import load_public_key, write_signing_key
from ingest.audit.keys import KeySource, KmsKeys, LocalKeyring, write_keyring
from ingest.audit.store import Stored, read_audit_topic, read_export, write_export
from ingest.audit.verify import Verification, unwrap_all, verify_trail
from ingest.errors import ConfigError
from ingest.settings import Settings, load_settings


def add_audit_parser(commands: Any) -> None:
    """The ``audit`` command and its subcommands (``ingest/cli.py`` calls this)."""
    audit = commands.add_parser("audit", help="verify, decrypt or export the audit trail")
    verbs = audit.add_subparsers(dest="audit_command", metavar="VERB")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", type=Path, help="TOML file with settings (env wins)")
    common.add_argument("--file", type=Path, help="an export file instead of the topic")
    common.add_argument("--kms", action="store_true", help="unwrap data keys with AWS KMS")
    verify = verbs.add_parser(
        "verify", parents=[common], help="check the trail; name the first break"
    )
    verify.add_argument(
        "--public-key",
        type=Path,
        action="append",
        default=[],
        metavar="PEM",
        help="a trusted digest signing key (repeatable); default: the key each trail announced",
    )
    verify.add_argument("--no-decrypt", action="store_true", help="check without any key")
    verbs.add_parser("decrypt", parents=[common], help="print every record (needs the key)")
    export = verbs.add_parser("export", parents=[common], help="write the topic to a file")
    export.add_argument("--out", type=Path, required=True, help="the export file to write")
    keygen = verbs.add_parser("keygen", help="a new keyring or signing key file")
    keygen.add_argument("--keyring", type=Path, help="create (or --rotate) this keyring file")
    keygen.add_argument("--rotate", action="store_true", help="add a key and make it current")
    keygen.add_argument("--signing-key", type=Path, help="write a new Ed25519 key here")


async def run_audit_command(args: argparse.Namespace) -> int:
    """Run one ``audit`` verb (``verify`` when none is given).

    Raises:
        ConfigError: bad settings, key files or export files.
        BrokerError: the topic could not be read.
    """
    verb = args.audit_command or "verify"
    if verb == "keygen":
        return _keygen(args)
    settings = load_settings(config_file=getattr(args, "config", None), required=())
    stored = await _messages(settings, getattr(args, "file", None))
    if verb == "export":
        write_export(args.out, settings.audit_topic, stored)
        print(f"{len(stored)} messages of {settings.audit_topic} written to {args.out}")
        return 0
    decrypt = verb == "decrypt" or not getattr(args, "no_decrypt", False)
    report = await _verify(settings, stored, decrypt, getattr(args, "kms", False), args)
    if verb == "decrypt":
        for record in report.records:
            print(json.dumps(record, sort_keys=True))
        return 0 if report.records or not stored else 1
    _print_report(report)
    return 0 if report.ok else 1


async def _messages(settings: Settings, file: Path | None) -> list[Stored]:
    if file is not None:
        return read_export(file)
    if not settings.kafka_bootstrap:
        raise ConfigError("DICOM_INGEST_KAFKA_BOOTSTRAP: needed to read the topic (or --file)")
    from ingest.source.kafka import client_security

    return await read_audit_topic(
        settings.kafka_bootstrap, settings.audit_topic, client_security(settings)
    )


def _key_source(settings: Settings, kms: bool) -> KeySource | None:
    if settings.audit_keyring_file is not None:
        return LocalKeyring(settings.audit_keyring_file)
    if kms or settings.audit_kms_key_id or settings.audit_kms_endpoint_url:
        ca = str(settings.s3_ca_bundle) if settings.s3_ca_bundle else None
        return KmsKeys(settings.audit_kms_key_id, settings.audit_kms_endpoint_url, ca)
    return None


async def _verify(
    settings: Settings, stored: list[Stored], decrypt: bool, kms: bool, args: argparse.Namespace
) -> Verification:
    values = [m.value for m in stored]
    pinned = [
        base64.b64encode(load_public_key(p)).decode() for p in getattr(args, "public_key", [])
    ]
    keys: dict[str, bytes] | None = None
    data_keys: dict[str, bytes] | None = None
    if decrypt:
        keys = {settings.audit_key_id: settings.audit_key} if settings.audit_key else {}
        source = _key_source(settings, kms)
        if source is not None:
            try:
                data_keys = await unwrap_all(values, source)
            finally:
                await source.aclose()
        if not keys and source is None:
            raise ConfigError("DICOM_INGEST_AUDIT_KEY: no audit key set (or use --no-decrypt)")
    where = [m.where for m in stored]
    return verify_trail(values, where=where, keys=keys, data_keys=data_keys, pinned=pinned)


def _print_report(report: Verification) -> None:
    signed = sum(1 for t in report.trails.values() if t.digests)
    print(
        f"{report.messages} messages, {len(report.trails)} trails ({signed} signed), "
        f"{report.duplicates} duplicates, "
        + (f"{len(report.records)} records decrypted" if report.decrypted else "not decrypted")
    )
    for t in report.trails.values():
        tail = t.last_seq - t.signed_through
        note = f", unsigned tail of {tail}" if tail > 0 else ""
        print(f"  trail {t.worker}/{t.trail}: {t.records} records, {t.digests} digests{note}")
    first = report.first_break
    if first is None:
        print("verified: no break")
        return
    print(f"FIRST BREAK: {first}")
    for finding in report.findings[1:]:
        print(f"  then {finding}")


def _keygen(args: argparse.Namespace) -> int:
    if not args.keyring and not args.signing_key:
        raise ConfigError("audit keygen: give --keyring FILE and/or --signing-key FILE")
    if args.keyring:
        name = write_keyring(args.keyring, rotate=args.rotate)
        print(f"keyring {args.keyring}: current key {name}")
    if args.signing_key:
        try:
            write_signing_key(args.signing_key)
        except FileExistsError:
            raise ConfigError(f"audit keygen: {args.signing_key} exists already") from None
        print(f"signing key {args.signing_key}; public key {args.signing_key}.pub")
    return 0
