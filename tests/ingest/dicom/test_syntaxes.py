"""The transfer syntax table against pydicom's own sets, and docs/dicom-support.md against it."""

from __future__ import annotations

import re

from pydicom.uid import (
    JPEG2000MC,
    AllTransferSyntaxes,
    JPEG2000MCLossless,
    JPEG2000TransferSyntaxes,
    JPEGLSTransferSyntaxes,
    JPEGTransferSyntaxes,
    RLETransferSyntaxes,
    UncompressedTransferSyntaxes,
)

from ingest.dicom.syntaxes import (
    COMPRESSED,
    ENCAPSULATED_UNCOMPRESSED,
    NATIVE_LE,
    READABLE,
    SYNTAXES,
)
from tests.paths import ROOT

DOC = ROOT / "docs" / "dicom-support.md"


def test_the_families_are_pydicoms() -> None:
    by_family: dict[str, set[str]] = {}
    for uid, syntax in SYNTAXES.items():
        assert syntax.uid == uid
        by_family.setdefault(syntax.family, set()).add(uid)
    assert by_family["rle"] == set(RLETransferSyntaxes)
    assert by_family["jpeg"] == set(JPEGTransferSyntaxes)
    assert by_family["jpeg-ls"] == set(JPEGLSTransferSyntaxes)
    # pydicom counts HTJ2K as JPEG 2000; Part 2 (multi-component) has no decoder
    j2k = set(JPEG2000TransferSyntaxes) - {JPEG2000MC, JPEG2000MCLossless}
    assert by_family["jpeg2000"] | by_family["htj2k"] == j2k
    assert all(SYNTAXES[uid].uid.keyword.startswith("HTJ2K") for uid in by_family["htj2k"])
    assert by_family["native"] == {*UncompressedTransferSyntaxes, ENCAPSULATED_UNCOMPRESSED}


def test_every_syntax_is_one_pydicom_knows_and_its_names_are_distinct() -> None:
    assert set(SYNTAXES) - {ENCAPSULATED_UNCOMPRESSED} <= set(AllTransferSyntaxes)
    names = [syntax.name for syntax in SYNTAXES.values()]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name) for name in names)


def test_what_the_device_takes_as_stored_and_what_the_header_reader_reads() -> None:
    plain = {"1.2.840.10008.1.2", "1.2.840.10008.1.2.1", "1.2.840.10008.1.2.1.98"}
    assert set(NATIVE_LE) == plain
    assert set(SYNTAXES) - READABLE == {"1.2.840.10008.1.2.1.99"}  # Deflated: inflated first
    assert {uid for uid in COMPRESSED if not SYNTAXES[uid].lossless} == {
        "1.2.840.10008.1.2.4.50",
        "1.2.840.10008.1.2.4.51",
        "1.2.840.10008.1.2.4.81",
        "1.2.840.10008.1.2.4.91",
        "1.2.840.10008.1.2.4.203",
    }


def test_docs_name_every_syntax_as_the_table_does() -> None:
    """docs/dicom-support.md's transfer syntax table: a row per syntax, its UID and name."""
    rows = re.findall(
        r"^\| [^|]+ \| (1\.2\.840\.10008[0-9.]*) \| `([a-z0-9-]+)` \|", DOC.read_text(), re.M
    )
    assert dict(rows) == {uid: syntax.name for uid, syntax in SYNTAXES.items()}
    assert len(rows) == len(SYNTAXES)
