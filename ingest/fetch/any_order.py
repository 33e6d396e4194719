"""What the source digests fed in any order share (``crc_digest``, ``tree_digest``): an
object's size, a lock for the threads that feed them, and bytes checked against the size."""

from __future__ import annotations

import threading


class AnyOrderDigest:
    """A digest of an object of ``size`` bytes, fed pieces in any order from any thread.

    Raises (constructor):
        ValueError: ``size`` is negative.
    """

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError("size must not be negative")
        self._size = size
        self._lock = threading.Lock()

    def _inside(self, start: int, data: memoryview | bytes) -> memoryview:
        """``data`` as bytes, checked to lie at ``start`` inside the object.

        Raises:
            ValueError: the bytes lie outside the object.
        """
        view = memoryview(data).cast("B")
        end = start + len(view)
        if start < 0 or end > self._size:
            raise ValueError(f"bytes {start}-{end} are outside an object of {self._size}")
        return view
