"""The audit trail as an auditor sees it: the A.5 record model, envelope keys from a
keyring with rotation, signed digests, and ``audit verify`` naming the first break of a
tampered, deleted, reordered or inserted record (in memory; the topic runs in
tests/ingest/audit/test_publish.py, KMS in tests/ingest/audit/test_kms.py)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ingest.audit.cli import run_audit_command
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
from ingest.audit.records import (
    ENVELOPE_HEAD_ZERO,
    AuditEvent,
    AuditTrail,
    envelope_step,
    open_envelope,
    verify_chain,
)
from ingest.audit.spool import TrailState
from ingest.audit.store import Stored, export_header, sign_header, write_export
from ingest.audit.verify import Checkpoint, object_records, unwrap_all, verify_trail
from ingest.cli import make_parser
from ingest.errors import BrokerRejected, ConfigError, KeyServiceError
from ingest.settings import load_settings
from tests.trails import (
    DEAD,
    KEY,
    OK,
    SITE_KEY,
    SITE_PUBLIC,
    MemoryPublisher,
    cli,
    settings_for,
    site_signer,
    write_site_key,
)

pytestmark = pytest.mark.anyio


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
    count = 2 * MAX_GROUP + 8  # more than a group holds
    async with anyio.create_task_group() as group:
        for i in range(count):
            group.start_soon(audit.record, OK if i % 2 else DEAD)
    assert len(publisher.messages) == count
    assert 1 < publisher.most_outstanding <= MAX_GROUP  # groups, not one a round trip
    report = verify_trail(publisher.messages, keys={"k1": KEY}, strict=False)  # no signer
    assert report.ok, report.findings
    seqs = [r["seq"] for r in report.records]
    assert seqs == sorted(seqs) == list(range(count))  # the topic's order is the chain's


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
    digests = DigestSigner(signer or site_signer(), worker, trail.trail, previous, 60.0)
    audit = AuditPublisher(
        trail,
        publisher,  # type: ignore[arg-type]
        "audit",
        worker,
        keys=LocalKeyring(keyring),
        signer=digests,
        settings=s,
        state=state,
    )
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
    assert ident["EventID"] == {
        "code": "110104",
        "codeSystemName": "DCM",
        "displayName": "DICOM Instances Transferred",
    }
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
        "Bucket": "scans",
        "Key": "ct/1.dcm",
        "VersionId": "v1",
        "ETag": '"abc"',
    }
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


def test_the_a5_message_names_the_patient_and_the_sop_class() -> None:
    t = AuditTrail(KEY, "k1", "w1")
    event = dataclasses.replace(
        OK, patient_id="MRN-0042", sop_class_uid="1.2.840.10008.5.1.4.1.1.2"
    )
    assert "MRN-0042" not in repr(event)  # never in a log line
    record = open_envelope(t.seal(event), {"k1": KEY})
    patient, study, *_ = record["dicom_audit"]["ParticipantObjectIdentification"]
    assert patient == {
        "ParticipantObjectID": "MRN-0042",
        "ParticipantObjectTypeCode": "1",
        "ParticipantObjectTypeCodeRole": "1",
        "ParticipantObjectIDTypeCode": {
            "code": "2",
            "codeSystemName": "RFC-3881",
            "displayName": "Patient Number",
        },
    }
    (sop_class,) = study["ParticipantObjectDescription"]["SOPClass"]
    assert sop_class["UID"] == "1.2.840.10008.5.1.4.1.1.2"
    assert sop_class["Instance"] == [{"UID": "1.2.3.4.5"}]


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
    key = await LocalKeyring(keyring).unwrap(
        env["kid"], base64.b64decode(env["edk"]), context(aad["worker"], aad["trail"])
    )
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
        (0, 0, False),
        (1, 3, False),
        (2, 6, False),
        (3, 8, True),
    ]
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
    assert checked(bad).first_break.kind == "bad_signature"
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
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("keyring"))
    assert left == ["keyring.json", "keyring.json.tmp"]  # no temporary file left behind


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
    assert [r["event"] for r in lines] == [
        "application.start",
        "object.dead_lettered",
        "object.processed",
        "object.processed",
        "application.stop",
    ]
    tampered = tmp_path / "tampered.jsonl"
    records = _record_positions(messages)
    write_export(tampered, "t", [m for i, m in enumerate(stored) if i != records[2]])
    monkeypatch.delenv("DICOM_INGEST_AUDIT_KEYRING_FILE")
    argv = ["audit", "verify", "--no-decrypt", "--file", str(tampered), "--public-key", pub]
    assert cli(monkeypatch, argv) == 1
    out = capsys.readouterr().out
    assert f"FIRST BREAK: deleted at partition 0 offset {records[3]}" in out
    assert "records 2..2 are missing" in out


# -- attacks on exported trails: what verify says, and its exit status ---------------------
#
# Every trail below is signed by the site key (SITE_PUBLIC, pinned), as in production: the
# attacker holds a data key (the keyring: `opened`) or nothing, never the site key.


def _last_digest_time(messages: list[bytes]) -> datetime:
    times = [json.loads(m)["time"] for m in messages if b'"digest"' in m]
    return datetime.fromisoformat(max(times).replace("Z", "+00:00"))


def _digest_positions(messages: list[bytes]) -> list[int]:
    return [i for i, m in enumerate(messages) if b'"digest"' in m]


async def restarts(
    keyring: Path, tmp_path: Path, runs: int, *, killed: tuple[int, ...] = ()
) -> list[list[bytes]]:
    """``runs`` trails of worker w1 one after another, each continuing the one before
    through the worker's ``trail.json``; the runs in ``killed`` end without a stop."""
    state_dir = tmp_path / "state-w1"
    state_dir.mkdir(exist_ok=True)
    state = TrailState(state_dir)
    trails = []
    for run in range(runs):
        messages, _ = await keyring_trail(keyring, 3, state=state, stop=run not in killed)
        trails.append(messages)
    return trails


def export(
    tmp_path: Path, messages: list[bytes], name: str = "trail.jsonl", later: float = 0.0
) -> str:
    """An export file of ``messages``, exported now or ``later`` seconds from now."""
    path = tmp_path / name
    write_export(path, "audit", [Stored(0, i, None, m) for i, m in enumerate(messages)])
    if later:
        header, *lines = path.read_text().splitlines(keepends=True)
        at = datetime.now(UTC) + timedelta(seconds=later)
        header = json.dumps(json.loads(header) | {"exported_at": at.isoformat()}) + "\n"
        path.write_text("".join([header, *lines]))
    return str(path)


async def verify_cli(
    monkeypatch: pytest.MonkeyPatch, file: str, *extra: str, keyring: Path | None = None
) -> int:
    """``audit verify --file`` with the site key pinned (unless ``extra`` says otherwise)."""
    if keyring is not None:
        monkeypatch.setenv("DICOM_INGEST_AUDIT_KEYRING_FILE", str(keyring))
    else:
        monkeypatch.delenv("DICOM_INGEST_AUDIT_KEYRING_FILE", raising=False)
        extra = ("--no-decrypt", *extra)
    pinned = () if "--trust-on-first-use" in extra else ("--public-key", PUB)
    return await audit_command(["audit", "verify", "--file", file, *pinned, *extra])


async def audit_command(argv: list[str]) -> int:
    """An ``audit`` command as ``main`` runs it, in this test's event loop (``main`` runs
    one of its own), with ``main``'s exit status for a configuration error."""
    try:
        return await run_audit_command(make_parser().parse_args(argv))
    except ConfigError as exc:
        print(f"dicom-ingest: configuration error: {exc}", file=sys.stderr)
        return 2


PUB = ""  # the site's public key file, written once per test by `site_pub`


@pytest.fixture(autouse=True)
def site_pub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = write_site_key(tmp_path / "site.pem")
    monkeypatch.setattr(f"{__name__}.PUB", f"{key}.pub")


async def test_restarts_chain_trails_and_a_killed_workers_tail_is_signed_by_its_successor(
    keyring: Path, tmp_path: Path
) -> None:
    trails = await restarts(keyring, tmp_path, 3, killed=(1,))
    first, killed, _ = (json.loads(t[0]) for t in trails)
    digest0 = [json.loads(t[1]) for t in trails]
    assert [d["prev_trail"] for d in digest0] == [
        "",
        json.loads(base64.b64decode(first["aad"]))["trail"],
        json.loads(base64.b64decode(killed["aad"]))["trail"],
    ]
    assert digest0[2]["prev_seq"] == 3  # the killed run's start and 3 records, acknowledged
    report = await opened([m for t in trails for m in t], keyring)
    assert report.ok, report.findings
    assert [t.state for t in report.trails.values()] == ["closed", "ended", "closed"]
    assert [r["previous_trail"] for r in report.records if r["seq"] == 0] == [
        d["prev_trail"] for d in digest0
    ]
    # the killed run's records after its last digest are signed by the next run's
    (_, killed_summary, _) = report.trails.values()
    assert killed_summary.signed_through == killed_summary.last_seq == 3


async def test_cut_tail_is_truncated_and_fails(
    keyring: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    messages, _ = await keyring_trail(keyring, 4)
    cut = messages[: _record_positions(messages)[-1]]  # application.stop and the final digest
    report = await opened(cut, keyring)
    assert kinds(report) == ["truncated"]
    assert "no final digest" in report.findings[0].detail
    # exported an hour later; right after the cut the trail would look like a running one's
    file = export(tmp_path, cut, later=3600)
    assert await verify_cli(monkeypatch, file, keyring=keyring) == 1
    assert "FIRST BREAK: truncated" in capsys.readouterr().out
    # --no-strict: a warning, and exit 0
    assert await verify_cli(monkeypatch, file, "--no-strict") == 0
    assert "WARNING: truncated" in capsys.readouterr().out
    # a trail cut before its successor started: the successor names what is gone
    trails = await restarts(keyring, tmp_path, 2)
    first = trails[0][: _record_positions(trails[0])[-1]]
    report = await opened(first + trails[1], keyring)
    assert [f.detail.split(" of previous trail")[0] for f in report.findings] == [
        "the last digest",  # that it continues from
        "records",  # up to the last one acknowledged
    ]
    assert set(kinds(report)) == {"deleted"}


async def test_a_record_appended_after_the_stop_is_unsigned(
    keyring: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    messages, audit = await keyring_trail(keyring, 2)
    appended = [*messages, audit.trail.seal(OK)]  # the data key's holder adds a record
    report = await opened(appended, keyring)
    assert report.ok is False
    assert kinds(report) == ["unsigned"]
    assert "came after the final digest" in report.findings[0].detail
    assert await verify_cli(monkeypatch, export(tmp_path, appended), keyring=keyring) == 1
    assert await verify_cli(monkeypatch, export(tmp_path, appended)) == 1  # without keys too


async def test_a_fabricated_trail_without_digests_fails(
    keyring: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    genuine, _ = await keyring_trail(keyring, 2)
    forged = AuditTrail(None, "unused", "w1")  # a keyring reader makes data keys of any trail
    forged.install(await LocalKeyring(keyring).new_data_key(context("w1", forged.trail)))
    fake = [forged.seal(AuditEvent("application.start", "success", "", "", None, None))]
    fake += [forged.seal(OK) for _ in range(3)]
    report = await opened(genuine + fake, keyring)
    assert len(report.records) == 4 + 4  # every record opens: only the signatures tell
    assert kinds(report) == ["unsigned"]
    assert report.findings[0].trail == forged.trail
    assert "no digest by a trusted key" in report.findings[0].detail
    assert await verify_cli(monkeypatch, export(tmp_path, genuine + fake), keyring=keyring) == 1


async def test_an_idle_workers_heartbeats_tell_it_from_a_cut_tail(keyring: Path) -> None:
    s = settings_for(keyring.parent, audit_keyring_file=str(keyring), audit_digest_s="0.05")
    publisher = MemoryPublisher()
    trail = AuditTrail(None, "unused", "w1")
    audit = AuditPublisher(
        trail,
        publisher,  # type: ignore[arg-type]
        "audit",
        "w1",
        keys=LocalKeyring(keyring),
        settings=s,
        signer=DigestSigner(site_signer(), "w1", trail.trail, Previous(), 0.05),
    )
    await audit.start()
    async with anyio.create_task_group() as group:
        await group.start(audit.run)
        await anyio.sleep(0.3)  # no record comes
        group.cancel_scope.cancel()
    digests = [json.loads(m) for m in publisher.messages if b'"digest"' in m]
    assert len(digests) >= 4  # the start's, then heartbeats
    assert {(d["first_seq"], d["last_seq"]) for d in digests[1:]} == {(1, 0)}  # no records
    running = publisher.messages
    last = _last_digest_time(running)
    live = await opened(running, keyring, now=last + timedelta(seconds=0.05))
    assert live.ok, live.findings
    assert [t.state for t in live.trails.values()] == ["open"]
    # the same trail read an hour later: it went silent without a stop
    assert kinds(await opened(running, keyring, now=last + timedelta(hours=1))) == ["truncated"]


async def test_a_deleted_or_swapped_trail_breaks_the_workers_chain(
    keyring: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, c = await restarts(keyring, tmp_path, 3)
    middle = json.loads(b[1])["trail"]
    report = await opened(a + c, keyring)
    assert kinds(report) == ["deleted"]
    assert report.findings[0].detail == f"previous trail {middle} of worker w1 is missing"
    assert await verify_cli(monkeypatch, export(tmp_path, a + c), keyring=keyring) == 1
    assert await verify_cli(monkeypatch, export(tmp_path, a + c)) == 1  # without keys too
    # swapped for another worker's trail: w1's chain still misses it
    other, _ = await keyring_trail(keyring, 3, worker="w2")
    assert kinds(await opened(a + other + c, keyring)) == ["deleted"]
    # swapped for a trail of w1 from elsewhere (a first trail again)
    stray, _ = await keyring_trail(keyring, 3)
    assert sorted(kinds(await opened(a + stray + c, keyring))) == ["deleted", "inserted"]


async def test_a_resigned_trail_fails_against_the_pinned_key(
    keyring: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    messages, _ = await keyring_trail(keyring, 6, audit_digest_records="3")
    # an attacker with no key at all: drops the last two objects' records and the stop,
    # and signs new digests over what is left with a key of their own
    records = _record_positions(messages)
    kept = [m for m in messages[: records[-3]] if b'"digest"' not in m]
    mallory = DigestSigner(
        LocalSigner(Ed25519PrivateKey.generate()), "w1", json.loads(messages[1])["trail"]
    )
    head = ENVELOPE_HEAD_ZERO
    for message in kept:
        head = envelope_step(head, message)
    forged = [
        *kept,
        await mallory.sign(len(kept) - 1, "0" * 64, head, "2026-01-01T00:00:00Z", True),
    ]
    report = checked(forged)
    assert "untrusted_key" in kinds(report)
    assert await verify_cli(monkeypatch, export(tmp_path, forged)) == 1
    # no pinned key: verify refuses to guess (exit 2) ...
    file = export(tmp_path, forged)
    monkeypatch.delenv("DICOM_INGEST_AUDIT_KEYRING_FILE", raising=False)
    assert await audit_command(["audit", "verify", "--no-decrypt", "--file", file]) == 2
    assert "--trust-on-first-use" in capsys.readouterr().err
    # ... and trusting on first use without the keys is what this attack defeats
    assert await verify_cli(monkeypatch, file, "--trust-on-first-use") == 0
    # with the keys, trust on first use takes the key the trail announced, inside record 0
    assert await verify_cli(monkeypatch, file, "--trust-on-first-use", keyring=keyring) == 1


async def test_an_identical_duplicate_digest_is_a_duplicate(keyring: Path) -> None:
    messages, _ = await keyring_trail(keyring, 5, audit_digest_records="2")
    at = _digest_positions(messages)[1]
    redelivered = [*messages[: at + 1], messages[at], *messages[at + 1 :], messages[at]]
    report = checked(redelivered)
    assert report.ok, report.findings
    assert report.duplicates == 2
    # a second, different digest with the same number is not
    other = json.loads(messages[at])
    other["time"] = "2026-01-01T00:00:00Z"
    assert "bad_signature" in kinds(checked([*messages, json.dumps(other).encode()]))


async def test_a_planted_envelope_with_a_copied_edk_spoils_only_itself(keyring: Path) -> None:
    messages, _ = await keyring_trail(keyring, 4)
    planted = json.loads(messages[2])
    aad = json.loads(base64.b64decode(planted["aad"]))
    aad["trail"] = "planted"  # another context: the keyring refuses the edk there
    planted["aad"] = base64.b64encode(json.dumps(aad).encode()).decode()
    poisoned = [json.dumps(planted).encode(), *messages]  # first, before every genuine one
    report = await opened(poisoned, keyring)
    assert len(report.records) == 6  # every genuine record still opens
    assert sorted(kinds(report)) == ["changed", "deleted", "unsigned"]
    assert {f.trail for f in report.findings} == {"planted"}  # the planted one, nothing else


async def test_a_wrong_key_is_no_key_not_tampering(
    keyring: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    messages, _ = await keyring_trail(keyring, 4)
    wrong = tmp_path / "wrong" / "keyring.json"
    wrong.parent.mkdir()
    write_keyring(wrong)
    report = await opened(messages, wrong)
    assert kinds(report) == ["no_key"]
    assert not report.tampered
    assert "no record under key 'keyring:kek-1' opens" in report.findings[0].detail
    assert await verify_cli(monkeypatch, export(tmp_path, messages), keyring=wrong) == 2
    assert "6 records" in capsys.readouterr().out
    static = verify_trail(
        [m for m in messages if b'"digest"' not in m], keys={"keyring:kek-1": KEY}, strict=False
    )
    assert kinds(static) == ["no_key"]  # a static key that opens nothing: the same


async def test_retention_verifies_from_a_checkpoint(
    keyring: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    state_dir = tmp_path / "state-w1"
    state_dir.mkdir()
    state = TrailState(state_dir)
    first, _ = await keyring_trail(keyring, 3, state=state)
    running, audit = await keyring_trail(keyring, 4, state=state, stop=False)
    seen = list(first + running)  # what the topic held at the first audit
    file = export(tmp_path, seen, "january.jsonl")
    checkpoint = tmp_path / "checkpoint.json"
    assert await verify_cli(monkeypatch, file, "--save-checkpoint", str(checkpoint)) == 0
    assert "checkpoint of 1 workers saved" in capsys.readouterr().out
    for _ in range(3):
        await audit.record(OK)
    await audit.stop()
    later, _ = await keyring_trail(keyring, 2, state=state)
    topic = first + running + later  # `running` grew in place
    # retention dropped the oldest messages: some of the first trail, or all of it and
    # what the checkpoint covers of the second (its start record and first digest)
    for kept in (topic[2:], topic[len(first) + 2 :]):
        assert "deleted" in kinds(await opened(kept, keyring))
        file = export(tmp_path, kept, "february.jsonl")
        assert await verify_cli(monkeypatch, file, keyring=keyring) == 1
        capsys.readouterr()
        argv = ("--checkpoint", str(checkpoint))
        assert await verify_cli(monkeypatch, file, *argv, keyring=keyring) == 0
        assert "verified: no break" in capsys.readouterr().out
    # from the checkpoint on, a change is still found
    tampered = [m for i, m in enumerate(kept) if i != len(kept) - 3]
    file = export(tmp_path, tampered, "tampered.jsonl")
    assert await verify_cli(monkeypatch, file, "--checkpoint", str(checkpoint)) == 1


async def test_a_forged_digest_cannot_move_a_later_trail_behind_the_checkpoint(
    keyring: Path, tmp_path: Path
) -> None:
    a, b, c = await restarts(keyring, tmp_path, 3)
    checkpoint = Checkpoint((await opened(a + b, keyring)).latest)
    assert (await opened(c, keyring, checkpoint=checkpoint)).ok
    cut = [m for i, m in enumerate(c) if i != _record_positions(c)[2]]  # a record of c gone
    # a digest in the (unchecked) trail before the checkpoint naming c as its predecessor
    mallory = DigestSigner(
        LocalSigner(Ed25519PrivateKey.generate()),
        "w1",
        json.loads(a[1])["trail"],
        Previous(json.loads(c[1])["trail"]),
    )
    forged = await mallory.sign(0, "0" * 64, "0" * 64, "2026-01-01T00:00:00Z")
    report = await opened([forged, *a, *b, *cut], keyring, checkpoint=checkpoint)
    assert "deleted" in kinds(report)  # c is still checked


async def test_an_export_missing_messages_against_its_header_fails(
    keyring: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    messages, _ = await keyring_trail(keyring, 2)
    path = anyio.Path(export(tmp_path, messages))
    lines = (await path.read_text()).splitlines(keepends=True)
    await path.write_text("".join(lines[:-2]))  # the final digest's and the stop's lines gone
    assert await verify_cli(monkeypatch, str(path), "--no-strict") == 1
    out = capsys.readouterr().out
    assert f"the export's header counts {len(messages)} messages, the file holds" in out


async def test_a_trail_removed_from_a_signed_export_is_found(
    keyring: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    w1, _ = await keyring_trail(keyring, 2)
    w2, _ = await keyring_trail(keyring, 2, worker="w2")  # its only trail: nothing names it
    stored = [Stored(0, i, None, m) for i, m in enumerate(w1 + w2)]
    header = await sign_header(export_header("audit", stored), site_signer())
    path = tmp_path / "signed.jsonl"
    write_export(path, "audit", stored, header)
    assert await verify_cli(monkeypatch, str(path)) == 0
    # w2's trail removed, and the header's count mended: only the signed index tells
    lines = (await anyio.Path(path).read_text()).splitlines(keepends=True)
    mended = json.loads(lines[0]) | {"messages": len(w1)}
    await anyio.Path(path).write_text("".join([json.dumps(mended) + "\n", *lines[1 : len(w1) + 1]]))
    assert await verify_cli(monkeypatch, str(path)) == 1
    out = capsys.readouterr().out
    assert "bad_signature at the export's header" in out  # the count was changed
    mended["messages"] = len(w1) + len(w2)  # as signed: the signature holds, the index not
    await anyio.Path(path).write_text("".join([json.dumps(mended) + "\n", *lines[1 : len(w1) + 1]]))
    assert await verify_cli(monkeypatch, str(path)) == 1
    out = capsys.readouterr().out
    w2_trail = json.loads(w2[1])["trail"]
    assert f"the header lists of w2/{w2_trail} are gone" in out
    # an unsigned index is said to be so
    write_export(path, "audit", stored)
    assert await verify_cli(monkeypatch, str(path)) == 0
    assert "WARNING: unsigned at the export's header" in capsys.readouterr().out


class FlakySigner(LocalSigner):
    """The site key behind a key service that refuses its second request."""

    def __init__(self) -> None:
        super().__init__(SITE_KEY)
        self.calls = 0

    async def sign(self, data: bytes) -> bytes:
        self.calls += 1
        if self.calls == 2:
            raise KeyServiceError("KMS Sign: ThrottlingException")
        return await super().sign(data)


async def test_a_digest_the_key_service_did_not_sign_is_covered_by_the_next(
    keyring: Path,
) -> None:
    signer = FlakySigner()
    messages, _ = await keyring_trail(keyring, 5, signer=signer, audit_digest_records="2")
    digests = [json.loads(m) for m in messages if b'"digest"' in m]
    # the digest due after record 2 was refused: the next one, after record 3, covers 1..3
    assert [(d["first_seq"], d["last_seq"]) for d in digests] == [(0, 0), (1, 3), (4, 5), (6, 6)]
    report = await opened(messages, keyring)
    assert report.ok, report.findings
