"""Envelope keys from a real KMS API (moto's server): GenerateDataKey with the trail's
encryption context, rotation, Decrypt of old data keys, refusals named without secrets;
and digests signed by an asymmetric KMS key (kms:Sign), the key outside the writer."""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path

import anyio
import botocore.session
import pytest

from ingest.audit.digest import DigestSigner
from ingest.audit.keys import KmsKeys, context
from ingest.audit.publish import AuditPublisher, open_signer
from ingest.audit.records import AuditTrail
from ingest.audit.store import Stored, write_export
from ingest.audit.verify import unwrap_all, verify_trail
from ingest.errors import KeyRefused
from tests.moto_kms import CREDENTIALS, MotoServer
from tests.trails import (
    DEAD,
    OK,
    SITE_PUBLIC,
    MemoryPublisher,
    cli,
    settings_for,
    site_signer,
    write_site_key,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def kms_key(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> str:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    kms = botocore.session.get_session().create_client(
        "kms", endpoint_url=moto.endpoint_url, region_name="us-east-1"
    )
    return str(kms.create_key(Description="dicom-ingest audit")["KeyMetadata"]["Arn"])


async def kms_trail(moto: MotoServer, key: str, tmp: Path, events: int) -> tuple[list[bytes], int]:
    s = settings_for(
        tmp,
        audit_kms_key_id=key,
        audit_kms_endpoint_url=moto.endpoint_url,
        audit_rotate_records="3",
    )
    trail = AuditTrail(None, "unused", "w-kms")
    keys = KmsKeys(s.audit_kms_key_id, s.audit_kms_endpoint_url)
    publisher = MemoryPublisher()
    audit = AuditPublisher(
        trail,
        publisher,  # type: ignore[arg-type]
        "audit",
        "w-kms",
        keys=keys,
        signer=DigestSigner(site_signer(), "w-kms", trail.trail),
        settings=s,
    )
    try:
        await audit.start()
        for i in range(events):
            await audit.record(OK if i % 2 else DEAD)
        await audit.stop()
    finally:
        await keys.aclose()
    return publisher.messages, audit.rotations


@pytest.mark.anyio
async def test_kms_data_keys_rotate_and_old_ones_decrypt(
    moto: MotoServer, kms_key: str, tmp_path: Path
) -> None:
    messages, rotations = await kms_trail(moto, kms_key, tmp_path, 5)
    envelopes = [json.loads(m) for m in messages if b'"digest"' not in m]
    assert len(envelopes) == 7  # start, 5, stop
    assert rotations == 3  # records 0-2, 3-5, 6
    assert {e["kid"] for e in envelopes} == {kms_key}  # the KMS key's ARN, as KMS named it
    assert len({e["edk"] for e in envelopes}) == 3
    reader = KmsKeys(None, moto.endpoint_url)  # an auditor needs no key id, only kms:Decrypt
    try:
        data_keys = await unwrap_all(messages, reader)
        assert len(data_keys) == 3
        report = verify_trail(messages, data_keys=data_keys, pinned=[SITE_PUBLIC])
        assert report.ok, report.findings
        assert [r["seq"] for r in report.records] == list(range(7))
        # KMS checks the encryption context: a data key does not unwrap for another trail
        env = envelopes[0]
        aad = json.loads(base64.b64decode(env["aad"]))
        with pytest.raises(KeyRefused, match="KMS Decrypt: InvalidCiphertextException"):
            await reader.unwrap(
                env["kid"], base64.b64decode(env["edk"]), context(aad["worker"], "another")
            )
    finally:
        await reader.aclose()


def test_cli_decrypts_a_kms_trail(
    moto: MotoServer,
    kms_key: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    messages, _ = anyio.run(kms_trail, moto, kms_key, tmp_path, 2)
    pub = Path(f"{write_site_key(tmp_path / 'site.pem')}.pub")
    export = tmp_path / "kms-trail.jsonl"
    write_export(export, "audit", [Stored(0, i, None, m) for i, m in enumerate(messages)])
    monkeypatch.setenv("DICOM_INGEST_AUDIT_KMS_ENDPOINT_URL", moto.endpoint_url)
    argv = ["audit", "verify", "--file", str(export), "--public-key", str(pub)]
    assert cli(monkeypatch, argv) == 0
    out = capsys.readouterr().out
    assert "4 records decrypted" in out
    assert "closed" in out
    assert "verified: no break" in out
    for secret in (CREDENTIALS["AWS_SECRET_ACCESS_KEY"],):
        assert secret not in out


@pytest.fixture
def kms_signing_key(moto: MotoServer, kms_key: str) -> str:
    kms = botocore.session.get_session().create_client(
        "kms", endpoint_url=moto.endpoint_url, region_name="us-east-1"
    )
    made = kms.create_key(
        Description="dicom-ingest audit digests", KeyUsage="SIGN_VERIFY", KeySpec="ECC_NIST_P256"
    )
    return str(made["KeyMetadata"]["Arn"])


def test_digests_signed_by_a_kms_key_verify_against_it_alone(
    moto: MotoServer,
    kms_key: str,
    kms_signing_key: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    s = settings_for(
        tmp_path,
        audit_kms_key_id=kms_key,
        audit_kms_endpoint_url=moto.endpoint_url,
        audit_signing_kms_key_id=kms_signing_key,
    )

    async def trail() -> list[bytes]:
        signer = await open_signer(s)  # what the worker opens: GetPublicKey, then kms:Sign
        keys = KmsKeys(s.audit_kms_key_id, s.audit_kms_endpoint_url)
        publisher = MemoryPublisher()
        t = AuditTrail(None, "unused", "w-kms")
        audit = AuditPublisher(
            t,
            publisher,  # type: ignore[arg-type]
            "audit",
            "w-kms",
            keys=keys,
            signer=DigestSigner(signer, "w-kms", t.trail),
            settings=s,
        )
        try:
            await audit.start()
            await audit.record(OK)
            await audit.stop()
        finally:
            await keys.aclose()
            await signer.aclose()
        return publisher.messages

    messages = anyio.run(trail)
    digests = [json.loads(m) for m in messages if b'"digest"' in m]
    assert {d["alg"] for d in digests} == {"ECDSA_SHA_256"}
    # the key as KMS names it (AWS answers its ARN, moto its id)
    assert {kms_signing_key.rsplit("/", 1)[-1]} == {d["key_id"].rsplit("/", 1)[-1] for d in digests}
    export = tmp_path / "kms-signed.jsonl"
    write_export(export, "audit", [Stored(0, i, None, m) for i, m in enumerate(messages)])
    monkeypatch.setenv("DICOM_INGEST_AUDIT_KMS_ENDPOINT_URL", moto.endpoint_url)
    argv = ["audit", "verify", "--file", str(export), "--kms-signing-key", kms_signing_key]
    assert cli(monkeypatch, argv) == 0
    assert "verified: no break" in capsys.readouterr().out
    # the site's Ed25519 key pinned instead: none of these digests is trusted
    pub = Path(f"{write_site_key(tmp_path / 'site.pem')}.pub")
    argv = ["audit", "verify", "--file", str(export), "--public-key", str(pub)]
    assert cli(monkeypatch, argv) == 1
    assert "FIRST BREAK: unsigned" in capsys.readouterr().out
    # the settings' signing key id pins it as well, for an auditor who has the settings
    monkeypatch.setenv("DICOM_INGEST_AUDIT_SIGNING_KMS_KEY_ID", kms_signing_key)
    assert cli(monkeypatch, ["audit", "verify", "--file", str(export)]) == 0
    # a symmetric key is no signing key: refused by name, before any digest
    with pytest.raises(KeyRefused, match="not an ECC_NIST_P256 SIGN_VERIFY key"):
        anyio.run(open_signer, dataclasses.replace(s, audit_signing_kms_key_id=kms_key))
