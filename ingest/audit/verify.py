"""Verifying a whole audit trail (a topic or an exported file): what ``audit verify`` runs.

Messages are checked trail by trail in the order they were stored. Without
any key the verifier still reads each envelope's ``aad`` (worker, trail, seq),
recomputes the running hash over the envelopes and checks it against the
signed digests; with the keys it also decrypts every record and checks the
plaintext hash chain, which names a changed record exactly. Findings carry
the position of the message where they were noticed, and the first one in
stored order is the first break. Kinds:

- ``changed``: a record that fails authentication, whose successor's ``prev``
  does not match it, or a digest range whose hash does not match the records;
- ``deleted``: seq numbers that never arrive; ``reordered``: a record stored
  after a later one of its trail; ``inserted``: a second, different message
  with a seq already seen, or a message that is no record or digest at all;
- ``bad_signature``, ``untrusted_key``: a digest that does not verify, or is
  signed by a key that is neither pinned nor the one the trail announced;
- ``digest_gap``: digests missing between two (their seq or records skipped),
  or a trail that recorded its stop but has no digest after it.

Identical copies (at-least-once delivery) are duplicates, not findings. The
records after a trail's last digest are reported as its unsigned tail (a
running or killed worker's): a chain cannot show a tail cut off there.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ingest.audit.digest import Digest, read_digest
from ingest.audit.keys import KeySource, context
from ingest.audit.records import (
    ENVELOPE_HEAD_ZERO,
    AuditVerificationError,
    open_envelope,
    record_digest,
)
from ingest.errors import KeyServiceError


@dataclass(frozen=True, slots=True)
class Finding:
    position: int  # index of the message in stored order
    where: str  # e.g. "partition 0 offset 17"
    kind: str
    trail: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} at {self.where} (trail {self.trail}): {self.detail}"


@dataclass(slots=True)
class TrailSummary:
    worker: str
    trail: str
    records: int = 0
    digests: int = 0
    signed_through: int = -1  # the last seq a valid digest covers
    last_seq: int = -1


@dataclass(slots=True)
class Verification:
    """What ``verify_trail`` found; ``ok`` when nothing. ``records`` are the decrypted ones."""

    messages: int = 0
    duplicates: int = 0
    findings: list[Finding] = field(default_factory=list)
    trails: dict[tuple[str, str], TrailSummary] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    decrypted: bool = False

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def first_break(self) -> Finding | None:
        return min(self.findings, key=lambda f: f.position) if self.findings else None


@dataclass(slots=True)
class _Item:
    position: int
    message: bytes
    seq: int | None = None  # a record's
    digest: Digest | None = None


def _aad(env: Mapping[str, Any]) -> dict[str, Any] | None:
    try:
        header = json.loads(base64.b64decode(str(env["aad"]), validate=True))
    except (KeyError, ValueError, binascii.Error, RecursionError):
        return None
    ok = isinstance(header, dict) and type(header.get("seq")) is int and header["seq"] >= 0
    ok = ok and all(isinstance(header.get(k), str) for k in ("worker", "trail"))
    return header if ok else None


def _parse(message: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(message.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def object_records(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The records about objects and notifications, without the application's start/stop."""
    return [dict(r) for r in records if not str(r.get("event", "")).startswith("application.")]


async def unwrap_all(messages: Iterable[bytes], source: KeySource) -> dict[str, bytes]:
    """Unwrap every distinct data key of the envelopes once (``open_envelope``'s
    ``data_keys``); one that the key service refuses is left out, and its records
    then fail to open (a finding)."""
    keys: dict[str, bytes] = {}
    refused: set[str] = set()
    for message in messages:
        env = _parse(message)
        if env is None or not isinstance(env.get("edk"), str) or env["edk"] in keys:
            continue
        header = _aad(env)
        if header is None or env["edk"] in refused:
            continue
        try:
            edk = base64.b64decode(env["edk"], validate=True)
            ctx = context(header["worker"], header["trail"])
            keys[env["edk"]] = await source.unwrap(str(env.get("kid")), edk, ctx)
        except (KeyServiceError, ValueError, binascii.Error):
            refused.add(env["edk"])
    return keys


def verify_trail(
    messages: Sequence[bytes],
    *,
    where: Sequence[str] | None = None,
    keys: Mapping[str, bytes] | None = None,
    data_keys: Mapping[str, bytes] | None = None,
    pinned: Iterable[str] = (),
) -> Verification:
    """Check every message; decrypt too when ``keys`` or ``data_keys`` are given.

    ``pinned`` holds trusted public keys (base64 of the raw 32 bytes).
    """
    out = Verification(messages=len(messages), decrypted=keys is not None or data_keys is not None)
    labels = list(where) if where is not None else [f"message {i}" for i in range(len(messages))]
    trails: dict[tuple[str, str], list[_Item]] = {}
    for i, message in enumerate(messages):
        obj = _parse(message)
        if obj is not None and obj.get("type") == "digest":
            digest = read_digest(obj)
            if digest is not None:
                tid = (str(obj["worker"]), str(obj["trail"]))
                trails.setdefault(tid, []).append(_Item(i, message, digest=digest))
                continue
        header = _aad(obj) if obj is not None else None
        if header is None:
            out.findings.append(
                Finding(i, labels[i], "inserted", "?", "neither a record nor a digest")
            )
            continue
        tid = (header["worker"], header["trail"])
        trails.setdefault(tid, []).append(_Item(i, message, seq=header["seq"]))
    for tid, items in trails.items():
        _Trail(tid, items, labels, out, keys or {}, data_keys or {}, set(pinned)).check()
    out.findings.sort(key=lambda f: f.position)
    return out


class _Trail:
    def __init__(
        self,
        tid: tuple[str, str],
        items: list[_Item],
        labels: list[str],
        out: Verification,
        keys: Mapping[str, bytes],
        data_keys: Mapping[str, bytes],
        pinned: set[str],
    ) -> None:
        self.tid, self.items, self.labels, self.out = tid, items, labels, out
        self.keys, self.data_keys, self.pinned = keys, data_keys, pinned
        self.summary = out.trails.setdefault(tid, TrailSummary(*tid))
        self.hashes: dict[int, str] = {}  # seq -> SHA-256 of its envelope
        self.plain: dict[int, dict[str, Any]] = {}  # seq -> decrypted record
        self.position: dict[int, int] = {}

    def find(self, item: _Item, kind: str, detail: str) -> None:
        pos = item.position
        self.out.findings.append(Finding(pos, self.labels[pos], kind, self.tid[1], detail))

    def check(self) -> None:
        expected = 0
        for n, item in enumerate(self.items):
            if item.seq is None:
                continue
            seq, sha = item.seq, hashlib.sha256(item.message).hexdigest()
            if seq in self.hashes:
                if self.hashes[seq] == sha:
                    self.out.duplicates += 1
                else:
                    self.find(item, "inserted", f"a second, different record with seq {seq}")
                continue
            if seq > expected:
                rest = {i.seq for i in self.items[n + 1 :] if i.seq is not None}
                if expected in rest:
                    self.find(item, "reordered", f"seq {seq} stored before seq {expected}")
                else:
                    gap = [s for s in range(expected, seq) if s not in self.hashes]
                    if gap:
                        self.find(item, "deleted", f"records {gap[0]}..{gap[-1]} are missing")
            self.hashes[seq], self.position[seq] = sha, item.position
            expected = max(expected, seq + 1)
            self._open(item, seq)
        self.summary.records = len(self.hashes)
        self.summary.last_seq = max(self.hashes, default=-1)
        self._plain_chain()
        self._digests()

    def _open(self, item: _Item, seq: int) -> None:
        if not self.out.decrypted:
            return
        try:
            record = open_envelope(item.message, self.keys, self.data_keys)
        except AuditVerificationError as exc:
            self.find(item, "changed", f"record {seq} does not open: {exc}")
            return
        self.plain[seq] = record
        self.out.records.append(record)

    def _plain_chain(self) -> None:
        for seq in sorted(self.plain):
            before = self.plain.get(seq - 1)
            want = "" if seq == 0 else record_digest(before) if before is not None else None
            if want is not None and self.plain[seq].get("prev") != want:
                item = _Item(self.position[seq], b"")
                self.find(item, "changed", f"record {seq - 1} changed: record {seq}'s prev differs")

    def _envelope_heads(self) -> dict[int, str]:
        heads, head, seq = {}, ENVELOPE_HEAD_ZERO, 0
        while seq in self.hashes:
            head = hashlib.sha256(bytes.fromhex(head) + bytes.fromhex(self.hashes[seq])).hexdigest()
            heads[seq] = head
            seq += 1
        return heads

    def _announced(self) -> str | None:
        first = self.plain.get(0)
        key = first.get("signing_key") if first else None
        return key if isinstance(key, str) else None

    def _digests(self) -> None:
        heads = self._envelope_heads()
        trusted = self.pinned or ({k} if (k := self._announced()) else set())
        last: Digest | None = None
        for item in self.items:
            d = item.digest
            if d is None:
                continue
            self.summary.digests += 1
            b = d.body
            if not d.valid:
                self.find(item, "bad_signature", f"digest {b['digest_seq']} does not verify")
                continue
            if trusted and d.public_key not in trusted:
                self.find(item, "untrusted_key", f"digest {b['digest_seq']} signed by another key")
            elif not trusted and last is not None and d.public_key != last.public_key:
                self.find(item, "untrusted_key", f"digest {b['digest_seq']} changed signing key")
            want_seq = 0 if last is None else last.body["digest_seq"] + 1
            want_first = 0 if last is None else last.body["last_seq"] + 1
            want_prev = "" if last is None else last.signed_sha256
            if (b["digest_seq"], b["first_seq"], b["prev_digest"]) != (
                want_seq,
                want_first,
                want_prev,
            ):
                span = f"records {b['first_seq']}..{b['last_seq']}"
                detail = f"digest {b['digest_seq']} ({span}) does not follow digest {want_seq - 1}"
                self.find(item, "digest_gap", detail)
            self._covers(item, d, heads)
            last = d
            self.summary.signed_through = max(self.summary.signed_through, b["last_seq"])
        stopped = [s for s, r in self.plain.items() if r.get("event") == "application.stop"]
        if stopped and max(stopped) > self.summary.signed_through:
            where = _Item(self.position[max(stopped)], b"")
            self.find(where, "digest_gap", "the trail stopped but no digest covers its stop")

    def _covers(self, item: _Item, d: Digest, heads: dict[int, str]) -> None:
        b = d.body
        last_seq = b["last_seq"]
        if last_seq < 0:
            return
        if last_seq not in self.hashes:
            gap = f"{b['first_seq']}..{last_seq}"
            self.find(
                item, "deleted", f"records {gap} signed by digest {b['digest_seq']} are missing"
            )
        elif heads.get(last_seq) != b["envelope_head"]:
            self.find(
                item,
                "changed",
                f"records {b['first_seq']}..{last_seq} do not match digest {b['digest_seq']} "
                "(a record in them was changed, removed or inserted)",
            )
        record = self.plain.get(last_seq)
        if record is not None and record_digest(record) != b["chain_head"]:
            self.find(item, "changed", f"record {last_seq} differs from digest {b['digest_seq']}")
