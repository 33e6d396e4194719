"""The SHA-256 of a source object, fed in order as its bytes arrive (``source.sha256``).

SHA-256 is sequential, so one object is hashed on one core whatever the number
of ranges in flight: 0.56 core-s/GB on the 2-core CPU machine, 0.79 on the GPU
machine (hashlib, OpenSSL). That caps one large object at the hash rate.
``DICOM_INGEST_SOURCE_HASH=none`` turns it off for real-time use, where the
ETag and version identify the source well enough; the sidecar then says
``"sha256": null``.
"""

from __future__ import annotations

import hashlib

from ingest.settings import Settings


class SourceDigest:
    """The SHA-256 of the source object, fed in order; or nothing with ``source_hash=none``."""

    def __init__(self, settings: Settings, first: memoryview | bytes = b"") -> None:
        self._hash = hashlib.sha256(first) if settings.source_hash == "sha256" else None

    @property
    def enabled(self) -> bool:
        return self._hash is not None

    def update(self, data: memoryview) -> None:
        if self._hash is not None:
            self._hash.update(data)

    def hexdigest(self) -> str | None:
        return self._hash.hexdigest() if self._hash is not None else None
