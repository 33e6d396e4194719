"""The plain-header reader (``ingest/dicom/direct.py``) against pydicom's reading.

Whatever it accepts must read exactly as pydicom reads it; whatever it
declines goes to pydicom. Checked on every sample, good and bad input, on
headers edited by hand in the ways it must decline, and on mutants: the
header, or the error, is the same with and without it. It must also take the
common headers (CT slices, explicit and implicit VR), or it saves nothing.
"""

from __future__ import annotations

import collections
import struct
from unittest import mock

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import ingest.dicom.parse
from ingest.dicom.direct import read_plain_header
from ingest.dicom.parse import DicomHeader, parse_header
from ingest.embedded import samples
from ingest.errors import IngestError
from tests import bad_inputs
from tests.bad_inputs import insert_before_pixels, mutate, pixel_tag_at

LIMIT = 64 << 30


def read(data: bytes, direct: bool, size: int | None = None) -> object:
    """parse_header's header or (error type, message), with or without the direct reader."""
    size = len(data) if size is None else size
    try:
        if direct:
            return parse_header(data, size, max_header_bytes=64 << 20)
        with mock.patch.object(ingest.dicom.parse, "read_plain_header", return_value=None):
            return parse_header(data, size, max_header_bytes=64 << 20)
    except IngestError as exc:
        return (type(exc).__name__, str(exc))


def same_both_ways(data: bytes, size: int | None = None) -> None:
    assert read(data, True, size) == read(data, False, size)


def every_object() -> list[tuple[str, bytes]]:
    objects = [(name, data) for name, data in samples.pydicom_examples()]
    objects += [(item.key, item.data) for item in bad_inputs.good_objects()]
    objects += [(item.name, item.data) for item in bad_inputs.bad_objects()]
    objects += samples.synthetic_ct_series(2, rows=32, columns=32)
    objects += samples.synthetic_pet_series(2, rows=8, columns=8, time_slices=2)[1:3]
    objects.append(("multiframe", samples.synthetic_multiframe(5, 4, 4)))
    objects.append(("rgb", samples.synthetic_rgb(2, 8, 8)))
    return objects


@pytest.mark.parametrize(("name", "data"), every_object(), ids=lambda v: str(v)[:40])
def test_every_sample_and_bad_input_reads_the_same_both_ways(name: str, data: bytes) -> None:
    same_both_ways(data)
    plain = read_plain_header(data, len(data), LIMIT)
    if plain is not None:
        assert plain == read(data, False)


@pytest.mark.parametrize(
    "name", ["CT_small.dcm", "MR_small.dcm", "MR_small_implicit.dcm", "rtdose.dcm"]
)
def test_common_headers_take_the_direct_path(name: str) -> None:
    data = samples.example_bytes(name)
    plain = read_plain_header(data, len(data), LIMIT)
    assert isinstance(plain, DicomHeader)
    assert plain == read(data, False)


def test_a_pet_slice_takes_the_direct_path_with_its_number_of_slices() -> None:
    data = samples.synthetic_pet_series(3, 8, 8, time_slices=2)[4][1]
    plain = read_plain_header(data, len(data), LIMIT)
    assert isinstance(plain, DicomHeader)
    assert plain == read(data, False)
    assert plain.geometry is not None
    assert plain.geometry.number_of_slices == 3
    assert plain.geometry.number_of_time_slices == 2
    assert plain.geometry.number_of_time_slots is None


def test_a_ct_slice_takes_the_direct_path_whole_or_as_a_prefix() -> None:
    data = samples.synthetic_ct_series(1)[0][1]
    whole = read_plain_header(data, len(data), LIMIT)
    assert isinstance(whole, DicomHeader)
    assert whole.rescale
    assert whole.transform_intercepts == (-1024.0,)
    cut = pixel_tag_at(data) + 12  # a probe that ends right after the Pixel Data header
    assert read_plain_header(data[:cut], len(data), LIMIT) == whole
    assert read_plain_header(data[: cut - 1], len(data), LIMIT) is None  # pydicom: need more
    same_both_ways(data[: cut - 1], len(data))


def patch_element(data: bytes, tag: int, vr: bytes, value: bytes) -> bytes:
    """``data`` with the explicit VR element ``tag`` (short form) replaced."""
    head = struct.pack("<HH", tag >> 16, tag & 0xFFFF)
    at = data.index(head, 132)
    old_length = struct.unpack_from("<H", data, at + 6)[0]
    new = head + vr + struct.pack("<H", len(value)) + value
    return data[:at] + new + data[at + 8 + old_length :]


CT = samples.example_bytes("CT_small.dcm")
ROWS, PHOTOMETRIC, SLOPE, MODALITY = 0x00280010, 0x00280004, 0x00281053, 0x00080060
CHARSET = 0x00080005


@pytest.mark.parametrize(
    ("why", "data"),
    [
        ("Rows in another VR", patch_element(CT, ROWS, b"SS", b"\x80\x00")),
        ("Rows with two values", patch_element(CT, ROWS, b"US", b"\x80\x00\x80\x00")),
        ("two slopes", patch_element(CT, SLOPE, b"DS", b"1\\2 ")),
        ("an empty slope", patch_element(CT, SLOPE, b"DS", b"")),
        ("a slope that is not a number", patch_element(CT, SLOPE, b"DS", b"one ")),
        ("lower case in a code", patch_element(CT, MODALITY, b"CS", b"ct")),
        ("a NUL in the character set", patch_element(CT, CHARSET, b"CS", b"IS\0_IR 100")),
        ("an unknown character set", patch_element(CT, CHARSET, b"CS", b"ISO_IR 999")),
        ("a character set in another VR", patch_element(CT, CHARSET, b"KS", b"ISO_IR 100")),
        (
            "a meta VR pydicom cannot convert",
            CT.replace(b"\x02\x00\x00\x00UL", b"\x02\x00\x00\x00UM", 1),
        ),
        ("no DICM", b"\0" * 132 + CT[132:]),
        ("a Modality LUT Sequence", insert_before_pixels(CT, b"\x28\x00\x00\x30SQ\0\0\0\0\0\0")),
        ("a delimiter at the top level", insert_before_pixels(CT, b"\xfe\xff\x0d\xe0\0\0\0\0")),
        (
            "undefined-length UN",
            insert_before_pixels(CT, b"\x09\x00\x10\x10UN\0\0\xff\xff\xff\xff"),
        ),
    ],
)
def test_what_it_is_unsure_of_goes_to_pydicom(why: str, data: bytes) -> None:
    assert read_plain_header(data, len(data), LIMIT) is None, why
    same_both_ways(data)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(b"2.5 ", 2.5), (b" -1.25E+2", -125.0), (b".5", 0.5), (b"+3", 3.0), (b"1.", 1.0)],
)
def test_decimal_strings_read_as_pydicom_reads_them(value: bytes, expected: float) -> None:
    data = patch_element(CT, SLOPE, b"DS", value + b" " * (len(value) % 2))
    plain = read_plain_header(data, len(data), LIMIT)
    assert isinstance(plain, DicomHeader)
    assert plain.transform_slopes == (expected,)
    assert plain == read(data, False)


@pytest.mark.parametrize(
    "value", [b" MONOCHROME2", b"MONOCHROME2\0", b"MONOCHROME2 \0 ", b"  MONOCHROME2"]
)
def test_codes_lose_their_padding_as_in_pydicom(value: bytes) -> None:
    data = patch_element(CT, PHOTOMETRIC, b"CS", value + b" " * (len(value) % 2))
    plain = read_plain_header(data, len(data), LIMIT)
    assert isinstance(plain, DicomHeader)
    assert plain.photometric_interpretation == "MONOCHROME2"
    assert plain == read(data, False)


@st.composite
def mutated_headers(draw: st.DrawFn) -> bytes:
    """A CT slice (or pydicom's implicit VR MR) with 1-3 edits in its header."""
    base = draw(st.sampled_from([CT, samples.example_bytes("MR_small_implicit.dcm")]))
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 3))):
        mutate(draw, data, draw(st.integers(0, base.rfind(b"\xe0\x7f\x10\x00") + 12)))
    return bytes(data)


@settings(
    max_examples=1000,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(mutated_headers())
def test_mutated_headers_read_the_same_both_ways(data: bytes) -> None:
    same_both_ways(data)


@pytest.mark.slow
def test_many_mutated_headers_counted() -> None:
    """3,000 mutants: any the direct reader takes reads as pydicom reads it. Prints how
    many it took and how many it left to pydicom, and what pydicom made of those
    (``pytest -s``): it takes too few to save anything if it declines most."""
    seen: collections.Counter[str] = collections.Counter()

    @settings(
        max_examples=3000,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(mutated_headers())
    def check(data: bytes) -> None:
        plain = read_plain_header(data, len(data), LIMIT)
        slow = read(data, False)
        if plain is None:
            gave = slow[0] if isinstance(slow, tuple) else "a header"
            seen[f"left to pydicom, which gave {gave}"] += 1
        else:
            assert plain == slow, (plain, slow)
            seen["read directly, as pydicom reads it"] += 1

    check()
    print()
    for what, count in seen.most_common():
        print(f"{count:6d}  {what}")
    assert seen["read directly, as pydicom reads it"] > 0
