"""ingest.dicom.codec against pydicom 3 itself, on every sample file with pixel data.

``test_sample_file`` runs over each file with pixel data that ships in pydicom
(test, charset and palette files) and in pydicom-data, found when the tests are
collected: what pydicom's ``pixel_array`` (then ``apply_color_lut`` or
``apply_modality_lut``) gives, the codec gives too, value for value and in the
same dtype (little endian); what pydicom cannot decode, the codec refuses with
an ``IngestError`` whose message names the syntax or the reason, and
``PYDICOM_REFUSES`` lists which. Every warning pydicom gives while it reads a
file, decodes it and the codec reads its values is expected here by file
(``EXPECTED_WARNINGS``); the codec's decoding gives none (warnings are errors).

The other tests: codestreams that nothing in pydicom-data holds (HTJ2K, JPEG
Lossless Process 14; tiny ones written by imagecodecs, kept here in base64),
corrupt codestreams of every compressed syntax, the codec's own refusals, and
the places where it differs from pydicom on purpose (a big-endian palette).
"""

from __future__ import annotations

import base64
import logging
import pickle
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final, TypeVar

import numpy as np
import numpy.typing as npt
import pytest
from pydicom import dcmread
from pydicom.data import (
    get_testdata_file,
)
from pydicom.dataelem import DataElement
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.encaps import encapsulate, generate_frames
from pydicom.pixels.processing import apply_color_lut, apply_modality_lut
from pydicom.uid import UID

from ingest.dicom.codec import (
    Codec,
    codec_from_dataset,
    conversions,
    decode_encapsulated,
    decode_native,
    decoded_format,
    needs_codec,
)
from ingest.dicom.syntaxes import ENCAPSULATED_UNCOMPRESSED, EXPLICIT_VR_BE, NATIVE
from ingest.errors import IngestError, MalformedDicom, UnsupportedDicom
from tests.paths import DATA
from tests.reference import pydicom_samples

SAMPLES, UNREADABLE = pydicom_samples()

Array = npt.NDArray[Any]
T = TypeVar("T")

LUT_DATA: Final = 0x00283006
MAX_FRAMES: Final = 16  # more frames than this: the first, middle and last are decoded

# What pydicom cannot decode, and what the codec's refusal must say (a regex)
PYDICOM_REFUSES: Final = {
    # deliberately broken: an invalid JPEG scan stop (pydicom's JPGE_BAD)
    "JPEG-lossy.dcm": r"JPEG Extended .*\(1\.2\.840\.10008\.1\.2\.4\.51\) frame 0: .* not decode",
    # pydicom's reader stops at the delimiter inside the data: a codestream of garbage
    "JPEG2000-embedded-sequence-delimiter.dcm": (
        r"JPEG 2000 Image Compression \(1\.2\.840\.10008\.1\.2\.4\.91\) frame 0: the codestream"
        r" is 3722445056 x 1024 x 1, larger than"
    ),
    "MR_truncated.dcm": r"\(1\.2\.840\.10008\.1\.2\.1\): Pixel Data holds 8130 bytes; .* need 8192",
    "badVR.dcm": r"^Number of Frames is not an integer$",
    "meta_missing_tsyntax.dcm": r"^no Transfer Syntax UID",
    "nested_priv_SQ.dcm": r"^missing Photometric Interpretation$",
    "OT-PAL-8-face.dcm": r"^no Transfer Syntax UID",  # with the syntax found: see its own test
}
# file -> what pydicom warns about (regexes: each must occur, and nothing else may)
EXPECTED_WARNINGS: Final = {
    "badVR.dcm": [r"Invalid value for VR IS: '1A'"],
    "MR_small_padded.dcm": [r"128 bytes of excess padding"],
    "SC_rgb_jpeg.dcm": [r"Expected explicit VR, but found implicit VR"],
}


def _id(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


def _recorded(fn: Callable[[], T], name: str) -> T:
    """``fn()``, checking what pydicom warned about meanwhile against EXPECTED_WARNINGS."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    messages = [str(w.message) for w in caught]
    patterns = EXPECTED_WARNINGS.get(name, [])
    unexpected = [m for m in messages if not any(re.search(p, m) for p in patterns)]
    missing = [p for p in patterns if not any(re.search(p, m) for m in messages)]
    assert not unexpected, unexpected
    assert not missing, missing
    return result


def _attempt(fn: Callable[[], T]) -> T | Exception:
    try:
        return fn()
    except Exception as exc:
        return exc


def _read(path: Path) -> tuple[Dataset, Array | Exception, Codec | Exception]:
    """The file, pydicom's decode of it (or its failure) and its codec (or the refusal)."""

    def pydicom_side() -> tuple[Dataset, Array | Exception, Codec | Exception]:
        ds = dcmread(path, force=True)
        reference = _attempt(lambda: _reference(ds))
        return ds, reference, _attempt(lambda: codec_from_dataset(ds, _syntax(ds)))

    return _recorded(pydicom_side, path.name)


def _syntax(ds: Dataset) -> str:
    meta = getattr(ds, "file_meta", None)
    return str(meta.get("TransferSyntaxUID") or "") if meta is not None else ""


def _palette_source(ds: Dataset) -> Dataset:
    """What apply_color_lut should read: big-endian OW tables as the words they stand for.

    pydicom reads a non-segmented palette's OW bytes as little endian whatever
    the file's byte order; the codec does not (``codec_luts``), so the reference
    swaps them first.
    """
    if _syntax(ds) != EXPLICIT_VR_BE or "RedPaletteColorLookupTableData" not in ds:
        return ds
    fixed = Dataset()
    for color in ("Red", "Green", "Blue"):
        descriptor = f"{color}PaletteColorLookupTableDescriptor"
        setattr(fixed, descriptor, ds[descriptor].value)
        raw = ds[f"{color}PaletteColorLookupTableData"].value
        swapped = np.frombuffer(raw, ">u2").astype("<u2").tobytes()
        setattr(fixed, f"{color}PaletteColorLookupTableData", swapped)
    return fixed


def _reference(ds: Dataset) -> Array:
    """pydicom's pixel_array, then its palette or Modality LUT Sequence: one axis per frame."""
    arr: Array = ds.pixel_array
    if ds.get("PhotometricInterpretation") == "PALETTE COLOR":
        arr = apply_color_lut(arr, _palette_source(ds))
    elif ds.get("ModalityLUTSequence"):
        arr = apply_modality_lut(arr, ds)
    frames = int(ds.get("NumberOfFrames") or 1)
    return arr if frames > 1 else arr[np.newaxis]


def _encapsulated_frames(ds: Dataset, frames: int) -> list[bytes]:
    tables = None
    if "ExtendedOffsetTable" in ds:
        tables = (ds.ExtendedOffsetTable, ds.ExtendedOffsetTableLengths)
    found = list(generate_frames(ds.PixelData, number_of_frames=frames, extended_offsets=tables))
    assert len(found) == frames
    return found


def _decode(codec: Codec, ds: Dataset, indices: list[int]) -> Array:
    """The codec's decode of frames ``indices``, each group the way the pipeline sends it."""
    frames = codec.number_of_frames
    if codec.transfer_syntax_uid in NATIVE:
        if indices == list(range(frames)):
            return decode_native(codec, ds.PixelData, 0, frames)
        return np.concatenate([decode_native(codec, ds.PixelData, k, 1) for k in indices])
    found = _encapsulated_frames(ds, frames)
    if indices == list(range(frames)):
        return decode_encapsulated(codec, found)
    return np.concatenate([decode_encapsulated(codec, [found[k]], first=k) for k in indices])


def _decode_all(ds: Dataset, codec: Codec | Exception) -> Array:
    if isinstance(codec, Exception):
        raise codec
    return _decode(codec, ds, list(range(codec.number_of_frames)))


def _testdata(name: str) -> Dataset:
    path = get_testdata_file(name)
    assert isinstance(path, str), name
    return dcmread(path)


def _as_native_path(ds: Dataset, frames: int) -> Array:
    """What the native path makes of the stored samples (docs/output.md,
    ``ingest_gpu.preprocess``)."""
    bits, spp = int(ds.BitsAllocated), int(ds.SamplesPerPixel)
    dtype = np.dtype(f"<{'ui'[ds.PixelRepresentation]}{bits // 8}")
    count = frames * ds.Rows * ds.Columns * spp
    arr = np.frombuffer(ds.PixelData, dtype=dtype, count=count).copy()
    shift = bits - int(ds.BitsStored)
    arr = (arr << shift) >> shift if shift else arr
    if spp == 1:
        return arr.reshape(frames, ds.Rows, ds.Columns)
    if ds.PlanarConfiguration == 1:
        return arr.reshape(frames, spp, ds.Rows, ds.Columns).transpose(0, 2, 3, 1)
    return arr.reshape(frames, ds.Rows, ds.Columns, spp)


def test_samples_found() -> None:
    """The enumeration sees both packages, and names are unique (the tables key on them)."""
    names = [path.name for path in SAMPLES]
    assert len(SAMPLES) >= 170, len(SAMPLES)
    assert len(set(names)) == len(names)
    assert {"CT_small.dcm", "693_J2KI.dcm", "chrX1.dcm"} <= set(names)  # pydicom, -data, charset
    assert set(PYDICOM_REFUSES) <= set(names)
    assert set(EXPECTED_WARNINGS) <= set(names)
    assert UNREADABLE == [], UNREADABLE


@pytest.mark.parametrize("path", SAMPLES, ids=_id)
def test_sample_file(path: Path) -> None:
    ds, reference, codec = _read(path)
    name, syntax = path.name, _syntax(ds)

    if isinstance(reference, Exception):  # pydicom cannot: the codec refuses, saying why
        assert name in PYDICOM_REFUSES, f"pydicom fails: {type(reference).__name__}"
        with pytest.raises(IngestError, match=PYDICOM_REFUSES[name]):
            _decode_all(ds, codec)
        return
    assert name not in PYDICOM_REFUSES
    if isinstance(codec, Exception):
        raise codec

    frames = codec.number_of_frames
    assert reference.shape[0] == frames
    indices = list(range(frames))
    if frames > MAX_FRAMES:
        indices = [0, frames // 2, frames - 1]
    got = _decode(codec, ds, indices)
    want = reference[indices]
    assert got.dtype == want.dtype.newbyteorder("<"), (got.dtype, want.dtype)
    assert got.shape == want.shape
    assert np.array_equal(got, want)

    fmt = decoded_format(codec)
    assert (fmt.frames, *fmt.shape[1:]) == (frames, *got.shape[1:])
    assert np.dtype(fmt.stored_dtype) == got.dtype
    assert fmt.bits_stored == fmt.bits_allocated
    if syntax in NATIVE and 1 < frames <= MAX_FRAMES:  # a group not from frame 0
        assert np.array_equal(decode_native(codec, ds.PixelData, 1, frames - 1), want[1:])

    plain = not needs_codec(
        syntax, codec.photometric_interpretation, codec.bits_allocated, "ModalityLUTSequence" in ds
    )
    if plain:  # the native path's reading of the stored bytes is pixel_array's
        assert np.array_equal(_as_native_path(ds, frames)[indices], want)
        assert set(conversions(codec)) <= {"planar->interleaved"}  # the device does it too
    else:  # something to convert, and the sidecar says what (8-bit OB big endian: nothing)
        assert conversions(codec) or syntax == EXPLICIT_VR_BE


def test_missing_transfer_syntax_decodes_as_the_syntax_found() -> None:
    """OT-PAL-8-face.dcm has no Transfer Syntax UID; read as what pydicom found, it is exact."""
    path = next(p for p in SAMPLES if p.name == "OT-PAL-8-face.dcm")
    ds = dcmread(path, force=True)
    implicit, little = ds.original_encoding
    syntax = "1.2.840.10008.1.2" if implicit and little else "1.2.840.10008.1.2.1"
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = UID(syntax)
    codec = codec_from_dataset(ds, syntax)
    assert np.array_equal(_decode(codec, ds, [0]), _reference(ds))
    assert conversions(codec) == ("palette->rgb",)


def test_big_endian_palette_is_its_little_endian_twin() -> None:
    """pydicom's apply_color_lut misreads big-endian OW palettes; the codec gives the LE colours."""
    paths = {p.name: p for p in SAMPLES}
    twins = [("OBXXXX1A.dcm", "OBXXXX1A_expb.dcm")]
    twins.append(("OBXXXX1A_2frame.dcm", "OBXXXX1A_expb_2frame.dcm"))
    for little, big in twins:
        decoded = []
        for name in (little, big):
            ds = dcmread(paths[name], force=True)
            codec = codec_from_dataset(ds, _syntax(ds))
            decoded.append(_decode(codec, ds, list(range(codec.number_of_frames))))
        assert np.array_equal(decoded[0], decoded[1])
        assert decoded[0].dtype == np.uint16
        assert len(np.unique(decoded[0])) > 2


# Tiny codestreams of syntaxes no installed file holds, written by imagecodecs 2026.3.6
# (OpenJPH, libjpeg-turbo) from 12 x 16 gradients; nothing installed here writes them.
CODESTREAMS: Final = {
    "htj2k-lossless-u12": (
        "1.2.840.10008.1.2.4.201",
        1,
        12,
        "MONOCHROME2",
        "/0//UQApQAAAAAAQAAAADAAAAAAAAAAAAAAAEAAAAAwAAAAAAAAAAAABDwEB/1AACAACAAAACv9SAAwAAgABAAUEBEAB"
        "/1wAEyCIkJCQkJCQkJCQkJCQiIiI/2QAFwABT3BlbkpQSCBWZXIgMC4yNi4zLv+QAAoAAAAAAMsAAf+TwAAm+/IFB3QA"
        "AMAAE0AAE0AAEoCU/gKHdAB48wOHdABJAYd0AMAAFTAABNAABMAJOCDGBQCilACxyAEBdAAVsABiNADAABWQAAWhAABW"
        "gEayxd1o64GWjGBWAEaOiEpWUsuxgAAAPnxjWAAevr4//uWIYPYxjncAwAAtSAAFtQAArUAgEPg//3GfPff85xNAX9px"
        "AnkAVlqxYuU0+A+npX9Pw/9W5PoZADOWQgHsugD/f/9//3/8gOYCf9cA/9k=",
    ),
    "htj2k-lossless-rpcl-rgb8": (
        "1.2.840.10008.1.2.4.202",
        3,
        8,
        "RGB",
        "/0//UQAvQAAAAAAQAAAADAAAAAAAAAAAAAAAEAAAAAwAAAAAAAAAAAADBwEBBwEBBwEB/1AACAACAAAAA/9SAAwAAgAB"
        "AQUEBEAB/1wAEyBQWFhYWFhYWFhYWFhYUFBQ/2QAFwABT3BlbkpQSCBWZXIgMC4yNi4zLv+QAAoAAAAAAT8AAf+TwBKA"
        "1wCHdADAEgAAR3QAwBKA+wDHdAAAAADACWAEoPAAh3QA2AEHdADACWAEoKIBB3QAzQEHdADACWAEoCIBh3QAZwGHdADA"
        "CaAEgMHaAAh0AO0KMwDACaAEgBD0AIJ0APYKMwDACaAEgBDIAQJ0AKoSMwDACqgBVwAnAGAG+AJ92Le2AAAdY/wAAD3M"
        "r7cAAPAWdKs1AMAKiAFSxpigAjACdgB1XdfAAAG+tgDACpgBVIZh/KAiMIJ2AN1ut/vAEIG+tgDAFbAFdAFegFQCVHAC"
        "HtqdOe5pAACNFRUVbeT375PeYGkAAAAA8Aa1rOqqr3mmmdsAwBVQBWgAAADngKenwncA9+7u7v76cnv3yey4AMAVUAWg"
        "7u7u54Cnp8J3AGlKKaWU/voAAHv2AAHsugD/2Q==",
    ),
    "htj2k-lossy-u8": (
        "1.2.840.10008.1.2.4.203",
        1,
        8,
        "MONOCHROME2",
        "/0//UQApQAAAAAAQAAAADAAAAAAAAAAAAAAAEAAAAAwAAAAAAAAAAAABBwEB/1AACAACAAAAIP9SAAwAAgABAAUEBEAA"
        "/1wAIyI/GD7qPuo+vDcANwA24i9ML0wvZBgDGAMYRh/SH9IfYf9kABcAAU9wZW5KUEggVmVyIDAuMjYuMy7/kAAKAAAA"
        "AAA6AAH/k8CQAEd0AADBLBIA+gBHdAD+F3MAwkD8AeMAAMkkklD9AEQA/QBEAP79AEQA/9k=",
    ),
    "jpeg-lossless-p14-predictor6-u12": (
        "1.2.840.10008.1.2.4.57",
        1,
        12,
        "MONOCHROME2",
        "/9j/4AAQSkZJRgABAQAAAQABAAD/wwALDAAMABABAREA/8QAGAABAQEBAQAAAAAAAAAAAAAACAcJDAv/2gAIAQEABgAA"
        "5/8AsNhsNhsNhsNhsNhsNhsNhsOliWSyWSyWSyWSyWSyWSyWSyW0sSyWSyWSyWSyWSyWSyWSyWS2liWSyWSyWSyWSyWS"
        "yWSyWSyW0sSyWSyWSyWSyWSyWSyWSyWS2liWSyWSyWSyWSyWSyWSyWSyW0sSyWSyWSyWSyWSyWSyWSyWS2liWSyWSyWS"
        "yWSyWSyWSyWSyW0sSyWSyWSyWSyWSyWSyWSyWS2liWSyWSyWSyWSyWSyWSyWS3BK6WJZLJZLJZLJZLJZLJbglfCV8JXo"
        "ltLEslkslkslksluCV8JXwleiWSyWS3/2Q==",
    ),
}


DECODERS: Final = {
    "htj2k-lossless-u12": "htj2k-lossless",
    "htj2k-lossless-rpcl-rgb8": "htj2k-lossless-rpcl",
    "htj2k-lossy-u8": "htj2k",
    "jpeg-lossless-p14-predictor6-u12": "jpeg-lossless",
}


def _synthetic(syntax: str, spp: int, bits: int, photometric: str, frame: bytes) -> Dataset:
    """A one-frame 12 x 16 dataset around ``frame``, for pydicom and the codec alike."""
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = UID(syntax)
    ds.Rows, ds.Columns, ds.SamplesPerPixel = 12, 16, spp
    ds.BitsAllocated, ds.BitsStored, ds.PixelRepresentation = (8 if bits <= 8 else 16), bits, 0
    ds.PhotometricInterpretation = photometric
    if spp == 3:
        ds.PlanarConfiguration = 0
    ds.PixelData = encapsulate([frame])
    return ds


def _codestream_case(key: str) -> tuple[Codec, Dataset, bytes]:
    syntax, spp, bits, photometric, text = CODESTREAMS[key]
    frame = base64.b64decode(text)
    ds = _synthetic(syntax, spp, bits, photometric, frame)
    return codec_from_dataset(ds, syntax), ds, frame


@pytest.mark.parametrize("key", sorted(CODESTREAMS))
def test_codestreams_no_file_holds(key: str) -> None:
    codec, ds, frame = _codestream_case(key)
    got = decode_encapsulated(codec, [frame])
    want = _reference(ds)
    assert got.dtype == want.dtype
    assert np.array_equal(got, want)
    assert conversions(codec)[0] == f"decode:{DECODERS[key]}"


# One base frame per compressed syntax for the corruption tests: (file or codestream key)
CORRUPTION_BASES: Final = {
    "rle": "MR_small_RLE.dcm",
    "rle-rgb": "SC_rgb_rle.dcm",
    "jpeg-baseline": "SC_rgb_small_odd_jpeg.dcm",
    "jpeg-extended": "JPGExtended.dcm",
    "jpeg-lossless": "jpeg-lossless-p14-predictor6-u12",
    "jpeg-lossless-sv1": "JPGLosslessP14SV1_1s_1f_8b.dcm",
    "jpeg-ls": "MR_small_jpeg_ls_lossless.dcm",
    "jpeg-ls-near-lossless": "JPEGLSNearLossless_16.dcm",
    "jpeg2000-lossless": "MR_small_jp2klossless.dcm",
    "jpeg2000": "SC_rgb_gdcm_KY.dcm",
    "htj2k-lossless": "htj2k-lossless-u12",
    "htj2k-lossless-rpcl": "htj2k-lossless-rpcl-rgb8",
    "htj2k": "htj2k-lossy-u8",
}


def _base(key: str) -> tuple[Codec, bytes]:
    source = CORRUPTION_BASES[key]
    if source in CODESTREAMS:
        codec, _, frame = _codestream_case(source)
        return codec, frame
    ds = _testdata(source)
    codec = codec_from_dataset(ds, _syntax(ds))
    return codec, _encapsulated_frames(ds, codec.number_of_frames)[0]


def _mutations(frame: bytes, seed: int) -> Iterator[tuple[str, bytes]]:
    size = len(frame)
    for cut in (0, 1, 2, 4, 16, size // 4, size // 2, size - 2):
        yield f"cut to {cut}", frame[:cut]
    rng = np.random.default_rng(seed)
    for _ in range(32):
        data = bytearray(frame)
        at = int(rng.integers(size))
        data[at] ^= int(rng.integers(1, 256))
        yield f"byte {at} flipped", bytes(data)
    for _ in range(8):
        data = bytearray(frame)
        at = int(rng.integers(size - 8))
        data[at : at + 8] = rng.bytes(8)
        yield f"8 bytes at {at} replaced", bytes(data)


@pytest.mark.parametrize("key", sorted(CORRUPTION_BASES))
def test_corrupt_codestreams_raise_ingest_errors(key: str) -> None:
    """Every mutation decodes to an image of the codec's format or raises an IngestError."""
    codec, frame = _base(key)
    shape, dtype = (1, *codec.frame_shape), np.dtype(decoded_format(codec).stored_dtype)
    refused, messages = [], []
    for what, mutated in _mutations(frame, seed=len(key)):
        try:
            got = decode_encapsulated(codec, [mutated], first=7)
        except IngestError as exc:
            refused.append(what)
            messages.append(str(exc))
            continue
        assert got.shape == shape, what
        assert got.dtype == dtype, what
    named = r"\(1\.2\.840\.10008\.1\.2\.[0-9.]+\) frame 7: "
    assert all(re.search(named, message) for message in messages), messages
    size = len(frame)
    cuts = (0, 1, 2, 4, 16, size // 4, size // 2, size - 2)
    assert {f"cut to {cut}" for cut in cuts} <= set(refused)


@pytest.mark.parametrize(
    ("key", "at", "field"),
    [
        ("jpeg-baseline", None, b"\xff\xc0"),  # SOF0: height, width 65535
        ("jpeg-ls", None, b"\xff\xf7"),  # SOF55
        ("jpeg2000-lossless", 8, None),  # SIZ: Xsiz
        ("htj2k-lossless", 8, None),
    ],
)
def test_codestream_claiming_a_larger_image_is_refused_before_decoding(
    key: str, at: int | None, field: bytes | None
) -> None:
    codec, frame = _base(key)
    data = bytearray(frame)
    if field is not None:
        start = frame.index(field)
        data[start + 5 : start + 9] = b"\xff\xff\xff\xff"
    else:
        assert at is not None
        data[at : at + 4] = (2**31).to_bytes(4, "big")
    with pytest.raises(MalformedDicom, match=r"frame 0: the codestream is \d+ x \d+ x \d+, larger"):
        decode_encapsulated(codec, [bytes(data)])


@pytest.mark.parametrize(
    ("name", "photometric", "expected_log"),
    [
        ("SC_rgb_dcmtk_+eb+cy+np.dcm", "RGB", "JFIF APP marker"),  # decoded as YBR_FULL_422
        ("SC_rgb_dcmtk_+eb+cr.dcm", "YBR_FULL", "component IDs"),  # decoded as RGB
    ],
)
def test_jpeg_colour_space_conformed_as_pydicom_does_without_warning(
    name: str, photometric: str, expected_log: str
) -> None:
    ds = _testdata(name)
    ds.PhotometricInterpretation = photometric
    with pytest.warns(UserWarning, match=expected_log):  # pydicom's own switch warns
        want = ds.pixel_array
    codec = codec_from_dataset(ds, _syntax(ds))
    got = decode_encapsulated(codec, _encapsulated_frames(ds, 1))  # warnings are errors here
    assert np.array_equal(got[0], want)


def test_native_takes_only_the_bytes_it_needs() -> None:
    ds = _testdata("emri_small.dcm")  # 10 frames of 64 x 64 x 16 bits
    codec = codec_from_dataset(ds, _syntax(ds))
    frame = 64 * 64 * 2
    got = decode_native(codec, ds.PixelData[: 5 * frame], 3, 2)
    assert np.array_equal(got, ds.pixel_array[3:5])
    with pytest.raises(MalformedDicom, match=r"holds 40959 bytes; frames 3\.\.4 need 40960"):
        decode_native(codec, ds.PixelData[: 5 * frame - 1], 3, 2)
    assert decode_native(codec, b"", 2, 0).shape == (0, 64, 64)
    with pytest.raises(ValueError, match=r"frames 9\.\.11 of 10"):
        decode_native(codec, ds.PixelData, 9, 2)
    with pytest.raises(ValueError, match="is native: use decode_native"):
        decode_encapsulated(codec, [ds.PixelData[:frame]])


@pytest.mark.parametrize(
    "name", ["OBXXXX1A_2frame.dcm", "liver.dcm", "SC_ybr_full_uncompressed.dcm"]
)
def test_encapsulated_uncompressed_frames_decode_as_their_native_twin(name: str) -> None:
    """Palette, 1-bit and YBR frames a fragment each: pydicom has no decoder, so its native twin."""
    ds = _testdata(name)
    want = _reference(ds)
    frames = len(want)
    size = len(ds.PixelData) // frames
    ds.file_meta.TransferSyntaxUID = UID(ENCAPSULATED_UNCOMPRESSED)
    ds.PixelData = encapsulate([ds.PixelData[k * size : (k + 1) * size] for k in range(frames)])
    codec = codec_from_dataset(ds, ENCAPSULATED_UNCOMPRESSED)
    got = decode_encapsulated(codec, _encapsulated_frames(ds, frames))
    assert got.dtype == want.dtype
    assert np.array_equal(got, want)
    with pytest.raises(MalformedDicom, match=rf"frame 1: {size - 1} bytes, not {size}"):
        decode_encapsulated(codec, [b"\0" * (size - 1)], first=1)


def test_bit_packed_frames_that_start_inside_a_byte() -> None:
    ds = _testdata("liver.dcm")  # 3 frames of 512 x 512 x 1 bit
    ds.Rows, ds.Columns = 511, 509  # 260,099 bits a frame: frames start mid-byte
    ds.PixelData = ds.PixelData[: (3 * 511 * 509 + 7) // 8]
    codec = codec_from_dataset(ds, _syntax(ds))
    assert np.array_equal(decode_native(codec, ds.PixelData, 1, 2), ds.pixel_array[1:])
    assert conversions(codec) == ("bits_allocated_1->uint8",)


def test_big_endian_ow_bytes_odd_frames() -> None:
    """8-bit OW big endian with odd-length frames: pydicom swaps across frame ends."""
    ds = _testdata("SC_rgb_expb_2frame.dcm")
    ds.Rows, ds.Columns = 33, 33  # 3,267 bytes a frame: odd
    ds["PixelData"].VR = "OW"
    ds.PixelData = ds.PixelData[: 2 * 3267]
    codec = codec_from_dataset(ds, _syntax(ds))
    assert codec.pixel_vr == "OW"
    assert "big_endian->little" in conversions(codec)
    for first in (0, 1):
        assert np.array_equal(
            decode_native(codec, ds.PixelData, first, 1)[0], ds.pixel_array[first]
        )
    with pytest.raises(MalformedDicom, match="need 3268"):  # a frame and the next's first byte
        decode_native(codec, ds.PixelData[:3267], 0, 1)


def test_modality_lut_as_ow_words_and_its_refusals() -> None:
    ds = _testdata("mlut_18.dcm")
    item = ds.ModalityLUTSequence[0]
    table = np.asarray(item.LUTData, dtype="<u2")
    item["LUTData"] = DataElement(LUT_DATA, "OW", table.tobytes())
    codec = codec_from_dataset(ds, _syntax(ds))
    assert codec.modality_lut is not None
    assert conversions(codec) == ("modality_lut_sequence",)
    want = apply_modality_lut(ds.pixel_array, ds)
    assert np.array_equal(decode_native(codec, ds.PixelData, 0, 1)[0], want)

    item["LUTData"] = DataElement(LUT_DATA, "OW", table[:-1].tobytes())
    with pytest.raises(MalformedDicom, match="holds 8190 bytes, not 4096 OW words"):
        codec_from_dataset(ds, _syntax(ds))
    item.LUTDescriptor = [4096, -2048, 12]
    with pytest.raises(UnsupportedDicom, match="12-bit entries"):
        codec_from_dataset(ds, _syntax(ds))
    item.LUTDescriptor = [4096, -2048, 16]
    item["LUTData"] = DataElement(LUT_DATA, "US", [1, 2, 3])
    with pytest.raises(MalformedDicom, match="holds 3 entries; its descriptor says 4096"):
        codec_from_dataset(ds, _syntax(ds))
    item["LUTData"] = DataElement(LUT_DATA, "US", table.tolist())
    ds.PhotometricInterpretation, ds.SamplesPerPixel, ds.PlanarConfiguration = "RGB", 3, 0
    with pytest.raises(
        UnsupportedDicom, match="Modality LUT Sequence with photometric interpretation RGB"
    ):
        codec_from_dataset(ds, _syntax(ds))


def _segmented(segments: list[int]) -> Dataset:
    ds = _testdata("gdcm-US-ALOKA-16.dcm")
    data = np.asarray(segments, "<u2").tobytes()
    for color in ("Red", "Green", "Blue"):
        setattr(ds, f"Segmented{color}PaletteColorLookupTableData", data)
    return ds


def test_segmented_palettes_expand_as_pydicom_and_are_bounded() -> None:
    # discrete 0, 10; linear to 1000 over 65534 entries; indirect: replay segment 0
    ds = _segmented([0, 2, 0, 10, 1, 65534, 1000, 2, 1, 0, 0])
    codec = codec_from_dataset(ds, _syntax(ds))
    assert codec.palette is not None
    assert len(codec.palette[0].table) == 65536
    want = apply_color_lut(ds.pixel_array, ds)
    assert np.array_equal(decode_native(codec, ds.PixelData, 0, 1)[0], want)

    looping = [0, 1, 5, 2, 1, 3, 0]  # an indirect segment that replays itself
    with pytest.raises(MalformedDicom, match="Segmented Red Palette Color LUT Data does not"):
        codec_from_dataset(_segmented(looping), "1.2.840.10008.1.2")
    growing = [0, 1, 5] + [1, 65535, 7] * 3  # 196,606 entries
    with pytest.raises(MalformedDicom, match="does not expand"):
        codec_from_dataset(_segmented(growing), "1.2.840.10008.1.2")
    short = [0, 3, 1, 2, 3]  # 3 entries for a descriptor of 65536
    with pytest.raises(MalformedDicom, match="holds 3 entries; its descriptor says 65536"):
        codec_from_dataset(_segmented(short), "1.2.840.10008.1.2")


def _palette_ds() -> Dataset:
    return _testdata("OBXXXX1A.dcm")


def _edit(source: Callable[[], Dataset], **values: Any) -> Callable[[], Dataset]:
    def edited() -> Dataset:
        ds = source()
        for keyword, value in values.items():
            if value is None:
                del ds[keyword]
            else:
                setattr(ds, keyword, value)
        return ds

    return edited


def _ct() -> Dataset:
    return _testdata("CT_small.dcm")


@pytest.mark.parametrize(
    ("make", "syntax", "error", "message"),
    [
        (_ct, "", UnsupportedDicom, r"^no Transfer Syntax UID"),
        (
            _ct,
            "1.2.840.10008.1.2.8.1",
            UnsupportedDicom,
            r"^transfer syntax 1\.2\.840\.10008\.1\.2\.8\.1 has no decoder$",
        ),
        (_ct, "1.2.840.10008.1.2.4.100", UnsupportedDicom, r"MPEG2 .* has no decoder"),
        (_ct, "PATIENT NAME", UnsupportedDicom, r"^transfer syntax \(a Transfer Syntax UID that"),
        (
            _edit(_ct, PixelData=None, FloatPixelData=b"\0" * 16),
            "1.2.840.10008.1.2.1",
            UnsupportedDicom,
            "Float and Double Float Pixel Data",
        ),
        (_edit(_ct, PixelData=None), "1.2.840.10008.1.2.1", MalformedDicom, "no Pixel Data"),
        (
            _edit(
                _ct,
                PhotometricInterpretation="YBR_PARTIAL_422",
                SamplesPerPixel=3,
                PlanarConfiguration=0,
            ),
            "1.2.840.10008.1.2.1",
            UnsupportedDicom,
            r"'YBR_PARTIAL_422' is not supported",
        ),
        (
            _edit(_ct, PhotometricInterpretation="SECRET VALUE"),
            "1.2.840.10008.1.2.1",
            UnsupportedDicom,
            r"photometric interpretation \(unknown value\)",
        ),
        (
            _edit(
                _ct, PhotometricInterpretation="YBR_ICT", SamplesPerPixel=3, PlanarConfiguration=0
            ),
            "1.2.840.10008.1.2.1",
            UnsupportedDicom,
            "YBR_ICT outside JPEG 2000",
        ),
        (
            _edit(_ct, SamplesPerPixel=3),
            "1.2.840.10008.1.2.1",
            MalformedDicom,
            "MONOCHROME2 with 3 samples per pixel",
        ),
        (
            _edit(_ct, BitsAllocated=64, BitsStored=64),
            "1.2.840.10008.1.2.1",
            UnsupportedDicom,
            "Bits Allocated 64",
        ),
        (
            _edit(_ct, BitsAllocated=12),
            "1.2.840.10008.1.2.1",
            MalformedDicom,
            "Bits Allocated 12 is not 1, 8, 16 or 32",
        ),
        (_edit(_ct, BitsStored=17), "1.2.840.10008.1.2.1", MalformedDicom, r"within 1\.\.16"),
        (
            _edit(_ct, PixelRepresentation=2),
            "1.2.840.10008.1.2.1",
            MalformedDicom,
            "Pixel Representation 2",
        ),
        (_edit(_ct, Rows=0), "1.2.840.10008.1.2.1", MalformedDicom, "0 x 128 pixels"),
        (
            _edit(_ct, NumberOfFrames=-2),
            "1.2.840.10008.1.2.1",
            MalformedDicom,
            "^Number of Frames -2 is below 1$",
        ),
        (
            _edit(_ct, BitsStored=None),
            "1.2.840.10008.1.2.1",
            MalformedDicom,
            "^missing Bits Stored$",
        ),
        (
            _edit(_palette_ds, AlphaPaletteColorLookupTableData=b"\0\0" * 256),
            "1.2.840.10008.1.2.1",
            UnsupportedDicom,
            r"Alpha Palette .* \(RGBA output\)",
        ),
        (
            _edit(_palette_ds, PixelPresentation="COLOR"),
            "1.2.840.10008.1.2.1",
            UnsupportedDicom,
            "Supplemental Palette",
        ),
        (
            _edit(_palette_ds, GreenPaletteColorLookupTableData=b"\0\0" * 255),
            "1.2.840.10008.1.2.1",
            MalformedDicom,
            "tables differ in length",
        ),
        (
            _edit(_palette_ds, RedPaletteColorLookupTableData=b"\0" * 300),
            "1.2.840.10008.1.2.1",
            MalformedDicom,
            "palette data of 300 bytes for 256 entries",
        ),
        (
            _edit(_palette_ds, RedPaletteColorLookupTableDescriptor=None),
            "1.2.840.10008.1.2.1",
            MalformedDicom,
            "missing Red Palette Color Lookup Table Descriptor",
        ),
    ],
)
def test_codec_refusals_name_elements_not_values(
    make: Callable[[], Dataset], syntax: str, error: type[IngestError], message: str
) -> None:
    with pytest.raises(error, match=message) as raised:
        codec_from_dataset(make(), syntax)
    assert "SECRET" not in str(raised.value)
    assert "PATIENT" not in str(raised.value)


def test_needs_codec() -> None:
    plain = ("1.2.840.10008.1.2", "1.2.840.10008.1.2.1", "1.2.840.10008.1.2.1.98")
    for syntax in plain:
        for photometric in ("MONOCHROME1", "MONOCHROME2", "RGB"):
            for bits in (8, 16, 32):
                assert not needs_codec(syntax, photometric, bits, False)
                assert needs_codec(syntax, photometric, bits, True)
            assert needs_codec(syntax, photometric, 1, False)
        for photometric in ("PALETTE COLOR", "YBR_FULL", "YBR_FULL_422"):
            assert needs_codec(syntax, photometric, 8, False)
    for syntax in ("1.2.840.10008.1.2.2", "1.2.840.10008.1.2.1.99", "1.2.840.10008.1.2.5"):
        assert needs_codec(syntax, "MONOCHROME2", 16, False)


def test_codec_pickles_and_decoding_leaves_warnings_and_logs_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    codec, frame = _base("jpeg2000")
    clone = pickle.loads(pickle.dumps(codec))
    assert clone == codec
    filters = list(warnings.filters)
    with caplog.at_level(logging.DEBUG):
        good = decode_encapsulated(clone, [frame])
        with pytest.raises(MalformedDicom, match=r"\(1\.2\.840\.10008\.1\.2\.4\.91\) frame 3"):
            decode_encapsulated(clone, [frame[: len(frame) // 3]], first=3)
    assert warnings.filters == filters
    assert not [r for r in caplog.records if r.name.startswith(("pydicom", "pylibjpeg"))]
    assert good.shape == (1, 100, 100, 3)
    palette = codec_from_dataset(_palette_ds(), "1.2.840.10008.1.2.1")
    assert pickle.loads(pickle.dumps(palette)) == palette


# Decodes the JPEG samples in a Python without pylibjpeg-libjpeg (the extra `gpl` left out),
# with Pillow present or absent; prints each sample's outcome as one line of JSON.
WITHOUT_GPL = """
import importlib.metadata as metadata, json, sys
sys.modules["libjpeg"] = None  # as if the extra `gpl` were not installed: no module,
entry_points = metadata.entry_points  # and no plugin entry point for pylibjpeg to find


def without_libjpeg(*args, **kwargs):
    found = entry_points(*args, **kwargs)
    kept = [ep for ep in found if not ep.value.startswith("libjpeg")]
    return metadata.EntryPoints(kept)


metadata.entry_points = without_libjpeg
if sys.argv[1] == "no-pillow":
    sys.modules["PIL"] = None
import pydicom
from pydicom.encaps import generate_fragmented_frames
from ingest.dicom.codec import decode_encapsulated
from ingest.dicom.codec_read import codec_from_dataset
from ingest.errors import IngestError

for path in sys.argv[2:]:
    ds = pydicom.dcmread(path)
    uid = str(ds.file_meta.TransferSyntaxUID)
    try:
        codec = codec_from_dataset(ds, uid)
        frames = [b"".join(f) for f in generate_fragmented_frames(ds.PixelData)]
        decode_encapsulated(codec, frames)
        print(json.dumps({"path": path, "reason": None}))
    except IngestError as exc:
        print(json.dumps({"path": path, "reason": exc.reason, "error": str(exc)}))
"""


@pytest.mark.parametrize("pillow", ["pillow", "no-pillow"])
def test_without_the_gpl_decoder_jpeg_objects_name_the_missing_plugin(pillow: str) -> None:
    """JPEG Lossless and 12-bit JPEG need pylibjpeg-libjpeg (GPL-3.0, the extra `gpl`):
    without it they are refused as ``missing_decoder``, naming the package and the extra,
    before or after a decode with what is installed (Pillow: 8-bit JPEG only); JPEG 2000
    and JPEG-LS decode as before."""
    import json
    import subprocess
    import sys

    names = [
        "ct-jpeg-lossless-sv1.dcm",
        "ct-jpeg-extended.dcm",
        "ct-jpeg2000.dcm",
        "ct-jpeg-ls.dcm",
    ]
    paths = [str(DATA / "compressed" / name) for name in names]
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_GPL, pillow, *paths],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    outcomes = {Path(r["path"]).name: r for r in map(json.loads, done.stdout.splitlines())}
    for name in names[:2]:
        assert outcomes[name]["reason"] == "missing_decoder", outcomes[name]
        assert "pylibjpeg-libjpeg" in outcomes[name]["error"]
        assert "pip install 'dicom-ingest[gpl]'" in outcomes[name]["error"]
    assert outcomes["ct-jpeg2000.dcm"]["reason"] is None
    assert outcomes["ct-jpeg-ls.dcm"]["reason"] is None
