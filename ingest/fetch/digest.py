"""The source object's digest under ``DICOM_INGEST_SOURCE_HASH``, fed as its bytes arrive.

* ``crc64nvme`` (the default): the full-object CRC64NVME that S3 itself stores
  and shows (``source.crc64nvme``; ``ingest/fetch/crc_digest.py``), fed in any
  order: each range is checksummed right after its GET and the parts are
  combined. It finds corrupted bytes, not forged ones.
* ``sha256``: the plain SHA-256 of the whole object (``source.sha256``), the
  cryptographic digest. It is sequential, so the ranges must be fed in order
  (``in_order``), and one object is hashed on one core whatever the number of
  ranges in flight, which caps one large object at one core's hash rate (hashlib,
  OpenSSL).
* ``sha256-tree``: the SHA-256 tree hash of Amazon S3 Glacier
  (``source.sha256_tree``; ``ingest/fetch/tree_digest.py``), fed in any order: each
  range is hashed as soon as it is read, on as many cores as there are ranges
  in flight. The same CPU per byte, without the one-core cap. For an object of
  at most 1 MiB it equals the plain SHA-256.
* ``none``: nothing, for real-time use where the ETag and version identify the
  source well enough; every digest field is then ``null``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ingest.fetch.crc_digest import CrcDigest
from ingest.fetch.tree_digest import TreeDigest
from ingest.settings import Settings


@dataclass(frozen=True, slots=True)
class Digests:
    """What the sidecar's ``source`` says of the bytes read (``None``: not computed)."""

    sha256: str | None = None
    sha256_tree: str | None = None
    crc64nvme: str | None = None


class SourceDigest:
    """The digest of an object of ``size`` bytes whose first bytes are ``first``."""

    def __init__(self, settings: Settings, size: int, first: memoryview | bytes = b"") -> None:
        self._hash = hashlib.sha256(first) if settings.source_hash == "sha256" else None
        self._tree = TreeDigest(size) if settings.source_hash == "sha256-tree" else None
        self._crc = CrcDigest(size) if settings.source_hash == "crc64nvme" else None
        if len(first):
            if self._tree is not None:
                self._tree.add(0, first)
            if self._crc is not None:
                self._crc.add(0, first)

    @property
    def enabled(self) -> bool:
        return self._hash is not None or self._tree is not None or self._crc is not None

    @property
    def in_order(self) -> bool:
        """Whether ``update`` must be given the object's ranges in order (plain SHA-256)."""
        return self._hash is not None

    @property
    def any_order(self) -> bool:
        """Whether ``update`` takes ranges in any order, from any thread (tree hash, CRC)."""
        return self._tree is not None or self._crc is not None

    @property
    def on_get_thread(self) -> bool:
        """Whether ``update`` is cheap enough to run on a GET's thread (the CRC)."""
        return self._crc is not None

    def update(self, start: int, data: memoryview) -> None:
        """Take bytes ``[start, start + len(data))`` of the object (each byte once).

        Raises:
            ValueError: (tree hash, CRC) bytes outside the object; (tree hash) given twice.
        """
        if self._hash is not None:
            self._hash.update(data)
        elif self._tree is not None:
            self._tree.add(start, data)
        elif self._crc is not None:
            self._crc.add(start, data)

    def digests(self) -> Digests:
        """The digest, once every byte has been given.

        Raises:
            ValueError: (tree hash, CRC) some bytes were never given.
        """
        if self._hash is not None:
            return Digests(sha256=self._hash.hexdigest())
        if self._tree is not None:
            return Digests(sha256_tree=self._tree.hexdigest())
        if self._crc is not None:
            return Digests(crc64nvme=self._crc.b64digest())
        return Digests()
