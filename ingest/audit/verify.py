"""Verifying a whole audit trail (a topic or an exported file): what ``audit verify`` runs.

Messages are checked trail by trail in the order they were stored, then each
worker's trails as one chain. Without any key the verifier still reads each
envelope's ``aad`` (worker, trail, seq), recomputes the running hash over the
envelopes and checks it against the signed digests; with the keys it also
decrypts every record and checks the plaintext hash chain, which names a
changed record exactly. Trust comes from the digests' signing key only: a key
pinned by the auditor (``pinned``), or, when told to trust on first use, the key
a trail announced (in its first record, when decrypting) or signed its first
digest with. Findings carry the position of the message where they were
noticed, and the first one in stored order is the first break. Kinds:

- ``changed``: a record that fails authentication, whose successor's ``prev``
  does not match it, or a digest range whose hash does not match the records;
- ``deleted``: seq numbers that never arrive, or a whole trail that the next
  trail of its worker names as its predecessor and that is not there;
- ``reordered``: a record stored after a later one of its trail;
- ``inserted``: a second, different message with a seq already seen, a digest
  after the final one, a second first trail of a worker or a second successor
  of one trail, or a message that is no record or digest at all;
- ``bad_signature``, ``untrusted_key``: a digest that does not verify, or is
  signed by a key that is not trusted;
- ``digest_gap``: digests missing between two (their seq or records skipped);
- ``unsigned`` (strict): records no trusted digest covers: a trail without
  digests, records after a trail's final digest, or after the last digest of a
  trail that ended without one;
- ``truncated`` (strict): a worker's latest trail has no final digest and its
  heartbeat digests stopped more than two heartbeats before ``now`` (a killed
  worker, or a tail cut off);
- ``no_key``: no record under a key opens with the keys given (a wrong key, or
  no access): the content could not be read, which is no evidence of tampering.

Identical copies (at-least-once delivery) of records and digests are
duplicates, not findings. Without ``strict`` the strict kinds are ``warnings``.
A checkpoint (``Checkpoint``: a digest verified earlier) lets a topic whose
retention dropped its oldest messages verify from there on.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from ingest.audit.digest import Digest, canonical, read_digest, signature_ok
from ingest.audit.keys import KeySource, context
from ingest.audit.records import (
    ENVELOPE_HEAD_ZERO,
    AuditVerificationError,
    DataKeyRef,
    data_key_ref,
    open_envelope,
    record_digest,
)
from ingest.errors import ConfigError, KeyServiceError

STRICT_KINDS: Final = frozenset({"unsigned", "truncated"})
CHECKPOINT_FORMAT: Final = "dicom-ingest-audit-checkpoint"


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
    signed_through: int = -1  # the last seq a trusted digest (or the successor) covers
    last_seq: int = -1
    state: str = "unsigned"  # closed | ended | open | truncated | unsigned | before checkpoint


@dataclass(slots=True)
class Verification:
    """What ``verify_trail`` found; ``ok`` when nothing. ``records`` are the decrypted ones."""

    messages: int = 0
    duplicates: int = 0
    findings: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    trails: dict[tuple[str, str], TrailSummary] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    decrypted: bool = False
    latest: dict[str, Digest] = field(default_factory=dict)  # per worker: for a checkpoint

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def tampered(self) -> bool:
        """A finding that is evidence of a change (every kind but ``no_key``)."""
        return any(f.kind != "no_key" for f in self.findings)

    @property
    def first_break(self) -> Finding | None:
        return min(self.findings, key=lambda f: f.position) if self.findings else None


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Per worker, the last digest of its latest trail as a verification found it."""

    digests: Mapping[str, Digest]


def save_checkpoint(path: Path, report: Verification) -> None:
    """Write ``report``'s latest digest per worker (``audit verify --save-checkpoint``)."""
    body = {
        "format": CHECKPOINT_FORMAT,
        "v": 1,
        "workers": {w: d.body for w, d in sorted(report.latest.items())},
    }
    path.write_text(json.dumps(body, indent=1) + "\n")


def load_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint file; its digests' signatures are checked here, their keys by the
    verification that starts from it.

    Raises:
        ConfigError: not a checkpoint, or a digest in it does not verify.
    """
    try:
        data = json.loads(path.read_text())
        workers = data["workers"] if data.get("format") == CHECKPOINT_FORMAT else {}
        digests = {str(w): read_digest(body) for w, body in dict(workers).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"--checkpoint {path}: {type(exc).__name__}: {exc}") from None
    if not digests:
        raise ConfigError(f"--checkpoint {path}: no {CHECKPOINT_FORMAT} with workers")
    for worker, digest in digests.items():
        if digest is None or not digest.valid or digest.body["worker"] != worker:
            raise ConfigError(f"--checkpoint {path}: the digest of {worker} does not verify")
    return Checkpoint({w: d for w, d in digests.items() if d is not None})


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


def trail_of(message: bytes) -> tuple[str, str] | None:
    """The (worker, trail) a record or digest belongs to; None for anything else."""
    obj = _parse(message)
    if obj is None:
        return None
    if obj.get("type") == "digest":
        worker, trail = obj.get("worker"), obj.get("trail")
        return (worker, trail) if isinstance(worker, str) and isinstance(trail, str) else None
    header = _aad(obj)
    return (header["worker"], header["trail"]) if header is not None else None


def index_of(values: list[bytes]) -> tuple[str, list[list[Any]]]:
    """The running hash over ``values`` and each trail's ``[worker, trail, messages]``."""
    head, counts = bytes(32), Counter[tuple[str, str]]()
    for value in values:
        head = hashlib.sha256(head + hashlib.sha256(value).digest()).digest()
        tid = trail_of(value)
        if tid is not None:
            counts[tid] += 1
    return head.hex(), [[w, t, n] for (w, t), n in sorted(counts.items())]


def check_index(
    header: Mapping[str, Any], messages: Sequence[bytes], pinned: Iterable[str], tofu: bool
) -> list[Finding]:
    """What an export's header (``store.export_header``) says against its messages: its
    hash, its trails and their counts, and its signature when it has one."""
    at, where = len(messages), "the export's header"
    found: list[Finding] = []
    if "sha256" not in header:
        return found
    sha256, trails = index_of(list(messages))
    signer = header.get("signer")
    if isinstance(signer, dict):
        body = {k: v for k, v in header.items() if k != "signer"}
        block = {k: v for k, v in signer.items() if k != "sig"}
        signed = canonical(body | {"signer": block})
        alg, key, sig = (str(signer.get(k)) for k in ("alg", "public_key", "sig"))
        if not signature_ok(alg, key, sig, signed):
            found.append(Finding(at, where, "bad_signature", "?", "the header does not verify"))
        elif not (key in set(pinned) or (tofu and not set(pinned))):
            found.append(
                Finding(at, where, "untrusted_key", "?", "the header's key is not trusted")
            )
    listed = {(str(w), str(t)): n for w, t, n in header.get("trails") or ()}
    held = {(w, t): n for w, t, n in trails}
    for (worker, trail), n in sorted(listed.items()):
        if held.get((worker, trail), 0) < n:
            got = held.get((worker, trail), 0)
            detail = f"{n - got} of the {n} messages the header lists of {worker}/{trail} are gone"
            found.append(Finding(at, where, "deleted", trail, detail))
    extra = sorted(set(held) - set(listed))
    for worker, trail in extra:
        found.append(Finding(at, where, "inserted", trail, f"{worker}/{trail} is not listed"))
    if header.get("sha256") != sha256 and not found:
        found.append(Finding(at, where, "changed", "?", "the messages differ from its hash"))
    return found


def object_records(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The records about objects and notifications, without the application's start/stop."""
    return [dict(r) for r in records if not str(r.get("event", "")).startswith("application.")]


async def unwrap_all(messages: Iterable[bytes], source: KeySource) -> dict[DataKeyRef, bytes]:
    """Unwrap every distinct data key of the envelopes once: per ``kid``, ``edk`` and
    encryption context (``records.data_key_ref``), so a copied ``edk`` planted in
    another context is refused there alone. A refused one is left out, and its
    records then fail to open (a finding)."""
    keys: dict[DataKeyRef, bytes] = {}
    tried: set[DataKeyRef] = set()
    for message in messages:
        env = _parse(message)
        ref = data_key_ref(env) if env is not None else None
        if ref is None or ref in tried:
            continue
        tried.add(ref)
        kid, edk, worker, trail = ref
        try:
            wrapped = base64.b64decode(edk, validate=True)
            keys[ref] = await source.unwrap(kid, wrapped, context(worker, trail))
        except (KeyServiceError, ValueError, binascii.Error):
            continue
    return keys


def verify_trail(
    messages: Sequence[bytes],
    *,
    where: Sequence[str] | None = None,
    keys: Mapping[str, bytes] | None = None,
    data_keys: Mapping[DataKeyRef, bytes] | None = None,
    pinned: Iterable[str] = (),
    trust_on_first_use: bool = False,
    strict: bool = True,
    now: datetime | None = None,
    checkpoint: Checkpoint | None = None,
) -> Verification:
    """Check every message; decrypt too when ``keys`` or ``data_keys`` are given.

    ``pinned`` holds trusted public keys (``digest.public_key_text``); without any,
    only ``trust_on_first_use`` makes a digest trusted. ``now`` is when the trail
    was read: a worker's latest trail whose digests came within two heartbeats of
    it is open (live), not truncated.
    """
    out = Verification(messages=len(messages), decrypted=keys is not None or data_keys is not None)
    labels = list(where) if where is not None else [f"message {i}" for i in range(len(messages))]
    grouped: dict[tuple[str, str], list[_Item]] = {}
    for i, message in enumerate(messages):
        obj = _parse(message)
        if obj is not None and obj.get("type") == "digest":
            digest = read_digest(obj)
            if digest is not None:
                tid = (str(obj["worker"]), str(obj["trail"]))
                grouped.setdefault(tid, []).append(_Item(i, message, digest=digest))
                continue
        header = _aad(obj) if obj is not None else None
        if header is None:
            out.findings.append(
                Finding(i, labels[i], "inserted", "?", "neither a record nor a digest")
            )
            continue
        tid = (header["worker"], header["trail"])
        grouped.setdefault(tid, []).append(_Item(i, message, seq=header["seq"]))
    context_ = _Context(
        labels, out, keys or {}, data_keys or {}, frozenset(pinned), trust_on_first_use, now
    )
    bases = dict(checkpoint.digests) if checkpoint else {}
    for worker, base in bases.items():
        if not context_.trusts(base.public_key, None):
            raise ConfigError(f"checkpoint of {worker}: signed by a key that is not trusted")
    trails = [
        _Trail(tid, items, context_, _base(bases.get(tid[0]), tid))
        for tid, items in grouped.items()
    ]
    skipped = _before_checkpoint(trails, bases)
    for trail in trails:
        if trail.tid in skipped:
            trail.summary.state = "before checkpoint"
            trail.summary.records = sum(1 for i in trail.items if i.seq is not None)
        else:
            trail.check()
    by_worker: dict[str, list[_Trail]] = {}
    for trail in trails:
        if trail.tid not in skipped:
            by_worker.setdefault(trail.tid[0], []).append(trail)
    for worker, chain in by_worker.items():
        _link(worker, chain, bases.get(worker), context_)
    context_.resolve_keys()
    for finding in list(out.findings):
        if not strict and finding.kind in STRICT_KINDS:
            out.findings.remove(finding)
            out.warnings.append(finding)
    out.findings.sort(key=lambda f: f.position)
    return out


def _base(digest: Digest | None, tid: tuple[str, str]) -> Digest | None:
    return digest if digest is not None and digest.body["trail"] == tid[1] else None


def _before_checkpoint(trails: list[_Trail], bases: Mapping[str, Digest]) -> set[tuple[str, str]]:
    """The trails that precede a checkpoint's trail in their worker's chain."""
    skipped: set[tuple[str, str]] = set()
    by_id = {t.tid: t for t in trails}
    for worker, base in bases.items():
        prev = str(base.body["prev_trail"])
        while prev and (worker, prev) in by_id and (worker, prev) not in skipped:
            skipped.add((worker, prev))
            prev = by_id[(worker, prev)].prev_trail() or ""
    return skipped


class _Context:
    """What every trail's check shares: labels, keys, trust, and the findings."""

    def __init__(
        self,
        labels: list[str],
        out: Verification,
        keys: Mapping[str, bytes],
        data_keys: Mapping[DataKeyRef, bytes],
        pinned: frozenset[str],
        tofu: bool,
        now: datetime | None,
    ) -> None:
        self.labels, self.out, self.keys, self.data_keys = labels, out, keys, data_keys
        self.pinned, self.tofu, self.now = pinned, tofu, now
        self.opened: set[str] = set()  # kids under which some record opened
        self.unopened: dict[str, list[tuple[_Item, str, str]]] = {}  # kid -> failures

    def find(self, position: int, kind: str, trail: str, detail: str) -> None:
        self.out.findings.append(Finding(position, self.labels[position], kind, trail, detail))

    def trusts(self, key: str, first: str | None) -> bool:
        if self.pinned:
            return key in self.pinned
        return self.tofu and (first is None or key == first)

    def resolve_keys(self) -> None:
        """Records that did not open: tampering where other records under the same key
        opened; where none did, one ``no_key`` finding for the key."""
        for kid, failures in self.unopened.items():
            if kid in self.opened:
                for item, trail, why in failures:
                    self.find(item.position, "changed", trail, why)
                continue
            item, trail, _ = failures[0]
            self.find(
                item.position,
                "no_key",
                trail,
                f"no record under key {kid!r} opens with the keys given "
                f"({len(failures)} records): a wrong key or no access, not a change",
            )


class _Trail:
    def __init__(
        self, tid: tuple[str, str], items: list[_Item], ctx: _Context, base: Digest | None
    ) -> None:
        self.tid, self.items, self.ctx, self.base = tid, items, ctx, base
        self.summary = ctx.out.trails.setdefault(tid, TrailSummary(*tid))
        self.floor = base.body["last_seq"] if base else -1  # records through it: checked before
        self.hashes: dict[int, str] = {}  # seq -> SHA-256 of its envelope
        self.plain: dict[int, dict[str, Any]] = {}  # seq -> decrypted record
        self.position: dict[int, int] = {}
        self.heads: dict[int, str] = {}
        self.trusted: list[tuple[_Item, Digest]] = []
        self.digest_hashes: set[str] = {base.signed_sha256} if base else set()
        self.final: Digest | None = base if base is not None and base.body["final"] else None

    def find(self, item: _Item | int, kind: str, detail: str) -> None:
        pos = item.position if isinstance(item, _Item) else item
        self.ctx.find(pos, kind, self.tid[1], detail)

    @property
    def first_position(self) -> int:
        return self.items[0].position

    def prev_trail(self) -> str | None:
        """The previous trail its first digest by a trusted key names (None: no such digest)."""
        for item in self.items:
            d = item.digest
            if d is not None and d.valid and self.ctx.trusts(d.public_key, None):
                return str(d.body["prev_trail"])
        return None

    def check(self) -> None:
        expected = self.floor + 1
        for n, item in enumerate(self.items):
            if item.seq is None or item.seq <= self.floor:
                continue
            seq, sha = item.seq, hashlib.sha256(item.message).hexdigest()
            if seq in self.hashes:
                if self.hashes[seq] == sha:
                    self.ctx.out.duplicates += 1
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
        self.summary.last_seq = max(self.hashes, default=self.floor)
        self._plain_chain()
        self._heads()
        self._digests()

    def _open(self, item: _Item, seq: int) -> None:
        if not self.ctx.out.decrypted:
            return
        env = _parse(item.message) or {}
        kid = str(env.get("kid"))
        try:
            record = open_envelope(item.message, self.ctx.keys, self.ctx.data_keys)
        except AuditVerificationError as exc:
            failure = (item, self.tid[1], f"record {seq} does not open: {exc}")
            self.ctx.unopened.setdefault(kid, []).append(failure)
            return
        self.ctx.opened.add(kid)
        self.plain[seq] = record
        self.ctx.out.records.append(record)

    def _plain_chain(self) -> None:
        for seq in sorted(self.plain):
            before = self.plain.get(seq - 1)
            if seq == 0:
                want: str | None = ""
            elif self.base is not None and seq == self.floor + 1:
                want = str(self.base.body["chain_head"])
            else:
                want = record_digest(before) if before is not None else None
            if want is not None and self.plain[seq].get("prev") != want:
                self.find(
                    self.position[seq],
                    "changed",
                    f"record {seq - 1} changed: record {seq}'s prev differs",
                )

    def _heads(self) -> None:
        seq = self.floor + 1
        head = str(self.base.body["envelope_head"]) if self.base else ENVELOPE_HEAD_ZERO
        while seq in self.hashes:
            head = hashlib.sha256(bytes.fromhex(head) + bytes.fromhex(self.hashes[seq])).hexdigest()
            self.heads[seq] = head
            seq += 1

    def _announced(self) -> str | None:
        first = self.plain.get(0)
        key = first.get("signing_key") if first else None
        return key if isinstance(key, str) else None

    def _digests(self) -> None:
        first_key = self._announced()
        last: Digest | None = self.base
        seen: dict[int, str] = {}  # digest_seq -> signed hash
        for item in self.items:
            d = item.digest
            if d is None:
                continue
            b = d.body
            if self.base is not None and d.seq <= self.base.seq:
                continue
            if not d.valid:
                self.find(item, "bad_signature", f"digest {d.seq} does not verify")
                continue
            if d.seq in seen:
                if seen[d.seq] == d.signed_sha256:
                    self.ctx.out.duplicates += 1
                else:
                    self.find(item, "inserted", f"a second, different digest {d.seq}")
                continue
            self.summary.digests += 1
            if first_key is None and self.ctx.tofu and not self.ctx.pinned:
                first_key = d.public_key
            if not self.ctx.trusts(d.public_key, first_key):
                self.find(item, "untrusted_key", f"digest {d.seq} is signed by a key not trusted")
                continue
            seen[d.seq] = d.signed_sha256
            if self.final is not None:
                self.find(item, "inserted", f"digest {d.seq} after the final digest")
                continue
            if last is not None:
                want = (last.seq + 1, last.body["last_seq"] + 1, last.signed_sha256)
                if (d.seq, b["first_seq"], b["prev_digest"]) != want:
                    span = f"records {b['first_seq']}..{b['last_seq']}"
                    detail = f"digest {d.seq} ({span}) does not follow digest {last.seq}"
                    self.find(item, "digest_gap", detail)
            elif (d.seq, b["first_seq"]) != (0, 0):
                self.find(item, "digest_gap", f"digests 0..{d.seq - 1} are missing")
            if last is not None and b["prev_trail"] != last.body["prev_trail"]:
                self.find(item, "changed", f"digest {d.seq} names another previous trail")
            self._covers(item, d)
            self.trusted.append((item, d))
            self.digest_hashes.add(d.signed_sha256)
            last = d
            self.summary.signed_through = max(self.summary.signed_through, b["last_seq"])
            if b["final"]:
                self.final = d
        first = self.plain.get(0)
        if first is not None and self.trusted:
            named = self.trusted[0][1].body["prev_trail"]
            if first.get("previous_trail", "") != named:
                self.find(self.position[0], "changed", "record 0 names another previous trail")

    def _covers(self, item: _Item, d: Digest) -> None:
        b = d.body
        last_seq = b["last_seq"]
        if last_seq <= self.floor:
            return
        if last_seq not in self.hashes:
            gap = f"{b['first_seq']}..{last_seq}"
            self.find(item, "deleted", f"records {gap} signed by digest {d.seq} are missing")
        elif self.heads.get(last_seq) != b["envelope_head"]:
            self.find(
                item,
                "changed",
                f"records {b['first_seq']}..{last_seq} do not match digest {d.seq} "
                "(a record in them was changed, removed or inserted)",
            )
        record = self.plain.get(last_seq)
        if record is not None and record_digest(record) != b["chain_head"]:
            self.find(item, "changed", f"record {last_seq} differs from digest {d.seq}")

    def successor_covers(self, successor: _Trail, d: Digest) -> None:
        """``successor`` names this trail as its previous one: check what it says of it."""
        b = d.body
        where = successor.trusted[0][0]
        if b["prev_digest"] and b["prev_digest"] not in self.digest_hashes:
            successor.find(
                where,
                "deleted",
                f"the last digest of previous trail {self.tid[1]} that this trail continues "
                "from is missing (its tail was cut)",
            )
        prev_seq = int(b["prev_seq"])
        if prev_seq > self.floor:
            if prev_seq not in self.hashes:
                successor.find(
                    where,
                    "deleted",
                    f"records of previous trail {self.tid[1]} through {prev_seq} are missing",
                )
            elif self.heads.get(prev_seq) != b["prev_head"]:
                successor.find(
                    where,
                    "changed",
                    f"records of previous trail {self.tid[1]} through {prev_seq} do not match",
                )
        self.summary.signed_through = max(self.summary.signed_through, prev_seq)

    def close(self, has_successor: bool) -> None:
        """The trail's end: what no trusted digest covers, and whether it ended."""
        s = self.summary
        after = sorted(q for q in self.hashes if q > s.signed_through)
        span = f"records {after[0]}..{after[-1]}" if after else ""
        first_unsigned = self.position[after[0]] if after else self.first_position
        if not self.trusted and self.base is None:
            s.state = "unsigned"
            if self.hashes:
                self.find(first_unsigned, "unsigned", "no digest by a trusted key covers the trail")
            return
        if self.final is not None:
            s.state = "closed"
            if after:
                self.find(first_unsigned, "unsigned", f"{span} came after the final digest")
            return
        if has_successor:
            s.state = "ended"
            if after:
                self.find(
                    first_unsigned,
                    "unsigned",
                    f"{span} of a trail that ended without a stop are covered by no digest",
                )
            return
        last = self.trusted[-1][1] if self.trusted else self.base
        assert last is not None
        if self._live(last):
            s.state = "open"
            return
        s.state = "truncated"
        where = first_unsigned if after else self.trusted[-1][0].position if self.trusted else 0
        self.find(
            where,
            "truncated",
            f"no final digest; digests stopped at {last.body['time']}"
            + (f" and {span} are covered by none" if after else "")
            + " (a killed worker, or a cut tail)",
        )

    def _live(self, last: Digest) -> bool:
        if self.ctx.now is None:
            return False
        try:
            at = datetime.fromisoformat(str(last.body["time"]).replace("Z", "+00:00"))
        except ValueError:
            return False
        return (self.ctx.now - at).total_seconds() <= 2 * float(last.body["heartbeat_s"]) + 1


def _link(worker: str, chain: list[_Trail], base: Digest | None, ctx: _Context) -> None:
    """One worker's trails as a chain: each names the one before it (its digests'
    ``prev_trail``), one names none (or the checkpoint's), and none is named twice."""
    by_id = {t.tid[1]: t for t in chain}
    successors: dict[str, _Trail] = {}
    firsts: list[_Trail] = []
    for trail in sorted(chain, key=lambda t: t.first_position):
        if not trail.trusted:
            continue
        item, d = trail.trusted[0]
        prev = str(d.body["prev_trail"])
        if trail.base is not None:  # continues the checkpoint: its predecessor was checked
            continue
        if not prev:
            if firsts or base is not None:
                trail.find(item, "inserted", f"a second first trail of worker {worker}")
            firsts.append(trail)
            continue
        if prev in successors:
            trail.find(item, "inserted", f"a second trail continuing trail {prev}")
            continue
        successors[prev] = trail
        if prev in by_id:
            by_id[prev].successor_covers(trail, d)
        elif base is None or prev != base.body["trail"]:
            trail.find(item, "deleted", f"previous trail {prev} of worker {worker} is missing")
    for trail in chain:
        trail.close(trail.tid[1] in successors)
        if trail.tid[1] not in successors and trail.trusted:
            ctx.out.latest[worker] = trail.trusted[-1][1]
    if worker not in ctx.out.latest and base is not None:
        ctx.out.latest[worker] = base
