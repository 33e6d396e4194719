"""Audit envelopes: format, authentication, hash chain."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ingest.audit.records import (
    AuditEvent,
    AuditTrail,
    AuditVerificationError,
    open_envelope,
    record_digest,
    verify_chain,
)
from ingest.errors import ConfigError, IngestError

KEY = bytes(range(32))
KID = "k1"
KEYS = {KID: KEY}
T0 = datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=UTC)

OK = AuditEvent(
    event="object.processed",
    outcome="success",
    bucket="scans",
    key="ct/1.dcm",
    etag='"abc"',
    version_id=None,
    study_instance_uid="1.2.3",
    series_instance_uid="1.2.3.4",
    sop_instance_uid="1.2.3.4.5",
    outputs=("out/1.npy", "out/1.json"),
)
DEAD = AuditEvent(
    event="object.dead_lettered",
    outcome="failure",
    bucket="scans",
    key="ct/2.dcm",
    etag=None,
    version_id="v7",
    reason="not_dicom",
    error="NotDicom",
    attempts=3,
)


def trail(worker: str = "w1") -> AuditTrail:
    return AuditTrail(KEY, KID, worker, clock=lambda: T0)


def envelope(msg: bytes) -> dict[str, Any]:
    env = json.loads(msg)
    assert isinstance(env, dict)
    return env


def reencode(env: dict[str, Any]) -> bytes:
    return json.dumps(env).encode()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_round_trip_success_and_failure() -> None:
    t = trail()
    ok, dead = open_envelope(t.seal(OK), KEYS), open_envelope(t.seal(DEAD), KEYS)
    assert ok["event"] == "object.processed"
    assert ok["outcome"] == "success"
    assert ok["time"] == "2024-05-01T12:00:00.123456Z"
    assert (ok["worker"], ok["seq"], ok["prev"]) == ("w1", 0, "")
    assert (ok["bucket"], ok["key"], ok["etag"], ok["version_id"]) == (
        "scans",
        "ct/1.dcm",
        '"abc"',
        None,
    )
    assert ok["sop_instance_uid"] == "1.2.3.4.5"
    assert ok["outputs"] == ["out/1.npy", "out/1.json"]
    assert dead["outcome"] == "failure"
    assert (dead["reason"], dead["error"], dead["attempts"]) == ("not_dicom", "NotDicom", 3)
    assert dead["study_instance_uid"] is None
    assert (dead["seq"], dead["prev"]) == (1, record_digest(ok))
    assert dead["trail"] == ok["trail"] == t.trail
    assert t.next_seq == 2


def test_time_is_rfc3339_utc_from_any_zone() -> None:
    plus2 = timezone(timedelta(hours=2))
    t = AuditTrail(KEY, KID, "w", clock=lambda: datetime(2024, 1, 1, 14, 0, tzinfo=plus2))
    assert open_envelope(t.seal(OK), KEYS)["time"] == "2024-01-01T12:00:00.000000Z"
    naive = AuditTrail(KEY, KID, "w", clock=lambda: datetime(2024, 1, 1))
    with pytest.raises(ConfigError):
        naive.seal(OK)


def test_envelope_has_exactly_design_fields_and_opens_with_plain_aes_gcm() -> None:
    msg = trail().seal(OK)
    env = envelope(msg)
    assert set(env) == {"v", "alg", "kid", "nonce", "aad", "ct"}
    assert (env["v"], env["alg"], env["kid"]) == (1, "AES-256-GCM", KID)
    nonce, aad, ct = (base64.b64decode(env[f], validate=True) for f in ("nonce", "aad", "ct"))
    # The one-shot AEAD API, as a user would call it ...
    record = json.loads(AESGCM(KEY).decrypt(nonce, ct, aad))
    # ... and the streaming GCM API with a detached tag, as most other libraries want it.
    dec = Cipher(algorithms.AES(KEY), modes.GCM(nonce, ct[-16:])).decryptor()
    dec.authenticate_additional_data(aad)
    assert json.loads(dec.update(ct[:-16]) + dec.finalize()) == record == open_envelope(msg, KEYS)
    header = json.loads(aad)
    assert header == {
        "v": 1,
        "alg": "AES-256-GCM",
        "kid": KID,
        "worker": "w1",
        "trail": record["trail"],
        "seq": 0,
    }


def test_no_patient_fields() -> None:
    record = open_envelope(trail().seal(OK), KEYS)
    assert not {k for k in record if "patient" in k.lower() or "name" in k.lower()}


def test_nonce_is_12_random_bytes_per_record() -> None:
    t = trail()
    nonces = [base64.b64decode(envelope(t.seal(OK))["nonce"]) for _ in range(50)]
    assert all(len(n) == 12 for n in nonces)
    assert len(set(nonces)) == 50


def flip(data: str) -> str:
    raw = bytearray(base64.b64decode(data))
    raw[len(raw) // 2] ^= 0x01
    return b64(bytes(raw))


@pytest.mark.parametrize("field", ["ct", "aad", "nonce"])
def test_tampered_bytes_fail(field: str) -> None:
    env = envelope(trail().seal(OK))
    env[field] = flip(env[field])
    with pytest.raises(AuditVerificationError):
        open_envelope(reencode(env), KEYS)


def test_tampered_kid_fails_even_when_that_key_exists() -> None:
    env = envelope(trail().seal(OK))
    env["kid"] = "k2"
    with pytest.raises(AuditVerificationError, match="unknown key"):
        open_envelope(reencode(env), KEYS)
    # Same key under a second id: the tag holds, but the authenticated kid does not match.
    with pytest.raises(AuditVerificationError, match="aad does not match"):
        open_envelope(reencode(env), {**KEYS, "k2": KEY})


def test_swapped_aad_from_another_record_fails() -> None:
    t = trail()
    first, second = envelope(t.seal(OK)), envelope(t.seal(OK))
    second["aad"] = first["aad"]
    with pytest.raises(AuditVerificationError):
        open_envelope(reencode(second), KEYS)


def test_aad_that_disagrees_with_record_fails() -> None:
    # Someone holding the key seals a record under another worker's aad.
    record = open_envelope(trail().seal(OK), KEYS)
    aad = json.dumps(
        {
            "v": 1,
            "alg": "AES-256-GCM",
            "kid": KID,
            "worker": "w9",
            "trail": record["trail"],
            "seq": 0,
        }
    ).encode()
    nonce = bytes(12)
    ct = AESGCM(KEY).encrypt(nonce, json.dumps(record).encode(), aad)
    env = {
        "v": 1,
        "alg": "AES-256-GCM",
        "kid": KID,
        "nonce": b64(nonce),
        "aad": b64(aad),
        "ct": b64(ct),
    }
    with pytest.raises(AuditVerificationError, match="worker"):
        open_envelope(reencode(env), KEYS)


def test_wrong_key_fails() -> None:
    with pytest.raises(AuditVerificationError, match="authentication"):
        open_envelope(trail().seal(OK), {KID: bytes(32)})


@pytest.mark.parametrize(
    "change",
    [
        {"v": 2},
        {"v": True},
        {"alg": "AES-128-GCM"},
        {"nonce": b64(bytes(8))},
        {"nonce": "not base64!"},
        {"ct": b64(bytes(15))},
        {"ct": 7},
        {"edk": "x"},
    ],
)
def test_malformed_envelopes_fail(change: dict[str, Any]) -> None:
    env = envelope(trail().seal(OK)) | change
    with pytest.raises(AuditVerificationError):
        open_envelope(reencode(env), KEYS)


def test_bad_keys_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        AuditTrail(bytes(16), KID, "w")
    with pytest.raises(ConfigError):
        AuditTrail(KEY, "", "w")
    with pytest.raises(ConfigError):
        open_envelope(trail().seal(OK), {KID: bytes(16)})


def test_event_validation() -> None:
    with pytest.raises(ValueError, match="outcome"):
        AuditEvent("object.processed", "ok", "b", "k", None, None)


def chain(n: int, worker: str = "w1") -> list[dict[str, Any]]:
    t = trail(worker)
    return [open_envelope(t.seal(OK if i % 2 else DEAD), KEYS) for i in range(n)]


def test_intact_chains_of_several_workers_verify() -> None:
    a, b = chain(5, "w1"), chain(3, "w2")
    interleaved = [a[0], b[0], a[1], a[2], b[1], a[3], b[2], a[4]]
    report = verify_chain(interleaved)
    assert report.ok
    assert (report.records, report.trails) == (8, 2)


def test_restarted_worker_gets_a_new_trail() -> None:
    report = verify_chain(chain(3, "w1") + chain(2, "w1"))
    assert report.ok
    assert report.trails == 2


def test_dropped_record_is_detected() -> None:
    records = chain(5)
    del records[2]
    report = verify_chain(records)
    assert not report.ok
    assert report.missing == 1
    assert [(p.kind, p.seq) for p in report.problems] == [("missing", 3)]


def test_dropped_first_record_is_detected_unless_head_expired() -> None:
    records = chain(4)[1:]
    assert verify_chain(records).missing == 1
    assert verify_chain(records, from_start=False).ok


def test_reordered_records_are_detected() -> None:
    records = chain(5)
    records[1], records[3] = records[3], records[1]
    report = verify_chain(records)
    assert report.out_of_order >= 1
    assert {p.kind for p in report.problems} == {"out_of_order"}


def test_modified_record_breaks_the_chain() -> None:
    records = chain(5)
    records[2] = records[2] | {"outcome": "success", "reason": None}
    report = verify_chain(records)
    assert report.breaks == 1
    assert [(p.kind, p.seq) for p in report.problems] == [("break", 3)]


def test_resealed_fork_is_a_conflict() -> None:
    records = chain(3)
    report = verify_chain([*records, records[1] | {"key": "other"}])
    assert [p.kind for p in report.problems] == ["conflict"]


def test_duplicates_are_counted_not_problems() -> None:
    records = chain(3)
    report = verify_chain([*records, dict(records[1])])
    assert report.ok
    assert report.duplicates == 1


def test_malformed_records_are_reported() -> None:
    report = verify_chain([*chain(2), {"worker": "w1", "seq": "3"}, {}])
    assert report.malformed == 2
    assert not report.ok


def test_error_is_an_ingest_error() -> None:
    assert issubclass(AuditVerificationError, IngestError)
    assert AuditVerificationError.reason == "audit_verification"
    assert not AuditVerificationError.retriable


@given(st.binary(max_size=2048))
def test_arbitrary_bytes_only_raise_the_module_error(data: bytes) -> None:
    with pytest.raises(AuditVerificationError):
        open_envelope(data, KEYS)


# The first st.text() of a fresh checkout builds Hypothesis' unicode tables (~1 s).
fresh_ok = settings(suppress_health_check=[HealthCheck.too_slow])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=10,
)
b64_text = st.binary(max_size=64).map(b64)
SEALED = envelope(trail().seal(OK))


@fresh_ok
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "v": st.just(1) | json_values,
            "alg": st.just("AES-256-GCM") | json_values,
            "kid": st.just(KID) | json_values,
            "nonce": st.just(SEALED["nonce"]) | b64_text | json_values,
            "aad": st.just(SEALED["aad"]) | b64_text | json_values,
            "ct": st.just(SEALED["ct"]) | b64_text | json_values,
        },
    )
)
def test_arbitrary_envelope_shapes_only_raise_the_module_error(env: dict[str, Any]) -> None:
    try:
        record = open_envelope(json.dumps(env).encode(), KEYS)
    except AuditVerificationError:
        return
    assert record == open_envelope(reencode(SEALED), KEYS)


@given(st.integers(0, len(reencode(SEALED)) - 1), st.integers(1, 255))
def test_any_flipped_byte_is_rejected(pos: int, mask: int) -> None:
    raw = bytearray(reencode(SEALED))
    raw[pos] ^= mask
    try:
        record = open_envelope(bytes(raw), KEYS)
    except AuditVerificationError:
        return
    # A flip can only survive where JSON does not care (e.g. whitespace, escapes).
    assert record == open_envelope(reencode(SEALED), KEYS)


@fresh_ok
@given(st.text(), st.text())
def test_records_reencode_to_their_plaintext(bucket: str, key: str) -> None:
    t = trail()
    first = open_envelope(t.seal(OK), KEYS)
    event = AuditEvent("object.processed", "success", bucket, key, None, None)
    second = open_envelope(t.seal(event), KEYS)
    third = open_envelope(t.seal(OK), KEYS)
    assert (second["bucket"], second["key"]) == (bucket, key)
    assert verify_chain([first, second, third]).ok
