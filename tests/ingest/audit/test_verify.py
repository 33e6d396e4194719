"""The audit trail as an auditor sees it: the A.5 record model, envelope keys from a
keyring with rotation, signed digests, and ``audit verify`` naming the first break of a
tampered, deleted, reordered or inserted record (in memory; the topic runs in
tests/ingest/audit/test_publish.py, KMS in tests/ingest/audit/test_kms.py)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog

from ingest.audit.digest import (
    DigestSigner,
    LocalSigner,
    Previous,
    Signer,
    load_public_key,
    load_signing_key,
    write_signing_key,
)
from ingest.audit.keys import LocalKeyring, context, write_keyring
from ingest.audit.publish import MAX_GROUP, AuditPublisher
from ingest.audit.records import AuditEvent, AuditTrail, open_envelope, verify_chain
from ingest.audit.spool import TrailState
from ingest.audit.store import Stored, write_export
from ingest.audit.verify import object_records, unwrap_all, verify_trail
from ingest.errors import BrokerRejected, ConfigError
from ingest.settings import load_settings
from tests.trails import (
    DEAD,
    KEY,
    OK,
    SITE_PUBLIC,
    MemoryPublisher,
    cli,
    settings_for,
    site_signer,
    write_site_key,
)

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def structlog_restored() -> Iterator[None]:
    """``main`` configures logging (through ``cli``): the configuration is given back."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


class RoundTripPublisher(MemoryPublisher):
    """Acknowledges a message a round trip (1 ms) after it is enqueued, counts how many
    are unacknowledged at once, and refuses the first confirmation when told to."""

    def __init__(self, refuse_first: bool = False) -> None:
        super().__init__()
        self.outstanding = self.most_outstanding = 0
        self.refuse = refuse_first

    async def enqueue(self, topic: str, value: bytes, key: bytes | None) -> asyncio.Future[Any]:
        await super().enqueue(topic, value, key)  # kept in order; acknowledged below
        self.outstanding += 1
        self.most_outstanding = max(self.most_outstanding, self.outstanding)
        acked: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.001, acked.set_result, None)
        return acked

    async def confirm(self, delivery: Any, topic: str, value: bytes, key: bytes | None) -> None:
        await delivery
        self.outstanding -= 1
        if self.refuse:
            self.refuse = False
            raise BrokerRejected("refused once")


async def test_records_of_many_objects_share_a_round_trip_in_chain_order() -> None:
    publisher = RoundTripPublisher()
    audit = AuditPublisher(AuditTrail(KEY, "k1", "w1"), publisher, "audit", "w1")  # type: ignore[arg-type]
    async with anyio.create_task_group() as group:
        for i in range(40):
            group.start_soon(audit.record, OK if i % 2 else DEAD)
    assert len(publisher.messages) == 40
    assert 1 < publisher.most_outstanding <= MAX_GROUP  # groups, not one a round trip
    report = verify_trail(publisher.messages, keys={"k1": KEY}, strict=False)  # no signer
    assert report.ok, report.findings
    seqs = [r["seq"] for r in report.records]
    assert seqs == sorted(seqs) == list(range(40))  # the topic's order is the chain's


async def test_a_refused_group_stays_queued_and_goes_first_in_the_next() -> None:
    publisher = RoundTripPublisher(refuse_first=True)
    audit = AuditPublisher(AuditTrail(KEY, "k1", "w1"), publisher, "audit", "w1")  # type: ignore[arg-type]
    with pytest.raises(BrokerRejected):
        await audit.record(OK)
    await audit.record(DEAD)
    # the first record twice (sent, refused, sent again first), then the second
    assert len(publisher.messages) == 3
    assert publisher.messages[0] == publisher.messages[1]
    report = verify_trail(publisher.messages, keys={"k1": KEY}, strict=False)
    assert report.ok, report.findings  # an identical copy is a duplicate, not a finding
    assert [r["seq"] for r in report.records] == [0, 1]  # the copy counted once


@pytest.fixture
def keyring(tmp_path: Path) -> Path:
    path = tmp_path / "keyring.json"
    write_keyring(path)
    return path


async def keyring_trail(
    keyring: Path,
    events: int,
    *,
    worker: str = "w1",
    state: TrailState | None = None,
    stop: bool = True,
    signer: Signer | None = None,
    **extra: str,
) -> tuple[list[bytes], AuditPublisher]:
    """A keyring trail of ``events`` object records after its start, signed by the site
    key; stopped (``application.stop`` and the final digest) unless told not to, and
    continuing the worker's previous trail when ``state`` (its ``trail.json``) says so."""
    s = settings_for(keyring.parent, audit_keyring_file=str(keyring), **extra)
    publisher = MemoryPublisher()
    trail = AuditTrail(None, "unused", worker)
    previous = state.previous() if state is not None else Previous()
    signer = DigestSigner(signer or site_signer(), worker, trail.trail, previous, 60.0)
    audit = AuditPublisher(
        trail, publisher, "audit", worker,  # type: ignore[arg-type]
        keys=LocalKeyring(keyring), signer=signer, settings=s, state=state,
    )  # fmt: skip
    await audit.start()
    for i in range(events):
        await audit.record(OK if i % 3 else DEAD)
    if stop:
        await audit.stop()
    return publisher.messages, audit


async def opened(messages: list[bytes], keyring: Path, **kw: Any) -> Any:
    data_keys = await unwrap_all(messages, LocalKeyring(keyring))
    kw.setdefault("pinned", [SITE_PUBLIC])
    return verify_trail(messages, data_keys=data_keys, **kw)


def checked(messages: list[bytes], **kw: Any) -> Any:
    """``verify_trail`` without keys, the site key pinned."""
    kw.setdefault("pinned", [SITE_PUBLIC])
    return verify_trail(messages, **kw)


def kinds(report: Any) -> list[str]:
    return [f.kind for f in report.findings]


# -- the DICOM audit message model ------------------------------------------------------


def test_records_carry_the_a5_audit_message() -> None:
    t = AuditTrail(KEY, "k1", "w1", s3_endpoint="https://s3.example")
    keys = {"k1": KEY}
    start = open_envelope(
        t.seal(AuditEvent("application.start", "success", "", "", None, None)), keys
    )
    ok, dead = open_envelope(t.seal(OK), keys), open_envelope(t.seal(DEAD), keys)
    stop = open_envelope(
        t.seal(AuditEvent("application.stop", "success", "", "", None, None)), keys
    )
    a5 = ok["dicom_audit"]
    ident = a5["EventIdentification"]
    assert ident["EventID"] == {"code": "110104", "codeSystemName": "DCM",
                                "displayName": "DICOM Instances Transferred"}  # fmt: skip
    assert (ident["EventActionCode"], ident["EventOutcomeIndicator"]) == ("C", "0")
    assert ident["EventDateTime"] == ok["time"]
    source, me = a5["ActiveParticipant"]
    assert source["UserID"] == "https://s3.example"
    assert source["RoleIDCode"][0]["code"] == "110153"
    assert (me["UserID"], me["UserIsRequestor"], me["RoleIDCode"][0]["code"]) == (
        "w1",
        True,
        "110152",
    )
    assert me["NetworkAccessPointID"]  # the host
    assert me["AlternativeUserID"].isdigit()  # the process
    study, s3obj, *outputs = a5["ParticipantObjectIdentification"]
    assert study["ParticipantObjectID"] == "1.2.3"
    assert study["ParticipantObjectIDTypeCode"]["code"] == "110180"
    assert study["ParticipantObjectDetail"] == [{"type": "SeriesInstanceUID", "value": "1.2.3.4"}]
    assert study["ParticipantObjectDescription"]["SOPClass"][0]["Instance"] == [
        {"UID": "1.2.3.4.5"}
    ]
    assert s3obj["ParticipantObjectID"] == "s3://scans/ct/1.dcm"
    assert s3obj["ParticipantObjectIDTypeCode"]["code"] == "12"
    assert {d["type"]: d["value"] for d in s3obj["ParticipantObjectDetail"]} == {
        "Bucket": "scans", "Key": "ct/1.dcm", "VersionId": "v1", "ETag": '"abc"'}  # fmt: skip
    assert [o["ParticipantObjectID"] for o in outputs] == list(OK.outputs)
    dead_ident = dead["dicom_audit"]["EventIdentification"]
    assert (dead_ident["EventID"]["code"], dead_ident["EventOutcomeIndicator"]) == ("110107", "8")
    assert dead_ident["EventOutcomeDescription"] == "not_dicom: NotDicom"
    for record, type_code in ((start, "110120"), (stop, "110121")):
        ident = record["dicom_audit"]["EventIdentification"]
        assert (ident["EventID"]["code"], ident["EventActionCode"]) == ("110100", "E")
        assert ident["EventTypeCode"][0]["code"] == type_code
    assert "patient" not in json.dumps([start, ok, dead, stop]).lower()
    with pytest.raises(ValueError, match="event"):
        AuditEvent("object.viewed", "success", "b", "k", None, None)


# -- envelope encryption with a keyring, rotation ----------------------------------------


async def test_keyring_envelopes_rotate_and_stay_decryptable(keyring: Path) -> None:
    messages, audit = await keyring_trail(keyring, 10, audit_rotate_records="4")
    envelopes = [json.loads(m) for m in messages if b'"digest"' not in m]
    assert all(set(e) == {"v", "alg", "kid", "nonce", "aad", "ct", "edk"} for e in envelopes)
    assert {e["kid"] for e in envelopes} == {"keyring:kek-1"}
    # 12 records (start, 10, stop) at 4 a key: three data keys, the rotation crossed twice
    edks = [e["edk"] for e in envelopes]
    assert len(set(edks)) == 3 == audit.rotations
    assert edks[3] == edks[0] != edks[4]
    report = await opened(messages, keyring)
    assert report.ok, report.findings
    assert [r["seq"] for r in report.records] == list(range(12))
    # a holder of the keyring alone, with plain AES-GCM:
    env = envelopes[5]
    aad = json.loads(base64.b64decode(env["aad"]))
    key = await LocalKeyring(keyring).unwrap(env["kid"], base64.b64decode(env["edk"]),
                                              context(aad["worker"], aad["trail"]))  # fmt: skip
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    plain = AESGCM(key).decrypt(*(base64.b64decode(env[f]) for f in ("nonce", "ct", "aad")))
    assert json.loads(plain)["seq"] == 5


async def test_keyring_rotation_keeps_old_keys_and_data_keys_are_bound_to_their_trail(
    keyring: Path,
) -> None:
    first, _ = await keyring_trail(keyring, 2)
    assert write_keyring(keyring, rotate=True) == "kek-2"
    second, _ = await keyring_trail(keyring, 2, worker="w2")
    assert {json.loads(m)["kid"] for m in second if b'"digest"' not in m} == {"keyring:kek-2"}
    assert (await opened(first + second, keyring)).ok
    # an edk moved into another trail's envelope does not unwrap there
    env = json.loads(second[2])  # a record (message 1 is the first digest)
    env["edk"] = json.loads(first[2])["edk"]
    env["kid"] = "keyring:kek-1"
    report = await opened([*first, json.dumps(env).encode()], keyring)
    assert "changed" in kinds(report)


def test_keyring_file_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    write_keyring(path)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        LocalKeyring(path)
    with pytest.raises(ConfigError, match="exactly one"):
        settings_for(tmp_path)  # no key at all


# -- digests and `audit verify` -----------------------------------------------------------


async def test_an_intact_trail_verifies_with_and_without_keys(keyring: Path) -> None:
    messages, _ = await keyring_trail(keyring, 7, audit_digest_records="3")
    digests = [json.loads(m) for m in messages if b'"digest"' in m]
    # after the start, records 3 and 6, and at the stop (final)
    assert [(d["digest_seq"], d["last_seq"], d["final"]) for d in digests] == [
        (0, 0, False), (1, 3, False), (2, 6, False), (3, 8, True)]  # fmt: skip
    assert all(d["type"] == "digest" and "ct" not in d for d in digests)
    with_keys = await opened(messages, keyring)
    assert with_keys.ok, with_keys.findings
    assert len(object_records(with_keys.records)) == 7
    assert verify_chain(with_keys.records).ok
    without = checked(messages)
    assert without.ok
    assert not without.records
    (summary,) = without.trails.values()
    assert (summary.records, summary.digests, summary.signed_through) == (9, 4, 8)
    assert summary.state == "closed"


def _record_positions(messages: list[bytes]) -> list[int]:
    return [i for i, m in enumerate(messages) if b'"digest"' not in m]


@pytest.mark.parametrize("decrypt", [True, False])
async def test_verify_names_the_first_break(keyring: Path, decrypt: bool) -> None:
    messages, _ = await keyring_trail(keyring, 8, audit_digest_records="4")
    records = _record_positions(messages)

    async def first(tampered: list[bytes]) -> Any:
        report = await opened(tampered, keyring) if decrypt else checked(tampered)
        assert not report.ok
        return report.first_break

    # changed: one byte of one record's ciphertext
    changed = list(messages)
    env = json.loads(changed[records[3]])
    ct = bytearray(base64.b64decode(env["ct"]))
    ct[5] ^= 1
    env["ct"] = base64.b64encode(bytes(ct)).decode()
    changed[records[3]] = json.dumps(env).encode()
    found = await first(changed)
    assert found.kind == "changed"
    if decrypt:  # the key names the record itself; without it, the digest range holding it
        assert "record 3 does not open" in found.detail
    else:
        assert "records 1..4 do not match digest 1" in found.detail
    # deleted
    deleted = messages[: records[5]] + messages[records[5] + 1 :]
    found = await first(deleted)
    assert (found.kind, found.detail) == ("deleted", "records 5..5 are missing")
    # reordered
    swapped = list(messages)
    swapped[records[5]], swapped[records[6]] = swapped[records[6]], swapped[records[5]]
    found = await first(swapped)
    assert (found.kind, found.detail) == ("reordered", "seq 6 stored before seq 5")
    # inserted: a copy of record 2 with another nonce, and a message that is no record
    forged = json.loads(messages[records[2]])
    forged["nonce"] = base64.b64encode(bytes(12)).decode()
    inserted = [*messages[: records[4]], json.dumps(forged).encode(), *messages[records[4] :]]
    found = await first(inserted)
    assert (found.kind, found.detail) == ("inserted", "a second, different record with seq 2")
    assert found.where == f"message {records[4]}"
    junk = [*messages[:3], b'{"hello": "auditor"}', *messages[3:]]
    assert (await first(junk)).kind == "inserted"


async def test_verify_finds_bad_signatures_digest_gaps_and_foreign_keys(
    keyring: Path, tmp_path: Path
) -> None:
    messages, _ = await keyring_trail(keyring, 8, audit_digest_records="3")
    digest_at = [i for i, m in enumerate(messages) if b'"digest"' in m]
    bad = list(messages)
    d = json.loads(bad[digest_at[1]])
    d["last_seq"] -= 1  # moves the signed head without re-signing
    bad[digest_at[1]] = json.dumps(d).encode()
    assert checked(bad).first_break.kind == "bad_signature"  # type: ignore[union-attr]
    gap = messages[: digest_at[1]] + messages[digest_at[1] + 1 :]
    found = checked(gap).first_break
    assert found is not None
    assert (found.kind, found.detail[:9]) == ("digest_gap", "digest 2 ")
    # pinned keys: the site's key is trusted, another is not
    pub = tmp_path / "other.pem"
    write_signing_key(pub)
    other = load_public_key(tmp_path / "other.pem.pub")
    # every digest by another key, so nothing signs the records either
    assert set(kinds(checked(messages, pinned=[other]))) == {"untrusted_key", "unsigned"}
    assert checked(messages, pinned=[other, SITE_PUBLIC]).ok


async def test_a_configured_signing_key_signs_every_digest(keyring: Path, tmp_path: Path) -> None:
    raw = write_signing_key(tmp_path / "signing.pem")
    signer = LocalSigner(load_signing_key(tmp_path / "signing.pem"))
    messages, _ = await keyring_trail(keyring, 2, signer=signer)
    keys = {json.loads(m)["public_key"] for m in messages if b'"digest"' in m}
    assert keys == {base64.b64encode(raw).decode()}
    report = await opened(messages, keyring, pinned=[load_public_key(tmp_path / "signing.pem.pub")])
    assert report.ok, report.findings
    assert report.records[0]["signing_key"] in keys  # announced in the first record


def test_a_signing_key_or_config_others_may_read_is_refused(tmp_path: Path) -> None:
    key = write_site_key(tmp_path / "site.pem")
    key.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_signing_key(key)
    config = tmp_path / "worker.toml"
    config.write_text(f'audit_key = "{base64.b64encode(KEY).decode()}"\n')
    config.chmod(0o644)
    with pytest.raises(ConfigError, match="holds audit_key and others may read it"):
        load_settings({}, config_file=config, required=())
    config.chmod(0o600)
    assert load_settings({}, config_file=config, required=()).audit_key == KEY


def test_the_keyring_is_written_through_a_private_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    planted = tmp_path / "keyring.json.tmp"  # the fixed name a former version wrote through
    stolen = tmp_path / "stolen"
    planted.symlink_to(stolen)
    write_keyring(path)
    write_keyring(path, rotate=True)
    assert not stolen.exists()  # the keys never went through the planted link
    assert path.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keyring.json", "keyring.json.tmp"]


@pytest.mark.usefixtures("anyio_backend")
def test_cli_export_file_verify_and_decrypt(
    keyring: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    messages, _ = anyio.run(keyring_trail, keyring, 3)
    stored = [Stored(0, i, None, m) for i, m in enumerate(messages)]
    export = tmp_path / "trail.jsonl"
    write_export(export, "dicom-ingest.audit", stored)
    pub = str(write_site_key(tmp_path / "site.pem")) + ".pub"
    monkeypatch.setenv("DICOM_INGEST_AUDIT_KEYRING_FILE", str(keyring))
    assert cli(monkeypatch, ["audit", "verify", "--file", str(export), "--public-key", pub]) == 0
    assert "verified: no break" in capsys.readouterr().out
    assert cli(monkeypatch, ["audit", "decrypt", "--file", str(export)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["event"] for r in lines] == ["application.start", "object.dead_lettered",
                                           "object.processed", "object.processed",
                                           "application.stop"]  # fmt: skip
    tampered = tmp_path / "tampered.jsonl"
    records = _record_positions(messages)
    write_export(tampered, "t", [m for i, m in enumerate(stored) if i != records[2]])
    monkeypatch.delenv("DICOM_INGEST_AUDIT_KEYRING_FILE")
    argv = ["audit", "verify", "--no-decrypt", "--file", str(tampered), "--public-key", pub]
    assert cli(monkeypatch, argv) == 1
    out = capsys.readouterr().out
    assert f"FIRST BREAK: deleted at partition 0 offset {records[3]}" in out
    assert "records 2..2 are missing" in out
