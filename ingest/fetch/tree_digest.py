"""The SHA-256 tree hash of a source object (``source.sha256_tree``), fed in any order.

The tree hash of Amazon S3 Glacier: the SHA-256 of each MiB of the object (the
last leaf may be shorter), then the SHA-256 of each pair of adjacent hashes,
level by level, until one is left (an odd one out moves up unchanged).
``botocore.utils.calculate_tree_hash(open(path, "rb"))`` computes it from a
file, so anyone can check ours; for an object of at most 1 MiB (a CT slice) it
is the plain SHA-256.

Why it exists: the plain SHA-256 (``ingest/fetch/digest.py``) is sequential, so
it holds one large object at one core's hash rate, several times slower than the
reads. The leaves of a tree hash are independent: each range's leaves are hashed
in a worker thread as soon as the range is read, in whatever order the ranges
arrive, on as many cores as there are ranges in flight (hashlib releases the
GIL). A leaf that straddles two ranges is kept as pieces (at most two per range,
each under 1 MiB) until both ranges are in, then joined and hashed.
"""

from __future__ import annotations

import hashlib

from ingest.fetch.any_order import AnyOrderDigest

LEAF_BYTES = 1024 * 1024


class TreeDigest(AnyOrderDigest):
    """The tree hash of an object of ``size`` bytes; ``add`` its bytes once each, in any
    order and from any thread, then ``hexdigest``."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self._leaves: list[bytes | None] = [None] * max(1, -(-size // LEAF_BYTES))
        self._pieces: dict[int, list[tuple[int, bytes]]] = {}
        if size == 0:
            self._leaves[0] = hashlib.sha256(b"").digest()

    def add(self, start: int, data: memoryview | bytes) -> None:
        """Take bytes ``[start, start + len(data))`` of the object.

        Raises:
            ValueError: the bytes lie outside the object, or some were added before.
        """
        view = self._inside(start, data)
        end = start + len(view)
        if start == end:
            return
        for leaf in range(start // LEAF_BYTES, -(-end // LEAF_BYTES)):
            leaf_start = leaf * LEAF_BYTES
            leaf_end = min(leaf_start + LEAF_BYTES, self._size)
            lo, hi = max(start, leaf_start), min(end, leaf_end)
            if lo == leaf_start and hi == leaf_end:
                self._set(leaf, hashlib.sha256(view[lo - start : hi - start]).digest())
            else:
                whole = self._piece(leaf, lo, bytes(view[lo - start : hi - start]))
                if whole is not None:
                    self._set(leaf, hashlib.sha256(whole).digest())

    def _piece(self, leaf: int, offset: int, piece: bytes) -> bytes | None:
        """Keep part of a leaf; the whole leaf once all its parts are in, else None."""
        end = offset + len(piece)
        with self._lock:
            pieces = self._pieces.setdefault(leaf, [])
            if self._leaves[leaf] is not None or any(
                at < end and offset < at + len(p) for at, p in pieces
            ):
                raise ValueError(f"bytes of leaf {leaf} were added twice")
            pieces.append((offset, piece))
            length = min(LEAF_BYTES, self._size - leaf * LEAF_BYTES)
            if sum(len(p) for _, p in pieces) < length:
                return None
            del self._pieces[leaf]
        return b"".join(p for _, p in sorted(pieces))  # they do not overlap: they tile it

    def _set(self, leaf: int, digest: bytes) -> None:
        with self._lock:
            if self._leaves[leaf] is not None or leaf in self._pieces:
                raise ValueError(f"bytes of leaf {leaf} were added twice")
            self._leaves[leaf] = digest

    def hexdigest(self) -> str:
        """The root of the tree, in hex.

        Raises:
            ValueError: some bytes of the object were not added.
        """
        level: list[bytes] = []
        for leaf, digest in enumerate(self._leaves):
            if digest is None:
                raise ValueError(f"bytes of leaf {leaf} are missing")
            level.append(digest)
        while len(level) > 1:
            pairs = [level[i : i + 2] for i in range(0, len(level), 2)]
            level = [hashlib.sha256(b"".join(p)).digest() if len(p) == 2 else p[0] for p in pairs]
        return level[0].hex()
