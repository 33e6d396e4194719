"""``dicom-ingest audit verify | decrypt | export | keygen``: the trail for its auditors.

- ``verify``: check a whole topic (or ``--file``) and name the first break; with
  the keys in the settings (AUDIT_KEY, AUDIT_KEYRING_FILE, or KMS) it also
  decrypts and checks the plaintext chain. Trust comes from a pinned signing key:
  ``--public-key`` (a PEM file) or ``--kms-signing-key`` (or the settings'
  AUDIT_SIGNING_KMS_KEY_ID); without one, only ``--trust-on-first-use``. Strict
  by default: content no trusted digest covers fails (``--no-strict`` warns).
  ``--checkpoint`` starts from a digest an earlier run saved with
  ``--save-checkpoint`` (for a topic whose retention dropped its head). Exit
  status 0 when nothing is wrong, 1 on a break, 2 when the trail could not be
  read (no record opens with the keys given) or the command is wrong.
- ``decrypt``: print every record as a JSON line, for a holder of the key.
- ``export``: write the topic to a file that ``verify --file`` checks later.
- ``keygen``: a new keyring (``--keyring``, or add a key with ``--rotate``) or an
  Ed25519 signing key (``--signing-key``, public half beside it as ``.pub``).

Keys are never taken from the command line (it shows in ``ps`` and shell
history): only from the settings' files and environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import json
import socket
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio

from ingest.audit.digest import load_public_key, public_key_text, write_signing_key
from ingest.audit.keys import (
    KeySource,
    KmsClient,
    KmsKeys,
    LocalKeyring,
    kms_public_key,
    write_keyring,
)
from ingest.audit.publish import open_signer
from ingest.audit.records import AuditEvent, DataKeyRef
from ingest.audit.store import (
    Export,
    export_header,
    read_audit_topic,
    read_export,
    sign_header,
    write_export,
)
from ingest.audit.verify import (
    Finding,
    Verification,
    check_index,
    load_checkpoint,
    save_checkpoint,
    unwrap_all,
    verify_trail,
)
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
        help="a trusted digest signing key, Ed25519 or P-256 (repeatable)",
    )
    verify.add_argument(
        "--kms-signing-key",
        action="append",
        default=[],
        metavar="KEY_ID",
        help="trust the digests signed by this KMS key (its public half, by GetPublicKey)",
    )
    verify.add_argument(
        "--trust-on-first-use",
        action="store_true",
        help="no pinned key: trust the key each trail announced (or first signed with)",
    )
    verify.add_argument(
        "--no-strict",
        action="store_true",
        help="report unsigned and truncated content as warnings, not breaks",
    )
    verify.add_argument(
        "--checkpoint", type=Path, metavar="FILE", help="verify on from a saved checkpoint"
    )
    verify.add_argument(
        "--save-checkpoint",
        type=Path,
        metavar="FILE",
        help="after a clean run, save each worker's latest digest here",
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
    if verb in ("export", "decrypt"):
        await _record_use(settings, verb, getattr(args, "file", None))
    export = await _messages(settings, getattr(args, "file", None))
    stored = export.messages
    if verb == "export":
        header = export_header(settings.audit_topic, stored)
        signed = bool(settings.audit_signing_key_file or settings.audit_signing_kms_key_id)
        if signed:  # the export's index, signed: a trail removed from the file later shows
            signer = await open_signer(settings)
            try:
                header = await sign_header(header, signer)
            finally:
                await signer.aclose()
        write_export(args.out, settings.audit_topic, stored, header)
        how = "signed" if signed else "unsigned"
        print(f"{len(stored)} messages of {settings.audit_topic} written to {args.out} ({how})")
        return 0
    decrypt = verb == "decrypt" or not getattr(args, "no_decrypt", False)
    report = await _verify(settings, export, decrypt, getattr(args, "kms", False), args)
    if verb == "decrypt":
        for record in report.records:
            print(json.dumps(record, sort_keys=True))
        return 0 if report.records or not stored else 2
    if not export.complete:
        report.findings.append(
            Finding(
                len(stored),
                "the end of the file",
                "deleted",
                "?",
                f"the export's header counts {export.declared} messages, the file holds "
                f"{len(stored)}",
            )
        )
    _print_report(report)
    if report.ok and args.save_checkpoint is not None:
        save_checkpoint(args.save_checkpoint, report)
        print(f"checkpoint of {len(report.latest)} workers saved to {args.save_checkpoint}")
    if report.tampered:
        return 1
    return 0 if report.ok else 2


async def _record_use(settings: Settings, verb: str, file: Path | None) -> None:
    """Record ``audit_log.used`` (DICOM 110101 Audit Log Used) on the audit topic before
    the trail is read: a trail of its own, signed as the workers' are. Where the
    settings name no audit topic, key or signing key, say that the use goes unrecorded.

    Raises:
        BrokerError, KeyServiceError: the use could not be recorded (nothing is read).
    """
    s = settings
    keys = s.audit_key or s.audit_keyring_file or s.audit_kms_key_id
    signing = s.audit_signing_key_file or s.audit_signing_kms_key_id
    missing = [
        name
        for name, ok in (
            ("KAFKA_BOOTSTRAP", bool(s.kafka_bootstrap)),
            ("AUDIT_KEY, AUDIT_KEYRING_FILE or AUDIT_KMS_KEY_ID", bool(keys)),
            ("AUDIT_SIGNING_KEY_FILE or AUDIT_SIGNING_KMS_KEY_ID", bool(signing)),
        )
        if not ok
    ]
    if missing:
        print(f"note: this {verb} is not recorded in the trail (no {missing[0]})", file=sys.stderr)
        return
    from ingest.audit.publish import open_audit
    from ingest.source.kafka import Publisher, make_producer

    when = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    who = f"audit-{verb}.{getpass.getuser()}@{socket.gethostname()}.{when}"
    s = dataclasses.replace(settings, worker_id=who, audit_spool_dir=None)
    where = await anyio.Path(file).absolute() if file else None
    source = f"file://{where}" if where else f"kafka://{s.kafka_bootstrap}/{s.audit_topic}"
    producer = make_producer(s)
    await producer.start()
    try:
        async with open_audit(s, Publisher(producer, s)) as audit:
            await audit.record(
                AuditEvent("audit_log.used", "success", "", source, None, None, reason=verb)
            )
    finally:
        await producer.stop()


async def _messages(settings: Settings, file: Path | None) -> Export:
    if file is not None:
        return read_export(file)
    if not settings.kafka_bootstrap:
        raise ConfigError("DICOM_INGEST_KAFKA_BOOTSTRAP: needed to read the topic (or --file)")
    from ingest.source.kafka import client_security

    now = datetime.now(UTC)
    stored = await read_audit_topic(
        settings.kafka_bootstrap, settings.audit_topic, client_security(settings)
    )
    return Export(stored, len(stored), now)


def _key_source(settings: Settings, kms: bool) -> KeySource | None:
    if settings.audit_keyring_file is not None:
        return LocalKeyring(settings.audit_keyring_file)
    if kms or settings.audit_kms_key_id or settings.audit_kms_endpoint_url:
        ca = str(settings.s3_ca_bundle) if settings.s3_ca_bundle else None
        return KmsKeys(settings.audit_kms_key_id, settings.audit_kms_endpoint_url, ca)
    return None


async def _pinned(settings: Settings, args: argparse.Namespace) -> list[str]:
    """The signing keys the auditor pinned: PEM files, and KMS keys' public halves.

    Raises:
        ConfigError: a key file that is no public key.
        KeyServiceError: KMS did not give a key's public half.
    """
    pinned = [load_public_key(path) for path in args.public_key]
    kms_ids = list(args.kms_signing_key)
    if not pinned and not kms_ids and settings.audit_signing_kms_key_id:
        kms_ids.append(settings.audit_signing_kms_key_id)
    if kms_ids:
        ca = str(settings.s3_ca_bundle) if settings.s3_ca_bundle else None
        kms = KmsClient(settings.audit_kms_endpoint_url, ca)
        try:
            for key_id in kms_ids:
                _, der = await kms_public_key(kms, key_id)
                pinned.append(public_key_text(der))
        finally:
            await kms.aclose()
    return pinned


async def _verify(
    settings: Settings, export: Export, decrypt: bool, kms: bool, args: argparse.Namespace
) -> Verification:
    values = [m.value for m in export.messages]
    verifying = args.audit_command in (None, "verify")
    pinned = await _pinned(settings, args) if verifying else []
    tofu = not verifying or args.trust_on_first_use
    if not pinned and not tofu:
        raise ConfigError(
            "audit verify: pin the digests' signing key (--public-key PEM, --kms-signing-key "
            "KEY_ID or DICOM_INGEST_AUDIT_SIGNING_KMS_KEY_ID), or pass --trust-on-first-use"
        )
    checkpoint = load_checkpoint(args.checkpoint) if verifying and args.checkpoint else None
    keys: dict[str, bytes] | None = None
    data_keys: dict[DataKeyRef, bytes] | None = None
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
    report = verify_trail(
        values,
        where=[m.where for m in export.messages],
        keys=keys,
        data_keys=data_keys,
        pinned=pinned,
        trust_on_first_use=tofu,
        strict=not (verifying and args.no_strict),
        now=export.exported_at,
        checkpoint=checkpoint,
    )
    if verifying:
        report.findings += check_index(export.header, values, pinned, tofu)
        if "sha256" in export.header and "signer" not in export.header:
            report.warnings.append(
                Finding(
                    len(values),
                    "the export's header",
                    "unsigned",
                    "?",
                    "the export's index is not signed: a trail removed whole, with all after it,"
                    " cannot be told",
                )
            )
    return report


def _print_report(report: Verification) -> None:
    signed = sum(1 for t in report.trails.values() if t.digests)
    print(
        f"{report.messages} messages, {len(report.trails)} trails ({signed} signed), "
        f"{report.duplicates} duplicates, "
        + (f"{len(report.records)} records decrypted" if report.decrypted else "not decrypted")
    )
    for t in report.trails.values():
        tail = t.last_seq - t.signed_through
        note = f", {tail} records unsigned" if tail > 0 else ""
        print(
            f"  trail {t.worker}/{t.trail}: {t.records} records, {t.digests} digests, "
            f"{t.state}{note}"
        )
    for warning in report.warnings:
        print(f"WARNING: {warning}")
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
