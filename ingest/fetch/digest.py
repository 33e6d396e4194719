"""The source object's digest under ``DICOM_INGEST_SOURCE_HASH``, fed as its bytes arrive.

* ``sha256`` (the default): the plain SHA-256 of the whole object
  (``source.sha256``). It is sequential, so the ranges must be fed in order
  (``in_order``), and one object is hashed on one core whatever the number of
  ranges in flight: 0.5-1.0 core-s/GB (hashlib, OpenSSL), which caps one large
  object at that rate.
* ``sha256-tree``: the SHA-256 tree hash of Amazon S3 Glacier
  (``source.sha256_tree``; ``ingest/fetch/tree_digest.py``), fed in any order: each
  range is hashed as soon as it is read, on as many cores as there are ranges
  in flight. The same CPU per byte, without the one-core cap. For an object of
  at most 1 MiB it equals the plain SHA-256.
* ``none``: nothing, for real-time use where the ETag and version identify the
  source well enough; both fields are then ``null``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ingest.fetch.tree_digest import TreeDigest
from ingest.settings import Settings


@dataclass(frozen=True, slots=True)
class Digests:
    """What the sidecar's ``source`` says of the bytes read (``None``: not computed)."""

    sha256: str | None = None
    sha256_tree: str | None = None


class SourceDigest:
    """The digest of an object of ``size`` bytes whose first bytes are ``first``."""

    def __init__(self, settings: Settings, size: int, first: memoryview | bytes = b"") -> None:
        self._hash = hashlib.sha256(first) if settings.source_hash == "sha256" else None
        self._tree = TreeDigest(size) if settings.source_hash == "sha256-tree" else None
        if self._tree is not None and len(first):
            self._tree.add(0, first)

    @property
    def enabled(self) -> bool:
        return self._hash is not None or self._tree is not None

    @property
    def in_order(self) -> bool:
        """Whether ``update`` must be given the object's ranges in order (plain SHA-256)."""
        return self._hash is not None

    @property
    def any_order(self) -> bool:
        """Whether ``update`` takes ranges in any order, from any thread (the tree hash)."""
        return self._tree is not None

    def update(self, start: int, data: memoryview) -> None:
        """Take bytes ``[start, start + len(data))`` of the object (each byte once).

        Raises:
            ValueError: (tree hash) bytes outside the object, or given twice.
        """
        if self._hash is not None:
            self._hash.update(data)
        elif self._tree is not None:
            self._tree.add(start, data)

    def digests(self) -> Digests:
        """The digest, once every byte has been given.

        Raises:
            ValueError: (tree hash) some bytes were never given.
        """
        if self._hash is not None:
            return Digests(sha256=self._hash.hexdigest())
        if self._tree is not None:
            return Digests(sha256_tree=self._tree.hexdigest())
        return Digests()
