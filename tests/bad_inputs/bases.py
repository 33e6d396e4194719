"""The test settings the corpus is sized against, the types of its entries, and the valid
objects the bad ones are made from.

Sizes are chosen against the test settings: objects up to ``PART_SIZE`` (64 KiB) take the
single-GET path, larger ones the multi-range path (header probe, then ranged Pixel Data),
and ``MAX_HEADER_BYTES`` (256 KiB) is the header bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from ingest.embedded import samples
from ingest.errors import IngestError

PART_SIZE: Final = 64 * 1024
MAX_HEADER_BYTES: Final = 256 * 1024
MIB: Final = 1024 * 1024

ReadPath = Literal["single", "ranged"]


@dataclass(frozen=True, slots=True)
class BadObject:
    """An object that must be dead-lettered with ``error.reason``."""

    name: str
    kind: str  # the family it belongs to, for counting
    data: bytes
    error: type[IngestError]  # the error the parser must raise
    syntax: str | None = None  # a compressed object's: its dead letter must name it

    @property
    def reason(self) -> str:
        return self.error.reason

    @property
    def path(self) -> ReadPath:
        return "single" if len(self.data) <= PART_SIZE else "ranged"


@dataclass(frozen=True, slots=True)
class GoodObject:
    """An object that must be processed, announced in ``fmt`` under an awkward ``key``."""

    key: str
    data: bytes
    fmt: str = "aws"  # aws | minio | eventbridge | ceph


def small_base() -> bytes:
    """2 frames of 4 x 3, 16-bit, per-frame rescale: 48 bytes of Pixel Data (single GET)."""
    return samples.synthetic_multiframe(2, 4, 3)


def large_base() -> bytes:
    """12 frames of 128 x 96, 16-bit: ~300 KB, so the multi-range path at 64 KiB parts."""
    return samples.synthetic_multiframe(12, 128, 96)


def ct_small() -> bytes:
    return samples.example_bytes("CT_small.dcm")


def encapsulated_small() -> bytes:
    """Encapsulated Uncompressed, 4 frames of 32 x 32 16-bit with a Basic Offset Table:
    one GET."""
    return samples.synthetic_multiframe(4, 32, 32, encapsulated="basic")


def encapsulated_large() -> bytes:
    """Encapsulated Uncompressed, 40 frames of 64 x 64 16-bit, no offset table: ~330 KB,
    the multi-range path at 64 KiB parts (seven frames a chunk)."""
    return samples.synthetic_multiframe(40, 64, 64, encapsulated="none")
