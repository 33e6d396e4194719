"""The CRC64NVME of a source object (``source.crc64nvme``), fed in any order.

CRC64NVME is the full-object checksum Amazon S3 computes for every object
uploaded since 2025 (and for any upload that asks for it): ``aws s3api
head-object --checksum-mode ENABLED`` shows it as ``ChecksumCRC64NVME``, the
base64 of its 8 big-endian bytes, which is the form the sidecar uses. So a
sidecar's value can be checked against what S3 itself stored, with no copy of
the object and no tool of ours.

Why it is the default: a CRC is linear, so the CRC of ``A || B`` follows from
the CRCs of ``A`` and ``B`` and the length of ``B`` (``combine_crc64nvme``).
Each range is checksummed as soon as it is read, in whatever order ranges
arrive, and the parts are combined at the end. awscrt's CRC64NVME uses the
carry-less multiply instructions (PCLMULQDQ/VPCLMULQDQ, PMULL on ARM), many
times SHA-256's rate on one core, so the digest no longer holds a large object
to one core's hash rate (docs/benchmarks.md, "The source digest"). It detects
corruption, not tampering: ``sha256`` remains the setting for a cryptographic
digest.
"""

from __future__ import annotations

import base64

from awscrt.checksums import combine_crc64nvme, crc64nvme

from ingest.fetch.any_order import AnyOrderDigest


class CrcDigest(AnyOrderDigest):
    """The CRC64NVME of an object of ``size`` bytes; ``add`` its bytes once each, in any
    order and from any thread, then ``b64digest``."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self._parts: list[tuple[int, int, int]] = []  # (start, length, crc)

    def add(self, start: int, data: memoryview | bytes) -> None:
        """Take bytes ``[start, start + len(data))`` of the object.

        Raises:
            ValueError: the bytes lie outside the object.
        """
        view = self._inside(start, data)
        if not view:
            return
        crc: int = crc64nvme(view)
        with self._lock:
            self._parts.append((start, len(view), crc))

    def value(self) -> int:
        """The object's CRC64NVME, once every byte was added exactly once.

        Raises:
            ValueError: some bytes were never added, or some twice.
        """
        with self._lock:
            parts = sorted(self._parts)
        crc, at = 0, 0
        for start, length, part in parts:
            if start != at:
                what = "missing" if start > at else "given twice"
                raise ValueError(f"bytes from {min(start, at)} of the object are {what}")
            crc = combine_crc64nvme(crc, part, length)
            at = start + length
        if at != self._size:
            raise ValueError(f"bytes from {at} of an object of {self._size} are missing")
        return crc

    def b64digest(self) -> str:
        """The CRC as S3 shows it: base64 of its 8 big-endian bytes."""
        return base64.b64encode(self.value().to_bytes(8, "big")).decode("ascii")
