"""Signed chain heads: the trail's digest messages (Ed25519), as CloudTrail's digest files.

Every ``audit_digest_records`` records or ``audit_digest_s`` seconds, and when the
worker stops, the trail puts a digest on the audit topic, in line with its
records (same key, same partition). A digest is the one audit message that is
not encrypted: it holds no patient data, only hashes. It is UTF-8 JSON::

    {"type": "digest", "v": 1, "alg": "Ed25519", "worker": W, "trail": T,
     "digest_seq": N, "first_seq": A, "last_seq": B, "chain_head": HEX,
     "envelope_head": HEX, "prev_digest": HEX, "time": RFC3339,
     "public_key": B64, "sig": B64}

covering the trail's records ``A..B`` (``B = A - 1`` when none came since the last
digest). ``chain_head`` is the SHA-256 of record B's plaintext (what record B+1's
``prev`` holds), ``envelope_head`` the running hash over the envelopes 0..B as
sent (``records.envelope_step``), which anyone can recompute without a key;
``prev_digest`` is the SHA-256 of the previous digest's signed bytes ("" for
digest 0), so digests chain too and a missing one shows. ``sig`` is the Ed25519
signature of the canonical JSON of every other field. ``public_key`` is the raw
32-byte key; a verifier pins it (``audit verify --public-key``) or trusts the key
the trail announced in its first record (encrypted and chained, so a forger
needs the data key as well).
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ingest.errors import ConfigError

DIGEST_FIELDS: Final = frozenset(
    {"type", "v", "alg", "worker", "trail", "digest_seq", "first_seq", "last_seq"}
    | {"chain_head", "envelope_head", "prev_digest", "time", "public_key", "sig"}
)


def _canonical(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def load_signing_key(path: Path | None) -> Ed25519PrivateKey:
    """The Ed25519 key in a PEM file (PKCS#8, unencrypted), or a fresh one per trail.

    Raises:
        ConfigError: the file is not an Ed25519 private key.
    """
    if path is None:
        return Ed25519PrivateKey.generate()
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
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
    import os

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(pem)
    public = key.public_key()
    pub_pem = public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    path.with_name(path.name + ".pub").write_bytes(pub_pem)
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def load_public_key(path: Path) -> bytes:
    """The raw 32 bytes of an Ed25519 public key in a PEM file.

    Raises:
        ConfigError: not an Ed25519 public key.
    """
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--public-key {path}: {type(exc).__name__}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"--public-key {path}: not an Ed25519 public key")
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def raw_public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class DigestSigner:
    """Signs one trail's digests in order; remembers what the next one continues from."""

    def __init__(self, key: Ed25519PrivateKey, worker: str, trail: str) -> None:
        self._key = key
        self._public = base64.b64encode(raw_public(key)).decode()
        self._worker, self._trail = worker, trail
        self._next = 0
        self._first_seq = 0
        self._prev = ""

    @property
    def public_key(self) -> str:
        """Base64 of the raw public key (published in the trail's first record)."""
        return self._public

    @property
    def covered(self) -> int:
        """The first seq not yet covered by a digest."""
        return self._first_seq

    def sign(self, last_seq: int, chain_head: str, envelope_head: str, time: str) -> bytes:
        """The digest message covering records up to ``last_seq`` (the Kafka value)."""
        body = {
            "type": "digest",
            "v": 1,
            "alg": "Ed25519",
            "worker": self._worker,
            "trail": self._trail,
            "digest_seq": self._next,
            "first_seq": self._first_seq,
            "last_seq": last_seq,
            "chain_head": chain_head,
            "envelope_head": envelope_head,
            "prev_digest": self._prev,
            "time": time,
            "public_key": self._public,
        }
        signed = _canonical(body)
        body["sig"] = base64.b64encode(self._key.sign(signed)).decode()
        self._next += 1
        self._first_seq = last_seq + 1
        self._prev = hashlib.sha256(signed).hexdigest()
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


def read_digest(obj: dict[str, Any]) -> Digest | None:
    """Check a parsed digest message's shape and signature; None when it is no digest."""
    if set(obj) != DIGEST_FIELDS or obj.get("alg") != "Ed25519":
        return None
    ints = ("digest_seq", "first_seq", "last_seq")
    if not all(type(obj[f]) is int for f in ints) or not all(
        isinstance(obj[f], str) for f in DIGEST_FIELDS - set(ints) - {"v"}
    ):
        return None
    body = {k: v for k, v in obj.items() if k != "sig"}
    signed = _canonical(body)
    try:
        public = Ed25519PublicKey.from_public_bytes(
            base64.b64decode(obj["public_key"], validate=True)
        )
        public.verify(base64.b64decode(obj["sig"], validate=True), signed)
        valid = True
    except (InvalidSignature, ValueError):
        valid = False
    return Digest(obj, valid, hashlib.sha256(signed).hexdigest())
