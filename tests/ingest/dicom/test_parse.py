"""ingest.dicom.parse.parse_header: pixel location, prefixes, and every kind of bad input."""

from __future__ import annotations

import dataclasses
import functools
import struct
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydicom import dcmread, dcmwrite
from pydicom.dataelem import DataElement
from pydicom.dataset import Dataset
from pydicom.uid import HTJ2KLossless, JPEG2000Lossless

from ingest.dicom.codec import conversions
from ingest.dicom.parse import DicomHeader, NeedMoreBytes, parse_header
from ingest.embedded import samples
from ingest.embedded.samples_compressed import compressed_ct_volume
from ingest.errors import (
    DeflatedDataSet,
    DicomError,
    LimitExceeded,
    MalformedDicom,
    NotDicom,
    UnsupportedDicom,
)
from ingest_gpu.formats import PixelFormat
from tests.bad_inputs import edit, mutate, nested_sequences
from tests.reference import reference_array

PATIENT_TEXT = ("PHANTOM", "SYNTHETIC", "CompressedSamples")  # names in the sample files

SYNTHETIC: dict[str, Callable[[], bytes]] = {
    "ct-slice": lambda: samples.synthetic_ct_series(1, rows=64, columns=48)[0][1],
    "mf-u16-per-frame": lambda: samples.synthetic_multiframe(4, 6, 5),
    "mf-i16-shared": lambda: samples.synthetic_multiframe(
        3, 5, 7, signed=True, per_frame_rescale=False
    ),
    "mf-u8": lambda: samples.synthetic_multiframe(3, 5, 7, bits_allocated=8, bits_stored=6),
    "mf-i8": lambda: samples.synthetic_multiframe(2, 3, 3, bits_allocated=8, signed=True),
    "mf-u32": lambda: samples.synthetic_multiframe(2, 4, 4, bits_allocated=32),
    "mf-i32": lambda: samples.synthetic_multiframe(2, 4, 4, bits_allocated=32, signed=True),
    "rgb-planar0-odd": lambda: samples.synthetic_rgb(1, 3, 5),
    "rgb-planar1": lambda: samples.synthetic_rgb(2, 4, 6, planar=True),
}
CASES = [(name, None) for name in samples.EXAMPLES_NATIVE] + [
    (name, make) for name, make in SYNTHETIC.items()
]


def load(name: str, make: Callable[[], bytes] | None) -> bytes:
    return make() if make is not None else samples.example_bytes(name)


def parse(data: bytes, **kwargs: Any) -> DicomHeader:
    header = parse_header(data, len(data), **kwargs)
    assert isinstance(header, DicomHeader)
    return header


def twin(data: bytes, header: DicomHeader, window: tuple[float, float] | None) -> np.ndarray:
    """The contract computed from the header alone, as the preprocessing stage must."""
    p = header.pixel
    raw = np.frombuffer(data, p.stored_dtype, p.total_elements, header.pixel_offset).copy()
    shift = p.bits_allocated - p.bits_stored
    np.left_shift(raw, shift, out=raw)
    np.right_shift(raw, shift, out=raw)  # arithmetic when signed: sign extension
    if p.planar:
        values = raw.reshape(p.frames, 3, p.rows, p.columns).transpose(0, 2, 3, 1)
    else:
        values = raw.reshape(p.shape)
    t = header.transform(window, "float32")
    x: np.ndarray = values
    if t.rescale:
        x = np.empty(values.shape, np.float64)
        for i in range(p.frames):
            k = i if len(t.slopes) > 1 else 0
            x[i] = values[i].astype(np.float64) * t.slopes[k]
            x[i] += t.intercepts[k]
    if t.window is not None:
        c, w = t.window
        x = np.clip((x.astype(np.float64) - (c - 0.5)) / (w - 1) + 0.5, 0.0, 1.0)
    return x.astype(t.out_dtype)


def patch(data: bytes, tag: int, value: bytes) -> bytes:
    """``data`` with the first explicit-VR (short length) element ``tag`` given ``value``."""
    head = struct.pack("<HH", tag >> 16, tag & 0xFFFF)
    at = data.index(head, 132)
    length = struct.unpack_from("<H", data, at + 6)[0]
    new = data[at : at + 6] + struct.pack("<H", len(value)) + value
    return data[:at] + new + data[at + 8 + length :]


def raises(data: bytes, kind: type[Exception], match: str | None = None) -> None:
    with pytest.raises(kind, match=match) as info:
        parse_header(data, len(data))
    assert not any(text in str(info.value) for text in PATIENT_TEXT)


# --- the location of the pixels --------------------------------------------------------


@pytest.mark.parametrize(("name", "make"), CASES, ids=[c[0] for c in CASES])
def test_pixel_location_and_contract(name: str, make: Callable[[], bytes] | None) -> None:
    data = load(name, make)
    header = parse(data)
    p = header.pixel
    assert header.pixel_length == p.total_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. MR_small_padded: "excess padding"
        ds = dcmread(BytesIO(data))
        decoded = ds.pixel_array
    located = np.frombuffer(data[header.pixel_offset :][: header.pixel_length], p.stored_dtype)
    raw = np.frombuffer(ds.PixelData[: header.pixel_length], p.stored_dtype)
    np.testing.assert_array_equal(located, raw)  # pydicom's stored values, before masking
    assert decoded.size == p.total_elements
    for window in (None, (40.0, 400.0)):
        ours, ref = twin(data, header, window), reference_array(data, window, "float32")
        assert ours.shape == ref.shape == p.shape
        np.testing.assert_array_equal(ours, ref)


def test_sample_specifics() -> None:
    ct = parse(samples.example_bytes("CT_small.dcm"))
    assert (ct.rescale, ct.transform_slopes, ct.transform_intercepts) == (True, (1.0,), (-1024.0,))
    assert ct.transfer_syntax_uid == "1.2.840.10008.1.2.1"
    assert ct.modality == "CT"
    assert ct.sop_instance_uid
    assert ct.study_instance_uid
    dose = parse(samples.example_bytes("rtdose.dcm"))
    assert dose.transfer_syntax_uid == "1.2.840.10008.1.2"
    assert dose.pixel == PixelFormat(10, 10, 15, 1, 32, 32, False, False)
    assert dose.rescale is False  # Dose Grid Scaling is not a Modality LUT
    odd = samples.example_bytes("SC_rgb_small_odd.dcm")
    header = parse(odd)
    assert header.pixel_length == 27
    length = struct.unpack_from("<I", odd, header.pixel_offset - 4)[0]
    assert length == 28  # the element holds the pad byte, we read 27
    mf = parse(samples.synthetic_multiframe(4, 2, 2))
    assert mf.transform_slopes == (0.5, 0.75, 1.0, 1.25)
    assert mf.transform_intercepts == (-1024.0, -1016.0, -1008.0, -1000.0)
    shared = parse(samples.synthetic_multiframe(4, 2, 2, per_frame_rescale=False))
    assert (shared.transform_slopes, shared.transform_intercepts) == ((0.5,), (-100.0,))
    t = mf.transform((1.0, 2.0), "float16")
    assert (t.window, t.out_dtype, t.rescale, t.slopes) == (
        (1.0, 2.0),
        "float16",
        True,
        mf.transform_slopes,
    )


def test_no_meta_dataset_is_accepted_with_inferred_syntax() -> None:
    full = samples.example_bytes("MR_small_implicit.dcm")
    start = 132 + 12 + struct.unpack_from("<I", full, 140)[0]  # after the file meta group
    data = full[start:]
    header = parse(data)
    assert header.transfer_syntax_uid == "1.2.840.10008.1.2"
    assert header.pixel_offset == parse(full).pixel_offset - start
    np.testing.assert_array_equal(twin(data, header, None), reference_array(data, None, "float32"))


# --- prefixes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "make"), CASES[:4] + CASES[-3:], ids=[c[0] for c in CASES[:4] + CASES[-3:]]
)
def test_prefixes_ask_for_more_then_succeed(name: str, make: Callable[[], bytes] | None) -> None:
    data = load(name, make)
    full = parse(data)
    size = len(data)
    for cut in [*range(0, full.pixel_offset, 97), full.pixel_offset - 1]:
        result = parse_header(data[:cut], size)
        assert isinstance(result, NeedMoreBytes), cut
        assert cut < result.at_least <= size
    for cut in (full.pixel_offset, full.pixel_offset + 1, size):
        assert parse_header(data[:cut], size) == full
    got, have = parse_header(b"", size), 0  # the worker's loop
    while isinstance(got, NeedMoreBytes):
        assert got.at_least > have
        have = got.at_least
        got = parse_header(memoryview(data)[:have], size)
    assert got == full


# and compressed volumes, whose layout leaves the per-frame groups unread as a native one's
LAYOUT_CASES: list[tuple[str, Callable[[], bytes] | None]] = [
    *CASES,
    *[
        (f"volume-{name}", functools.partial(compressed_ct_volume, syntax, 5, 64, 64))
        for name, syntax in (("j2k", JPEG2000Lossless), ("htj2k", HTJ2KLossless))
    ],
]


@pytest.mark.parametrize(("name", "make"), LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
def test_layout_first_then_in_full(name: str, make: Callable[[], bytes] | None) -> None:
    """``per_frame=False`` (a large object's first parse in the worker) gives the full
    header but for per-frame rescale values and geometry, which wait for the parse in full;
    ``geometry=False`` (what the frames wait for) all but the frames' plane positions."""
    data = load(name, make)
    full = parse(data)
    rescaled = parse(data, geometry=False)
    assert dataclasses.replace(rescaled, geometry=full.geometry, slide=full.slide) == full
    layout = parse(data, per_frame=False)
    has_groups = "PerFrameFunctionalGroupsSequence" in dcmread(
        BytesIO(data), stop_before_pixels=True, force=True
    )
    assert layout.per_frame_pending is has_groups
    assert (rescaled.geometry is None) is has_groups
    if not has_groups:
        assert layout == full
        return
    assert (layout.transform_slopes, layout.transform_intercepts) == ((), ())
    with pytest.raises(RuntimeError, match="parse in full"):
        layout.transform(None, "float32")
    completed = dataclasses.replace(
        layout,
        transform_slopes=full.transform_slopes,
        transform_intercepts=full.transform_intercepts,
        rescale=full.rescale,
        per_frame_pending=False,
        geometry=full.geometry,  # its per-frame positions wait with the rescale values
        slide=full.slide,
    )
    assert layout.geometry is None
    assert completed == full


def test_header_limit() -> None:
    data = samples.example_bytes("CT_small.dcm")  # Pixel Data at 6300
    with pytest.raises(LimitExceeded, match="header larger than 4096"):
        parse_header(data[:4096], len(data), max_header_bytes=4096)
    result = parse_header(data[:1000], len(data), max_header_bytes=4096)
    assert result == NeedMoreBytes(4096)
    with pytest.raises(ValueError, match="smaller than the prefix"):
        parse_header(data, 10)


# --- bad inputs --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (b"", NotDicom),
        (b"\0" * 200, NotDicom),
        (np.random.default_rng(1).bytes(5000), NotDicom),
        (samples.not_dicom()[1], NotDicom),
        (b"hello, this is text and certainly not a DICOM file\n" * 20, NotDicom),
        (b"\0" * 128 + b"DICM", UnsupportedDicom),  # DICOM, but nothing in it
        (b"\0" * 128 + b"DICM" + np.random.default_rng(2).bytes(3000), DicomError),
    ],
    ids=["empty", "zeros", "random", "png", "text", "bare-dicm", "dicm-random"],
)
def test_not_dicom(data: bytes, kind: type[Exception]) -> None:
    raises(data, kind)


@pytest.mark.parametrize(
    ("name", "kind", "match"),
    [
        ("test-SR.dcm", UnsupportedDicom, "no Pixel Data"),
        ("MR_truncated.dcm", MalformedDicom, "truncated"),
        ("badVR.dcm", MalformedDicom, "Number of Frames is not an integer"),
        ("rtplan_truncated.dcm", MalformedDicom, "not reachable"),
        ("no_meta.dcm", NotDicom, "DICM"),  # CT_small without meta, but its first byte lost
        ("rtstruct.dcm", NotDicom, "no Pixel Data"),  # no meta and no image
    ],
)
def test_pydicom_examples_we_refuse(name: str, kind: type[Exception], match: str) -> None:
    raises(samples.example_bytes(name), kind, match)


def test_a_deflated_object_is_told_apart_not_inflated() -> None:
    """The parser of stored bytes does not read a Deflated data set: it says where the
    stream starts (``ingest.dicom.deflate`` inflates it; tests/ingest/dicom/test_deflate.py), and a
    caller that does not inflate takes that for unsupported."""
    data = samples.example_bytes("image_dfl.dcm")
    with pytest.raises(DeflatedDataSet, match="Deflated Explicit VR Little Endian") as told:
        parse_header(data, len(data))
    assert isinstance(told.value, UnsupportedDicom)
    assert told.value.data_set_offset == 334  # the end of its file meta
    assert parse_header(data[:200], len(data)) == NeedMoreBytes(at_least=len(data))


@pytest.mark.parametrize(
    ("name", "syntax", "shape", "conversion"),
    [
        ("JPEG2000.dcm", "1.2.840.10008.1.2.4.91", (1, 1024, 256), "decode:jpeg2000"),
        ("MR_small_RLE.dcm", "1.2.840.10008.1.2.5", (1, 64, 64), "decode:rle"),
        ("JPGExtended.dcm", "1.2.840.10008.1.2.4.51", (1, 1024, 256), "decode:jpeg-extended"),
        ("MR_small_jpeg_ls_lossless.dcm", "1.2.840.10008.1.2.4.80", (1, 64, 64), "decode:jpeg-ls"),
        ("MR_small_bigendian.dcm", "1.2.840.10008.1.2.2", (1, 64, 64), "big_endian"),
        ("examples_palette.dcm", "1.2.840.10008.1.2.1", (1, 350, 800, 3), "palette"),
        ("SC_ybr_full_422_uncompressed.dcm", "1.2.840.10008.1.2.1", (1, 100, 100, 3), "ybr"),
        ("liver_1frame.dcm", "1.2.840.10008.1.2.1", (1, 512, 512), "bits_allocated_1"),
    ],
)
def test_pydicom_examples_decoded_before_the_device(
    name: str, syntax: str, shape: tuple[int, ...], conversion: str
) -> None:
    """What the device cannot take as stored gets a codec: its layout is the decoded one."""
    header = parse(samples.example_bytes(name))
    assert header.codec is not None
    assert header.transfer_syntax_uid == syntax
    assert header.pixel.shape == shape
    assert any(conversion in step for step in conversions(header.codec)), conversions(header.codec)


def small() -> bytes:
    return samples.synthetic_multiframe(2, 4, 3)  # 16-bit unsigned, per-frame rescale


@pytest.mark.parametrize(
    ("changes", "kind", "match"),
    [
        ({"Rows": None}, MalformedDicom, "missing Rows"),
        ({"BitsStored": None}, MalformedDicom, "missing Bits Stored"),
        ({"PhotometricInterpretation": None}, MalformedDicom, "missing Photometric"),
        ({"Rows": 0}, MalformedDicom, "0 x 3"),
        ({"BitsAllocated": 12}, MalformedDicom, "Bits Allocated 12"),
        ({"BitsAllocated": 64}, UnsupportedDicom, "Bits Allocated 64"),
        ({"BitsStored": 17}, MalformedDicom, "Bits Stored 17"),
        ({"PixelRepresentation": 2}, MalformedDicom, "Pixel Representation 2"),
        ({"SamplesPerPixel": 2}, MalformedDicom, "2 samples"),
        ({"PhotometricInterpretation": "YBR_FULL"}, MalformedDicom, "YBR_FULL with 1 samples"),
        ({"PhotometricInterpretation": "PHANTOM"}, UnsupportedDicom, "unknown value"),
        ({"NumberOfFrames": "-1"}, MalformedDicom, "below 1"),
        ({"NumberOfFrames": 3}, MalformedDicom, "holds 48 bytes but the header needs 72"),
        ({"NumberOfFrames": 1}, MalformedDicom, "more frames"),
        (
            {"NumberOfFrames": 2**31 - 1, "Rows": 4096, "Columns": 4096},
            LimitExceeded,
            "exceeds the limit",
        ),
        ({"PerFrameFunctionalGroupsSequence": []}, None, None),  # falls back to nothing
        ({"ModalityLUTSequence": [Dataset()]}, MalformedDicom, "missing Modality LUT Descriptor"),
        (
            {"Rows": DataElement(0x00280010, "UL", 70000)},
            MalformedDicom,
            "70000 x 3",
        ),
    ],
)
def test_bad_image_elements(
    changes: dict[str, Any], kind: type[Exception] | None, match: str | None
) -> None:
    data = edit(small(), **changes)
    if kind is None:
        assert parse(data).rescale is False
    else:
        raises(data, kind, match)


def test_rescale_values() -> None:
    ct = samples.example_bytes("CT_small.dcm")
    assert parse(edit(ct, RescaleSlope=None)).rescale is False  # pydicom needs both
    raises(edit(ct, RescaleSlope=DataElement(0x00281053, "DS", None)), MalformedDicom, "empty")
    slope = 0x00281053
    raises(patch(ct, slope, b"PHANTOM "), MalformedDicom, "RescaleSlope is not a single")
    raises(patch(ct, slope, b"1\\2 "), MalformedDicom, "RescaleSlope is not a single")
    raises(patch(ct, slope, b"NaN "), MalformedDicom, "not finite")
    raises(patch(ct, slope, b"-inf"), MalformedDicom, "not finite")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = dcmread(BytesIO(small()))
        ds.PerFrameFunctionalGroupsSequence[1].PixelValueTransformationSequence = []
        out = BytesIO()
        dcmwrite(out, ds, enforce_file_format=True)
    raises(out.getvalue(), MalformedDicom, "frame 1 has no Pixel Value Transformation")
    groups = dcmread(BytesIO(small())).PerFrameFunctionalGroupsSequence
    three = edit(small(), PerFrameFunctionalGroupsSequence=[*groups, groups[0]])
    raises(three, MalformedDicom, "3 per-frame functional groups for 2 frames")


def pixel_at(data: bytes) -> int:
    return parse(data).pixel_offset


def test_values_are_never_echoed() -> None:
    data = small()
    raises(patch(data, 0x00280008, b"PHANTOM "), MalformedDicom, "Number of Frames is not")
    raises(patch(data, 0x00280004, b"PHANTOM "), UnsupportedDicom, "unknown value")
    meta = patch(data, 0x00020010, b"PHANTOM^SYNTHETIC\0")
    raises(meta, UnsupportedDicom, r"transfer syntax \(not a UID\)")


def test_lengths_that_lie() -> None:
    data = small()
    at = pixel_at(data)
    huge = data[: at - 4] + struct.pack("<I", 0xFFFFFFF0) + data[at:]
    raises(huge, MalformedDicom, "runs past")
    undefined = data[: at - 4] + struct.pack("<I", 0xFFFFFFFF) + data[at:]
    raises(undefined, MalformedDicom, "undefined length")
    raises(data[: at + 10], MalformedDicom, "truncated")  # cut in the pixel data
    raises(data[: at - 2], MalformedDicom, "truncated")  # cut in the element header
    # a header element whose length swallows the rest of the object
    ct = samples.example_bytes("CT_small.dcm")
    rows = ct.index(b"\x28\x00\x10\x00US\x02\x00")
    swallow = ct[: rows + 4] + b"OB\0\0" + struct.pack("<I", 0x7FFFFFFF) + ct[rows + 8 :]
    raises(swallow, MalformedDicom, "not reachable")
    # a wrong VR on Pixel Data itself
    bad_vr = data[: at - 8] + b"US" + data[at - 6 :]
    raises(bad_vr, MalformedDicom, "VR")


@pytest.mark.parametrize("cut", [200, 400, 700, 1001])
def test_cut_in_header(cut: int) -> None:
    data = samples.example_bytes("CT_small.dcm")[:cut]
    raises(data, DicomError)


def test_overflowing_sizes() -> None:
    rgb = samples.synthetic_rgb(1, 2, 2)
    # 65535 * 65535 * (2**31 - 1) * 3 * 4 bytes wraps around 2**64 in fixed-width integers
    big = edit(
        rgb,
        Rows=65535,
        Columns=65535,
        NumberOfFrames=2**31 - 1,
        BitsAllocated=32,
        BitsStored=32,
    )
    raises(big, LimitExceeded, "exceeds the limit")
    data = small()
    with pytest.raises(LimitExceeded):
        parse_header(data, len(data), max_pixel_bytes=47)
    assert parse(data, max_pixel_bytes=48).pixel_length == 48


def test_deeply_nested_sequences_in_a_thread() -> None:
    data = samples.example_bytes("CT_small.dcm")
    at = pixel_at(data) - 12
    undefined = data[:at] + nested_sequences(500, defined=False) + data[at:]
    defined = data[:at] + nested_sequences(500, defined=True) + data[at:]
    with ThreadPoolExecutor(1) as pool:
        with pytest.raises(MalformedDicom, match="nested too deeply"):
            pool.submit(parse_header, undefined, len(undefined)).result()
        header = pool.submit(parse_header, defined, len(defined)).result()
    assert isinstance(header, DicomHeader)  # defined lengths are parsed lazily, never deep
    assert header.pixel_offset == pixel_at(data) + len(nested_sequences(500, defined=True))


def test_float_pixel_data() -> None:
    data = small()
    at = pixel_at(data) - 12
    floats = data[:at] + struct.pack("<HH2sHI", 0x7FE0, 0x0008, b"OF", 0, 8) + b"\0" * 8
    raises(floats, UnsupportedDicom, "Float Pixel Data")


def test_warnings_and_threads() -> None:
    filters = list(warnings.filters)
    data = [samples.example_bytes(n) for n in ("badVR.dcm", "CT_small.dcm", "MR_small.dcm")]

    def work(i: int) -> str:
        blob = data[i % 3]
        try:
            return repr(parse_header(blob, len(blob)))
        except DicomError as exc:
            return type(exc).__name__

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, range(60)))
    assert results == [work(i) for i in range(60)]
    assert warnings.filters == filters
    assert threading.active_count() >= 1


# --- fuzzing -------------------------------------------------------------------------------

FUZZ_BASES = [
    samples.synthetic_multiframe(2, 3, 2),
    samples.example_bytes("rtdose_1frame.dcm"),
    samples.example_bytes("MR_small_implicit.dcm")[:1700],
]
ALLOWED = (DicomError, LimitExceeded)


@st.composite
def mutated(draw: st.DrawFn) -> tuple[bytes, int]:
    data = bytearray(draw(st.sampled_from(FUZZ_BASES)))
    for _ in range(draw(st.integers(1, 6))):
        mutate(draw, data, draw(st.integers(0, len(data))))
    cut = draw(st.one_of(st.just(len(data)), st.integers(0, len(data))))
    return bytes(data), cut


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutations_raise_only_our_errors(case: tuple[bytes, int]) -> None:
    data, cut = case
    result: DicomHeader | NeedMoreBytes | Exception
    try:
        result = parse_header(data[:cut], len(data))
    except ALLOWED as exc:
        result = exc
    layout: DicomHeader | NeedMoreBytes | Exception
    try:
        layout = parse_header(data[:cut], len(data), per_frame=False)
    except ALLOWED as exc:
        layout = exc
    if isinstance(result, DicomHeader):  # the layout alone never fails where the whole passes
        assert isinstance(layout, DicomHeader)
        where = (layout.pixel, layout.pixel_offset, layout.pixel_length)
        assert where == (result.pixel, result.pixel_offset, result.pixel_length)
    elif isinstance(result, NeedMoreBytes):
        assert layout == result
    if isinstance(result, Exception):
        assert not any(text in str(result) for text in PATIENT_TEXT), str(result)
    elif isinstance(result, NeedMoreBytes):
        assert cut < result.at_least <= len(data)
    else:
        assert isinstance(result, DicomHeader)
        p = result.pixel
        assert result.pixel_offset + p.total_bytes <= len(data)
