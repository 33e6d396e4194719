"""Signed chain heads: the trail's digest messages, as CloudTrail's digest files.

Every ``audit_digest_records`` records, every ``audit_digest_s`` seconds whether
records came or not (a heartbeat: an idle worker and a cut tail differ), and
when the worker stops (``final``), the trail puts a digest on the audit topic,
in line with its records (same key, same partition). A digest is the one audit
message that is not encrypted: it holds no patient data, only hashes. It is
UTF-8 JSON::

    {"type": "digest", "v": 2, "alg": ALG, "key_id": K, "worker": W, "trail": T,
     "digest_seq": N, "first_seq": A, "last_seq": B, "chain_head": HEX,
     "envelope_head": HEX, "prev_digest": HEX, "prev_trail": P, "prev_seq": S,
     "prev_head": HEX, "time": RFC3339, "heartbeat_s": SECONDS, "final": BOOL,
     "public_key": B64, "sig": B64}

covering the trail's records ``A..B`` (``B = A - 1`` when none came since the last
digest). ``chain_head`` is the SHA-256 of record B's plaintext (what record B+1's
``prev`` holds), ``envelope_head`` the running hash over the envelopes 0..B as
sent (``records.envelope_step``), which anyone can recompute without a key;
``prev_digest`` is the SHA-256 of the previous digest's signed bytes, so digests
chain too and a missing one shows. A trail's digest 0 continues the worker's
previous trail instead: ``prev_digest`` is that trail's last digest known to the
worker ("" for a worker's first trail), and every digest of the trail names the
previous trail (``prev_trail``), how far its records were acknowledged
(``prev_seq``, -1 for none) and their envelope head there (``prev_head``), so a
missing, swapped or cut trail breaks the worker's chain of trails, and the
records a killed worker left after its last digest are signed by its successor.

``sig`` signs the canonical JSON of every other field with the site's key,
which lives outside the trail: ``alg`` ``Ed25519`` (a key file,
``AUDIT_SIGNING_KEY_FILE``; ``public_key`` the raw 32 bytes) or ``ECDSA_SHA_256``
(an asymmetric KMS key, ``AUDIT_SIGNING_KMS_KEY_ID``, whose private half never
leaves KMS; ``key_id`` its ARN, ``public_key`` the DER SubjectPublicKeyInfo). A
verifier pins the public key (``audit verify --public-key``, or the KMS key id).
Without either, each trail makes an Ed25519 key of its own and announces it in
its first (encrypted, chained) record: for development only, as a reader can
trust such a key only on first use.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ingest.errors import ConfigError

VERSION: Final = 2
ED25519: Final = "Ed25519"
ECDSA: Final = "ECDSA_SHA_256"
_INTS: Final = ("digest_seq", "first_seq", "last_seq", "prev_seq")
_TEXTS: Final = (
    *("type", "alg", "key_id", "worker", "trail", "chain_head", "envelope_head"),
    *("prev_digest", "prev_trail", "prev_head", "time", "public_key", "sig"),
)
DIGEST_FIELDS: Final = frozenset({"v", "heartbeat_s", "final", *_INTS, *_TEXTS})


def canonical(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def private_file(path: Path, what: str) -> bytes:
    """The bytes of a secret file that only its owner may read.

    Raises:
        ConfigError: unreadable, or group or others have any access to it.
    """
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{what} {path}: readable by others; chmod 600 it")
    return data


class Signer(Protocol):
    """Signs digests with a key the trail's writer does not choose."""

    @property
    def alg(self) -> str: ...

    @property
    def key_id(self) -> str: ...

    @property
    def public_key(self) -> str:
        """Base64 of the public key as digests carry it."""
        ...

    async def sign(self, data: bytes) -> bytes: ...

    async def aclose(self) -> None: ...


class LocalSigner:
    """An Ed25519 key in this process: the site's key file, or one made for this trail."""

    alg = ED25519
    key_id = ""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public_key = base64.b64encode(raw_public(key)).decode()

    async def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    async def aclose(self) -> None:
        return None


class KmsSigner:
    """An asymmetric KMS key (ECC_NIST_P256, SIGN_VERIFY): ``kms:Sign`` of each digest."""

    alg = ECDSA

    def __init__(self, kms: Any, key_id: str, public_der: bytes) -> None:
        self._kms = kms
        self.key_id = key_id
        self.public_key = base64.b64encode(public_der).decode()

    async def sign(self, data: bytes) -> bytes:
        from ingest.audit.keys import translate_kms_error

        try:
            kms = await self._kms.client()
            answer = await kms.sign(
                KeyId=self.key_id, Message=data, MessageType="RAW", SigningAlgorithm=ECDSA
            )
        except Exception as exc:
            raise translate_kms_error(exc, "Sign") from exc
        return bytes(answer["Signature"])

    async def aclose(self) -> None:
        await self._kms.aclose()


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    """The Ed25519 key in a PEM file (PKCS#8, unencrypted, mode 600).

    Raises:
        ConfigError: readable by others, or not an Ed25519 private key.
    """
    pem = private_file(path, "DICOM_INGEST_AUDIT_SIGNING_KEY_FILE")
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"DICOM_INGEST_AUDIT_SIGNING_KEY_FILE: {type(exc).__name__}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError("DICOM_INGEST_AUDIT_SIGNING_KEY_FILE: not an Ed25519 private key")
    return key


def write_signing_key(path: Path) -> bytes:
    """A new Ed25519 key as PEM (mode 600) and its public half as ``path.pub``; the raw
    public key is returned (``audit verify --public-key`` takes the ``.pub`` file)."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(pem)
    public = key.public_key()
    pub_pem = public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    path.with_name(path.name + ".pub").write_bytes(pub_pem)
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_key_text(der_or_pem: bytes) -> str:
    """A public key as digests carry it (base64 of Ed25519's raw 32 bytes, or of a P-256
    key's DER SubjectPublicKeyInfo), from PEM or DER.

    Raises:
        ConfigError: neither an Ed25519 nor a P-256 public key.
    """
    try:
        if der_or_pem.lstrip().startswith(b"-----"):
            key = serialization.load_pem_public_key(der_or_pem)
        else:
            key = serialization.load_der_public_key(der_or_pem)
    except ValueError as exc:
        raise ConfigError(f"not a public key: {exc}") from None
    if isinstance(key, Ed25519PublicKey):
        raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    elif isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1):
        raw = key.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    else:
        raise ConfigError("not an Ed25519 or P-256 public key")
    return base64.b64encode(raw).decode()


def load_public_key(path: Path) -> str:
    """``public_key_text`` of a PEM file (``audit verify --public-key``).

    Raises:
        ConfigError: unreadable, or no Ed25519 or P-256 public key.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--public-key {path}: {exc.strerror}") from None
    try:
        return public_key_text(data)
    except ConfigError as exc:
        raise ConfigError(f"--public-key {path}: {exc}") from None


def raw_public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass(frozen=True, slots=True)
class Previous:
    """Where the worker's previous trail ended, as far as this worker knows it."""

    trail: str = ""
    digest: str = ""  # SHA-256 of its last digest's signed bytes
    seq: int = -1  # its last acknowledged record
    head: str = ""  # the envelope head there


class DigestSigner:
    """Signs one trail's digests in order; remembers what the next one continues from."""

    def __init__(
        self,
        signer: Signer,
        worker: str,
        trail: str,
        previous: Previous = Previous(),
        heartbeat_s: float = 60.0,
    ) -> None:
        self._signer = signer
        self._worker, self._trail = worker, trail
        self._previous = previous
        self._heartbeat = heartbeat_s
        self._next = 0
        self._first_seq = 0
        self._prev = previous.digest
        self.finished = False

    @property
    def public_key(self) -> str:
        """Base64 of the public key (published in the trail's first record)."""
        return self._signer.public_key

    @property
    def previous(self) -> Previous:
        """The worker's previous trail, as this trail's digests name it."""
        return self._previous

    @property
    def covered(self) -> int:
        """The first seq not yet covered by a digest."""
        return self._first_seq

    @property
    def last_digest(self) -> str:
        """SHA-256 of the last signed digest's signed bytes ("" before the first)."""
        return self._prev

    async def sign(
        self, last_seq: int, chain_head: str, envelope_head: str, time: str, final: bool = False
    ) -> bytes:
        """The digest message covering records up to ``last_seq`` (the Kafka value).

        Raises:
            KeyServiceError: KMS did not sign.
        """
        p = self._previous
        body: dict[str, Any] = {
            "type": "digest",
            "v": VERSION,
            "alg": self._signer.alg,
            "key_id": self._signer.key_id,
            "worker": self._worker,
            "trail": self._trail,
            "digest_seq": self._next,
            "first_seq": self._first_seq,
            "last_seq": last_seq,
            "chain_head": chain_head,
            "envelope_head": envelope_head,
            "prev_digest": self._prev,
            "prev_trail": p.trail,
            "prev_seq": p.seq,
            "prev_head": p.head,
            "time": time,
            "heartbeat_s": self._heartbeat,
            "final": final,
            "public_key": self._signer.public_key,
        }
        signed = canonical(body)
        body["sig"] = base64.b64encode(await self._signer.sign(signed)).decode()
        self._next += 1
        self._first_seq = last_seq + 1
        self._prev = hashlib.sha256(signed).hexdigest()
        self.finished = final
        return json.dumps(body, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class Digest:
    """A digest message as read back, with its signature checked (``valid``)."""

    body: dict[str, Any]
    valid: bool
    signed_sha256: str  # what the next digest's ``prev_digest`` holds

    @property
    def public_key(self) -> str:
        return str(self.body["public_key"])

    @property
    def seq(self) -> int:
        return int(self.body["digest_seq"])


def signature_ok(alg: str, public_b64: str, sig_b64: str, signed: bytes) -> bool:
    try:
        public = base64.b64decode(public_b64, validate=True)
        sig = base64.b64decode(sig_b64, validate=True)
        if alg == ED25519:
            Ed25519PublicKey.from_public_bytes(public).verify(sig, signed)
            return True
        key = serialization.load_der_public_key(public)
        if not isinstance(key, ec.EllipticCurvePublicKey):
            return False
        key.verify(sig, signed, ec.ECDSA(hashes.SHA256()))
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


def read_digest(obj: dict[str, Any]) -> Digest | None:
    """Check a parsed digest message's shape and signature; None when it is no digest."""
    if (
        set(obj) != DIGEST_FIELDS
        or obj.get("v") != VERSION
        or obj.get("alg")
        not in (
            ED25519,
            ECDSA,
        )
    ):
        return None
    if not all(type(obj[f]) is int for f in _INTS) or not all(
        isinstance(obj[f], str) for f in _TEXTS
    ):
        return None
    if type(obj["final"]) is not bool or type(obj["heartbeat_s"]) not in (int, float):
        return None
    body = {k: v for k, v in obj.items() if k != "sig"}
    signed = canonical(body)
    valid = signature_ok(obj["alg"], obj["public_key"], obj["sig"], signed)
    return Digest(obj, valid, hashlib.sha256(signed).hexdigest())
