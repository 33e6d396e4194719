"""The whole corpus: every bad object in a fixed order (``bad_objects``), and the good
objects that must be processed (``good_objects``), some under awkward keys."""

from __future__ import annotations

from typing import Final

from ingest.embedded import samples
from tests.bad_inputs.bases import (
    MAX_HEADER_BYTES,
    PART_SIZE,
    BadObject,
    GoodObject,
    ct_small,
    encapsulated_large,
    encapsulated_small,
    large_base,
)
from tests.bad_inputs.compressed import _compressed, compressed_bases, compressed_cases
from tests.bad_inputs.deflated import deflated_cases, deflated_goods
from tests.bad_inputs.edits import insert_before_pixels, nested_sequences, padded, private_ob
from tests.bad_inputs.native import (
    _encapsulated,
    _limits,
    _lying_headers,
    _nested,
    _not_dicom,
    _truncated,
    _unsupported,
)

# pydicom's sample files of the syntaxes and pixel semantics the worker now decodes
DECODED_SAMPLES: Final = (
    "JPEG2000.dcm",
    "MR_small_RLE.dcm",
    "JPGExtended.dcm",
    "MR_small_jpeg_ls_lossless.dcm",
    "MR_small_bigendian.dcm",
    "examples_palette.dcm",
    "image_dfl.dcm",  # Deflated: inflated as it is read (bad ones: ``deflated_cases``)
)


def bad_objects() -> list[BadObject]:
    """Every bad object, in a fixed order; names are unique."""
    corpus = [
        *_not_dicom(),
        *_truncated(),
        *_lying_headers(),
        *_encapsulated(),
        *_nested(),
        *_limits(),
        *_unsupported(),
        *deflated_cases(),
        *_compressed(),
    ]
    names = [item.name for item in corpus]
    assert len(set(names)) == len(names), "corpus names must be unique"
    return corpus


# -- good objects under awkward keys ---------------------------------------------------

ODD_KEYS: Final = (
    ("odd keys/with space and+plus.dcm", "aws"),
    ("odd keys/100% literal %41 and %2B.dcm", "aws"),
    ("odd keys/ünïcødé 日本語 🩻.dcm", "aws"),
    ("odd keys/a+b=c&d?e#f;g,h@i$j.dcm", "minio"),
    ("odd keys/eventbridge ü+%.dcm", "eventbridge"),
    ("odd keys/ceph raw+plus %41 ü.dcm", "ceph"),
)


def good_objects() -> list[GoodObject]:
    """Valid objects: both read paths, odd keys in every format, defined-length nesting."""
    ct = samples.synthetic_ct_series(len(ODD_KEYS), rows=64, columns=64, seed=7)
    out = [GoodObject(key, data, fmt) for (key, fmt), (_, data) in zip(ODD_KEYS, ct, strict=True)]
    out.append(GoodObject("good/CT_small.dcm", ct_small()))
    out.append(GoodObject("good/multiframe-ranged.dcm", large_base()))
    out.append(GoodObject("good/rgb-planar.dcm", samples.synthetic_rgb(3, 64, 80, planar=True)))
    out.append(GoodObject("good/rtdose.dcm", samples.example_bytes("rtdose.dcm")))
    out.append(GoodObject("good/encapsulated.dcm", encapsulated_small()))
    out.append(GoodObject("good/encapsulated-ranged.dcm", encapsulated_large()))
    nested = insert_before_pixels(ct_small(), nested_sequences(500, defined=True))
    out.append(GoodObject("good/nested-defined-500.dcm", nested))
    ranged_header = insert_before_pixels(ct_small(), private_ob(150 * 1024))  # under 256 KiB
    out.append(GoodObject("good/header-150k.dcm", ranged_header))
    # the edges: the last single-GET size, the first ranged one, a header right at the limit
    out.append(GoodObject("good/exactly-part-size.dcm", padded(ct_small(), size=PART_SIZE)))
    out.append(GoodObject("good/part-size-plus-2.dcm", padded(ct_small(), size=PART_SIZE + 2)))
    at_limit = padded(ct_small(), header_end=MAX_HEADER_BYTES)
    out.append(GoodObject("good/header-ends-at-limit.dcm", at_limit))
    out += [
        GoodObject(f"good/pydicom/{name}", samples.example_bytes(name)) for name in DECODED_SAMPLES
    ]
    out += [GoodObject(f"good/deflated/{name}.dcm", data) for name, data in deflated_goods()]
    # the compressed bases, and their mutants that decode (to what pydicom's pixel_array gives)
    out += [GoodObject(f"good/compressed/{b.name}.dcm", b.write()) for b in compressed_bases()]
    out += [
        GoodObject(f"good/compressed/{case.name}.dcm", case.data)
        for case in compressed_cases()
        if case.error is None and case.bug is None
    ]
    return out
