"""Sealed, hash-chained audit records.

Each Kafka message on the audit topic is UTF-8 JSON::

    {"v": 1, "alg": "AES-256-GCM", "kid": KEY_ID, "nonce": B64, "aad": B64, "ct": B64}

B64 is standard base64 with padding. ``nonce`` is 12 random bytes (fresh for every
record), ``ct`` is the AES-256-GCM ciphertext with its 16-byte tag appended, and
``aad`` is the canonical JSON ``{"alg", "kid", "seq", "trail", "v", "worker"}`` that
was authenticated with it, so an envelope whose fields were swapped fails to open.
The plaintext is a canonical JSON record (keys sorted, no spaces, ASCII only) with the
object's identity and outcome; of the patient, only the Patient ID that the DICOM audit
message's Patient participant names (no names). Records of one trail (one
``AuditTrail``: a worker process, ``trail`` being random per instance so restarts do
not collide) form a hash chain: ``seq`` counts from 0 and ``prev`` is the hex SHA-256
of the previous record's plaintext ("" for the first), so a dropped, reordered or
altered record shows up in ``verify_chain``. A chain cannot reveal a truncated tail;
compare the last ``seq`` with the worker's own count for that.

Anyone holding the key can read a record without this package::

    import base64, json
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    env = json.loads(message)
    nonce, aad, ct = (base64.b64decode(env[f]) for f in ("nonce", "aad", "ct"))
    record = json.loads(AESGCM(key).decrypt(nonce, ct, aad))

Other AES-GCM APIs want the tag apart: it is ``ct[-16:]``, the ciphertext ``ct[:-16]``.

With envelope encryption (a keyring or KMS: ``keys.py``) the envelope also has
``"edk"``, the base64 of the data key as the key service wrapped it, and ``kid``
names the key-encryption key; unwrap the data key (KMS ``Decrypt`` with the
encryption context ``keys.context(worker, trail)`` read from ``aad``) and decrypt
as above. The trail changes data keys after ``rotate_records`` records or
``rotate_s`` seconds. Each record also carries ``dicom_audit``, the DICOM audit
message of the event (``model.py``), and the trail keeps a second running
hash, over the envelopes as sent (``envelope_head``), which the signed digests
(``digest.py``) cover so that a trail can be checked without its keys.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any, Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ingest.audit.keys import DataKey
from ingest.audit.model import EVENTS, Participant, audit_message
from ingest.errors import ConfigError, IngestError

VERSION: Final = 1
ALG: Final = "AES-256-GCM"
NONCE_BYTES: Final = 12
TAG_BYTES: Final = 16
KEY_BYTES: Final = 32
MAX_ENVELOPE_BYTES: Final = 1024 * 1024
ENVELOPE_FIELDS: Final = frozenset({"v", "alg", "kid", "nonce", "aad", "ct"})
ENVELOPE_HEAD_ZERO: Final = "0" * 64  # the envelope hash before a trail's first record
OUTCOMES: Final = frozenset({"success", "failure"})


class AuditVerificationError(IngestError):
    """An audit envelope is malformed, uses an unknown key, or fails authentication."""

    reason = "audit_verification"


@dataclass(frozen=True, slots=True)
class AuditEvent:
    """What the worker knows when it audits one object. ``error`` must not quote header
    values: give the exception class and reason code, never patient data."""

    event: str
    outcome: str
    bucket: str
    key: str
    etag: str | None
    version_id: str | None
    study_instance_uid: str | None = None
    series_instance_uid: str | None = None
    sop_instance_uid: str | None = None
    sop_class_uid: str | None = None
    patient_id: str | None = field(default=None, repr=False)  # sealed only, never logged
    reason: str | None = None
    error: str | None = None
    attempts: int = 1
    outputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be 'success' or 'failure', not {self.outcome!r}")
        if self.event not in EVENTS:
            raise ValueError(f"event must be one of {sorted(EVENTS)}, not {self.event!r}")
        if self.attempts < 0:
            raise ValueError("attempts must not be negative")


def canonical_json(obj: Mapping[str, Any]) -> bytes:
    """The one serialisation of records and AAD; decoding and re-encoding is stable."""
    return json.dumps(dict(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def record_digest(record: Mapping[str, Any]) -> str:
    """Hex SHA-256 of a record's plaintext, the value the next record's ``prev`` holds."""
    return hashlib.sha256(canonical_json(record)).hexdigest()


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _rfc3339(now: datetime) -> str:
    if now.tzinfo is None:
        raise ConfigError("audit clock must return timezone-aware datetimes")
    return now.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


_EVENT_FIELDS: Final = tuple(f.name for f in fields(AuditEvent))


class AuditTrail:
    """Sequences events of one worker into a hash chain and seals each one.

    Not thread-safe: call it from the event loop only (sealing is microseconds of
    CPU). ``seal`` advances the chain at once, so when producing the message fails,
    retry the same bytes; sealing the event again leaves a gap that ``verify_chain``
    reports.
    """

    def __init__(
        self,
        key: bytes | None,
        key_id: str,
        worker: str,
        clock: Callable[[], datetime] = _utcnow,
        *,
        s3_endpoint: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        if key is not None and (not isinstance(key, bytes) or len(key) != KEY_BYTES):
            raise ConfigError(f"audit key must be {KEY_BYTES} bytes")
        if not key_id or not worker:
            raise ConfigError("audit key id and worker id must not be empty")
        self._worker = worker
        self._clock = clock
        self._trail = os.urandom(8).hex()
        self._seq = 0
        self._prev = ""
        self._envelope_head = ENVELOPE_HEAD_ZERO
        self._me = Participant(worker, socket.gethostname(), os.getpid())
        self._s3_endpoint = s3_endpoint
        self._extra = dict(extra or {})  # fields of the next record only (the signing key)
        self._key: DataKey | None = None
        self._aead: AESGCM | None = None
        self._kid = key_id
        self._used = 0  # records sealed under the current data key
        self._nonces, self._nonces_at = b"", 0
        if key is not None:
            self.install(DataKey(key_id, key, None))

    def install(self, data_key: DataKey) -> None:
        """Seal the next records under ``data_key`` (a rotation, or the first key)."""
        if len(data_key.key) != KEY_BYTES:
            raise ConfigError(f"audit data key must be {KEY_BYTES} bytes")
        self._key, self._aead, self._kid = data_key, AESGCM(data_key.key), data_key.kid
        self._used = 0

    def needs_key(self, rotate_records: int, rotate_s: float, now: float) -> bool:
        """No data key yet, or the current one has sealed its count or reached its age.

        A static key (no ``edk``) never rotates: there is no other key to rotate to.
        """
        if self._key is None:
            return True
        if self._key.edk is None:
            return False
        return self._used >= rotate_records or now - self._key.created >= rotate_s

    def add_to_next(self, **fields_: Any) -> None:
        """Fields the next sealed record carries besides the event's (no patient data)."""
        self._extra.update(fields_)

    @property
    def worker(self) -> str:
        return self._worker

    @property
    def head(self) -> tuple[int, str, str]:
        """(last sealed seq, its plaintext SHA-256, the envelope running hash); seq -1: none."""
        return self._seq - 1, self._prev, self._envelope_head

    @property
    def trail(self) -> str:
        return self._trail

    @property
    def next_seq(self) -> int:
        """The ``seq`` the next sealed record gets (= records sealed so far)."""
        return self._seq

    def seal(self, event: AuditEvent) -> bytes:
        """Return the UTF-8 JSON envelope for ``event`` (the Kafka message value)."""
        if self._aead is None or self._key is None:
            raise ConfigError("audit trail has no data key yet (install one first)")
        now = self._clock()
        record = {name: getattr(event, name) for name in _EVENT_FIELDS}
        patient = record.pop("patient_id")  # in the A.5 message's Patient participant only
        record |= {"v": VERSION, "worker": self._worker, "trail": self._trail, "seq": self._seq}
        record |= {"prev": self._prev, "outputs": list(event.outputs), "time": _rfc3339(now)}
        record |= self._extra
        message_of = record | {"patient_id": patient}
        record["dicom_audit"] = audit_message(message_of, self._me, self._s3_endpoint)
        plaintext = canonical_json(record)
        head = {"v": VERSION, "alg": ALG, "kid": self._kid}
        aad = canonical_json(
            head | {"worker": self._worker, "trail": self._trail, "seq": self._seq}
        )
        nonce = self._nonce()
        ct = self._aead.encrypt(nonce, plaintext, aad)
        envelope = head | {"nonce": _b64(nonce), "aad": _b64(aad), "ct": _b64(ct)}
        if self._key.edk is not None:
            envelope["edk"] = _b64(self._key.edk)
        message = json.dumps(envelope, separators=(",", ":")).encode()
        self._seq += 1
        self._used += 1
        self._extra = {}
        self._prev = held_sha256(plaintext).hexdigest()
        self._envelope_head = envelope_step(self._envelope_head, message)
        return message

    def _nonce(self) -> bytes:
        """12 fresh random bytes, taken from one ``os.urandom`` draw per 256 records (each
        draw is a system call, which lets go of the GIL)."""
        if self._nonces_at >= len(self._nonces):
            self._nonces, self._nonces_at = os.urandom(NONCE_BYTES * 256), 0
        start, self._nonces_at = self._nonces_at, self._nonces_at + NONCE_BYTES
        return self._nonces[start : start + NONCE_BYTES]


def envelope_step(head: str, message: bytes) -> str:
    """The running hash over a trail's envelopes: SHA-256(previous head || SHA-256(message))."""
    digest = held_sha256(message).digest()
    return hashlib.sha256(bytes.fromhex(head) + digest).hexdigest()


_GIL_FREE_HASH_BYTES: Final = 2047  # hashlib lets other threads run from 2,048 bytes on


def held_sha256(data: bytes) -> Any:
    """SHA-256 of ``data`` (a record: a few KB) without letting go of the GIL.

    hashlib releases the GIL to hash 2 KiB or more; on the event loop, while the GET
    threads run Python, taking it back costs more than hashing a record, so the data
    goes in in pieces just under that size.
    """
    view = memoryview(data)
    digest = hashlib.sha256()
    for start in range(0, len(view), _GIL_FREE_HASH_BYTES):
        digest.update(view[start : start + _GIL_FREE_HASH_BYTES])
    return digest


def _fail(why: str) -> AuditVerificationError:
    return AuditVerificationError(f"audit envelope rejected: {why}")


def _json_object(data: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        raise _fail(f"{what} is not UTF-8 JSON") from None
    if not isinstance(obj, dict):
        raise _fail(f"{what} is not a JSON object")
    return obj


def _unb64(value: object, name: str) -> bytes:
    if not isinstance(value, str):
        raise _fail(f"{name} is not a string")
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (ValueError, binascii.Error):
        raise _fail(f"{name} is not base64") from None


DataKeyRef = tuple[str, str, str, str]
"""An envelope's data key as the key service knows it: (kid, edk, worker, trail), the
last two the encryption context; the same ``edk`` in another context is another key."""


def data_key_ref(env: Mapping[str, Any]) -> DataKeyRef | None:
    """The ``DataKeyRef`` of a parsed envelope with an ``edk``; None when malformed."""
    kid, edk = env.get("kid"), env.get("edk")
    if not isinstance(kid, str) or not isinstance(edk, str) or not isinstance(env.get("aad"), str):
        return None
    try:
        header = json.loads(base64.b64decode(env["aad"], validate=True))
    except (ValueError, binascii.Error, RecursionError):
        return None
    if not isinstance(header, dict):
        return None
    worker, trail = header.get("worker"), header.get("trail")
    if not isinstance(worker, str) or not isinstance(trail, str):
        return None
    return kid, edk, worker, trail


def open_envelope(
    message: bytes,
    keys: Mapping[str, bytes],
    data_keys: Mapping[DataKeyRef, bytes] | None = None,
) -> dict[str, Any]:
    """Decrypt and authenticate one audit message; return its plaintext record.

    ``keys`` maps a static key's ``kid`` to it; ``data_keys`` maps an envelope's
    ``data_key_ref`` to the unwrapped data key (``verify.unwrap_all``).

    Raises:
        AuditVerificationError: malformed envelope, unknown ``kid``, bad base64 or
            nonce, failed tag, or AAD/record fields that disagree with the envelope.
        ConfigError: the key registered for ``kid`` is not 32 bytes.
    """
    if len(message) > MAX_ENVELOPE_BYTES:
        raise _fail("message too large")
    env = _json_object(message, "message")
    if set(env) - {"edk"} != ENVELOPE_FIELDS:
        raise _fail(f"fields must be exactly {sorted(ENVELOPE_FIELDS)} (and edk)")
    v, alg, kid = env["v"], env["alg"], env["kid"]
    if type(v) is not int or v != VERSION or alg != ALG:
        raise _fail("unsupported version or algorithm")
    if "edk" in env:
        ref = data_key_ref(env)
        if ref is None or ref not in (data_keys or {}):
            raise _fail("unknown data key")
        key = (data_keys or {})[ref]
    elif not isinstance(kid, str) or kid not in keys:
        raise _fail("unknown key id")
    else:
        key = keys[kid]
    if len(key) != KEY_BYTES:
        raise ConfigError(f"audit key {kid!r} must be {KEY_BYTES} bytes")
    nonce, aad, ct = (_unb64(env[name], name) for name in ("nonce", "aad", "ct"))
    if len(nonce) != NONCE_BYTES or len(ct) < TAG_BYTES:
        raise _fail("bad nonce or ciphertext length")
    try:
        plaintext = AESGCM(key).decrypt(nonce, ct, aad)
    except InvalidTag:
        raise _fail("authentication failed") from None
    header = _json_object(aad, "aad")
    if (header.get("v"), header.get("alg"), header.get("kid")) != (v, alg, kid):
        raise _fail("aad does not match the envelope")
    record = _json_object(plaintext, "plaintext")
    for name in ("worker", "trail", "seq"):
        if name not in header or record.get(name) != header[name]:
            raise _fail(f"record {name} does not match the aad")
    return record


@dataclass(frozen=True, slots=True)
class ChainProblem:
    """One finding of ``verify_chain``; ``seq`` is the record it was noticed at."""

    worker: str
    trail: str
    seq: int | None
    kind: str  # "missing" | "break" | "out_of_order" | "conflict" | "malformed"
    detail: str


@dataclass(frozen=True, slots=True)
class ChainReport:
    """Counts per kind of finding, and the findings; ``ok`` when there are none."""

    records: int
    trails: int
    missing: int  # seq numbers absent from a trail
    breaks: int  # records whose prev is not the digest of their predecessor
    out_of_order: int  # records that arrived after a higher seq of their trail
    duplicates: int  # identical copies (at-least-once delivery); not a problem
    malformed: int
    problems: tuple[ChainProblem, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems


def _identity(rec: Mapping[str, Any]) -> tuple[str, str, int] | None:
    worker, trail, seq, prev = (rec.get(f) for f in ("worker", "trail", "seq", "prev"))
    if not (isinstance(worker, str) and isinstance(trail, str) and isinstance(prev, str)):
        return None
    return (worker, trail, seq) if type(seq) is int and seq >= 0 else None


def verify_chain(records: Iterable[Mapping[str, Any]], *, from_start: bool = True) -> ChainReport:
    """Check opened records, in arrival order, trail by trail.

    With ``from_start=False`` (a topic whose retention dropped the head) a trail may
    begin at any ``seq`` and its first ``prev`` is not checked.
    """
    problems: list[ChainProblem] = []
    trails: dict[tuple[str, str], dict[int, Mapping[str, Any]]] = {}
    highest: dict[tuple[str, str], int] = {}
    count = duplicates = malformed = out_of_order = 0
    for rec in records:
        count += 1
        ident = _identity(rec)
        if ident is None:
            malformed += 1
            problems.append(ChainProblem("?", "?", None, "malformed", "bad worker/trail/seq/prev"))
            continue
        worker, trail, seq = ident
        tid = (worker, trail)
        seen = trails.setdefault(tid, {})
        if seq in seen:
            if record_digest(seen[seq]) == record_digest(rec):
                duplicates += 1
            else:
                problems.append(ChainProblem(worker, trail, seq, "conflict", "two records"))
            continue
        if seq < highest.get(tid, -1):
            out_of_order += 1
            problems.append(ChainProblem(worker, trail, seq, "out_of_order", "arrived late"))
        highest[tid] = max(seq, highest.get(tid, -1))
        seen[seq] = rec
    missing = breaks = 0
    for (worker, trail), seen in trails.items():
        expected = 0 if from_start else min(seen)
        prev_digest: str | None = "" if from_start else None
        for seq in sorted(seen):
            if seq != expected:
                missing += seq - expected
                gap = f"{expected}..{seq - 1}"
                problems.append(ChainProblem(worker, trail, seq, "missing", gap))
                prev_digest = None  # the predecessor is gone; its digest is unknown
            if prev_digest is not None and seen[seq]["prev"] != prev_digest:
                breaks += 1
                problems.append(ChainProblem(worker, trail, seq, "break", "prev mismatch"))
            prev_digest = record_digest(seen[seq])
            expected = seq + 1
    return ChainReport(
        count, len(trails), missing, breaks, out_of_order, duplicates, malformed, tuple(problems)
    )
