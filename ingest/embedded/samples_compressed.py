"""Compressed sample objects: a CT slice in every lossless and lossy syntax pydicom
decodes, 8-bit JPEG baseline secondary captures (one, or a series of them), and the
demo's set of them.

Deterministic (same arguments, same bytes, with the same codec libraries) and
offline. Frames are encoded by pydicom's encoders (RLE Lossless through
pylibjpeg-rle, JPEG-LS through pyjpegls/CharLS, JPEG 2000 through
pylibjpeg-openjpeg), by imagecodecs (JPEG Lossless and 12-bit JPEG Extended
through libjpeg-turbo, HTJ2K through OpenJPH: pydicom writes none of them, and
pylibjpeg-libjpeg and openjpeg 2.5 only decode them) and by Pillow (8-bit JPEG
baseline).
The header goes through pydicom and the fragments through
``ingest.embedded.samples_slide.write_fragments``, as a slide's do.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any, BinaryIO, Final, Literal

import numpy as np
import numpy.typing as npt
from PIL import Image
from pydicom.dataset import Dataset
from pydicom.pixels.encoders.base import get_encoder
from pydicom.uid import (
    HTJ2K,
    JPEG2000,
    UID,
    HTJ2KLossless,
    HTJ2KLosslessRPCL,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    JPEGExtended12Bit,
    JPEGLossless,
    JPEGLosslessSV1,
    JPEGLSLossless,
    JPEGLSNearLossless,
    RLELossless,
)

from ingest.dicom.syntaxes import LOSSLESS, SYNTAXES, Family
from ingest.embedded.sample_parts import base_dataset, image_pixel, uid
from ingest.embedded.samples import _ct_phantom
from ingest.embedded.samples_slide import jpeg_rgb, jpeg_slide_bytes, tissue_tile, write_fragments

# The syntaxes ``compressed_ct`` writes, in the order the demo uploads them
CT_SYNTAXES: Final = (
    RLELossless,
    JPEGLosslessSV1,
    JPEGLossless,  # Process 14, predictor 6 (Rb + (Ra - Rc) / 2)
    JPEGExtended12Bit,  # Process 4, quality 90: ~60 dB PSNR (over the 12-bit range)
    JPEGLSLossless,
    JPEGLSNearLossless,  # NEAR = 2
    JPEG2000Lossless,
    JPEG2000,  # irreversible, 50 dB PSNR (over the 12-bit range): ~25:1 at 512 x 512
    HTJ2KLossless,
    HTJ2KLosslessRPCL,  # RPCL, TLM, a tile-part per resolution, base resolution <= 64
    HTJ2K,  # irreversible, quantisation step 1e-3: ~49 dB PSNR, ~25:1 at 512 x 512
)
# pydicom encoder, plugin (named, so the bytes do not depend on which is found first)
# and options of each syntax it writes
_PYDICOM: Final[dict[str, tuple[str, dict[str, Any]]]] = {
    RLELossless: ("pylibjpeg", {}),
    JPEGLSLossless: ("pyjpegls", {}),
    JPEGLSNearLossless: ("pyjpegls", {"jls_error": 2}),
    JPEG2000Lossless: ("pylibjpeg", {}),
    JPEG2000: ("pylibjpeg", {"j2k_psnr": [50]}),
}
# imagecodecs.jpeg8_encode options (libjpeg-turbo) of each JPEG syntax written here
_JPEG: Final[dict[str, dict[str, Any]]] = {
    JPEGLosslessSV1: {"lossless": True, "predictor": 1},
    JPEGLossless: {"lossless": True, "predictor": 6},
    JPEGExtended12Bit: {"level": 90},
}
# imagecodecs.htj2k_encode options (OpenJPH; its default progression is RPCL)
_HTJ2K: Final[dict[str, dict[str, Any]]] = {
    HTJ2KLossless: {"reversible": True},
    HTJ2KLosslessRPCL: {
        "reversible": True,
        "tlm": True,
        "tilepart": "RESOLUTIONS",  # imagecodecs.HTJ2K.TILEPART.RESOLUTIONS
    },
    HTJ2K: {"level": 1e-3, "reversible": False},
}
# Lossy Image Compression Method (PS3.3 C.7.6.1.1.5.1) of each codec
_LOSSY_METHOD: Final[dict[Family, str]] = {
    "jpeg": "ISO_10918_1",
    "jpeg-ls": "ISO_14495_1",
    "jpeg2000": "ISO_15444_1",
    "htj2k": "ISO_15444_15",
}
_CT_STORAGE: Final = "1.2.840.10008.5.1.4.1.1.2"
_ENHANCED_CT_STORAGE: Final = "1.2.840.10008.5.1.4.1.1.2.1"
_SC_STORAGE: Final = "1.2.840.10008.5.1.4.1.1.7"


def ct_pixels(index: int, rows: int = 512, columns: int = 512) -> npt.NDArray[np.int16]:
    """The stored values of compressed CT slice ``index``: samples.py's chest phantom,
    12 bits signed (Rescale Intercept -1024), seeded by ``index``."""
    rng = np.random.default_rng([0xC7, index])
    hu = _ct_phantom(rows, columns, (index % 64) / 63, rng)
    stored: npt.NDArray[np.int16] = np.clip(np.rint(hu) + 1024, -2048, 2047).astype(np.int16)
    return stored


def _encoding_options(ds: Dataset) -> dict[str, Any]:
    """What pydicom's encoders need to know of an array's pixels, from its header."""
    options = {
        "rows": ds.Rows,
        "columns": ds.Columns,
        "samples_per_pixel": ds.SamplesPerPixel,
        "number_of_frames": 1,
        "bits_allocated": ds.BitsAllocated,
        "bits_stored": ds.BitsStored,
        "pixel_representation": ds.PixelRepresentation,
        "photometric_interpretation": ds.PhotometricInterpretation,
    }
    if ds.SamplesPerPixel > 1:
        options["planar_configuration"] = 0
    return options


def _decompositions(rows: int, columns: int) -> int:
    """Wavelet levels enough for a base resolution of at most 64 (DICOM's rule for
    HTJ2K RPCL: a thumbnail can be read first), and never fewer than OpenJPH's 5."""
    return max(5, (max(rows, columns) - 1).bit_length() - 6)


def encode_frame(pixels: npt.NDArray[Any], syntax: str, ds: Dataset) -> bytes:
    """One frame of ``pixels`` (described by ``ds``) in ``syntax``, by the encoder this
    module uses for it (pydicom's, or imagecodecs for JPEG Lossless, JPEG Extended
    and HTJ2K).

    JPEG samples are unsigned: signed pixels go in as their two's complement in
    Bits Stored bits, which pydicom sign-extends back (as it does for any JPEG with
    Pixel Representation 1). Lossy JPEG errors would wrap only across +-2048, and
    ``ct_pixels`` stays 48 from it (-2000 to 1966; quality 90 errs by at most ~20).
    HTJ2K takes the array as it is: a signed codestream of the array's 16 bits (its
    item size), which pydicom decodes to the same values whatever Bits Stored says.

    Raises:
        ValueError: no encoder here for ``syntax``.
    """
    if syntax in _JPEG or syntax in _HTJ2K:
        # imported here: the other syntaxes (and a machine without imagecodecs) need none
        import imagecodecs
    if syntax in _JPEG:
        unsigned = pixels.astype(np.uint16) & ((1 << ds.BitsStored) - 1)
        options = _JPEG[syntax]
        return bytes(imagecodecs.jpeg8_encode(unsigned, bitspersample=ds.BitsStored, **options))
    if syntax in _HTJ2K:
        options = _HTJ2K[syntax]
        if syntax == HTJ2KLosslessRPCL:
            tilepart = getattr(imagecodecs.HTJ2K.TILEPART, options["tilepart"])
            resolutions = _decompositions(ds.Rows, ds.Columns)
            options = {**options, "tilepart": tilepart, "resolutions": resolutions}
        return bytes(imagecodecs.htj2k_encode(pixels, **options))
    if syntax not in _PYDICOM:
        raise ValueError(f"no encoder here for {syntax} ({UID(syntax).name})")
    plugin, options = _PYDICOM[syntax]
    encoder = get_encoder(syntax)
    return encoder.encode(pixels, encoding_plugin=plugin, **_encoding_options(ds), **options)


def _encapsulated(ds: Dataset, syntax: str, frame: bytes) -> bytes:
    """``ds`` with one compressed frame as its Pixel Data; lossy ones say so."""
    ds.file_meta.TransferSyntaxUID = UID(syntax)
    if syntax not in LOSSLESS:
        ratio = ds.Rows * ds.Columns * ds.SamplesPerPixel * (ds.BitsAllocated // 8) / len(frame)
        ds.LossyImageCompression = "01"
        ds.LossyImageCompressionRatio = f"{ratio:.2f}"
        ds.LossyImageCompressionMethod = _LOSSY_METHOD[SYNTAXES[syntax].family]
    out = io.BytesIO()
    write_fragments(out, ds, [frame], np.array([len(frame)], dtype=np.int64), "basic")
    return out.getvalue()


def compressed_ct(syntax: str, index: int = 0, rows: int = 512, columns: int = 512) -> bytes:
    """CT slice ``index`` (``ct_pixels``) as a CT Image Storage object in ``syntax``, one of
    ``CT_SYNTAXES``: 16 bits allocated, 12 stored, signed, Rescale Intercept -1024.

    Lossless syntaxes decode to exactly ``ct_pixels(index, rows, columns)``; lossy ones
    (JPEG Extended, JPEG-LS NEAR 2, JPEG 2000 and HTJ2K irreversible: see ``CT_SYNTAXES``)
    carry Lossy Image Compression and its ratio. One series per syntax and size; the
    SOP Instance UID names syntax and slice.

    Raises:
        ValueError: ``syntax`` is not one this module can write.
    """
    key = ("ct-compressed", syntax, rows, columns)
    study = uid("ct-compressed", "study")
    ds = base_dataset(_CT_STORAGE, uid(*key, index, "sop"), "CT", study, uid(*key, "series"))
    lossy = syntax not in LOSSLESS
    ds.ImageType = ["DERIVED" if lossy else "ORIGINAL", "PRIMARY", "AXIAL"]
    ds.InstanceNumber = index + 1
    ds.SliceThickness = "1.25"
    ds.ImagePositionPatient = ["-179.2", "-179.2", f"{-1.25 * index:.2f}"]
    ds.ImageOrientationPatient = ["1", "0", "0", "0", "1", "0"]
    ds.PixelSpacing = ["0.7", "0.7"]
    ds.KVP = "120"
    image_pixel(ds, rows, columns, (16, 12), signed=True)
    ds.WindowCenter, ds.WindowWidth = "40", "400"
    ds.RescaleIntercept, ds.RescaleSlope, ds.RescaleType = "-1024", "1", "HU"
    pixels = ct_pixels(index, rows, columns)
    return _encapsulated(ds, syntax, encode_frame(pixels, syntax, ds))


def compressed_ct_series(
    syntax: str, count: int, rows: int = 512, columns: int = 512
) -> list[tuple[str, bytes]]:
    """``count`` slices of one series in ``syntax``, keyed ``ct-KEYWORD/slice-NNNN.dcm``
    (KEYWORD: pydicom's for the syntax, e.g. ``JPEG2000Lossless``)."""
    name = UID(syntax).keyword
    return [
        (f"ct-{name}/slice-{index + 1:04d}.dcm", compressed_ct(syntax, index, rows, columns))
        for index in range(count)
    ]


def write_ct_volume(
    fp: BinaryIO, syntax: str, codestreams: Sequence[bytes], rows: int = 512, columns: int = 512
) -> str:
    """A CT series as one Enhanced CT object: ``codestreams`` (lossless ``syntax``
    frames of ``compressed_ct``'s slices) as its frames, in order, written to ``fp``
    with an offset table (``write_fragments``' ``auto``). The Modality LUT is shared
    (Pixel Value Transformation, intercept -1024, as the slices'); each frame has its
    own Frame Content and Plane Position, as a scanner writes them. Returns the table
    written.

    Raises:
        ValueError: no codestream, or ``syntax`` not a lossless one of ``CT_SYNTAXES``.
    """
    if syntax not in CT_SYNTAXES or syntax not in LOSSLESS or not codestreams:
        raise ValueError("a CT volume takes one or more lossless codestreams")
    key = ("ct-volume", syntax, rows, columns, len(codestreams))
    ds = base_dataset(
        _ENHANCED_CT_STORAGE, uid(*key, "sop"), "CT", uid(*key, "study"), uid(*key, "series")
    )
    ds.ImageType = ["ORIGINAL", "PRIMARY", "VOLUME", "NONE"]
    ds.InstanceNumber = 1
    ds.NumberOfFrames = len(codestreams)
    image_pixel(ds, rows, columns, (16, 12), signed=True)
    shared, measures, transformation, voi = Dataset(), Dataset(), Dataset(), Dataset()
    measures.PixelSpacing, measures.SliceThickness = ["0.7", "0.7"], "1.25"
    transformation.RescaleIntercept, transformation.RescaleSlope = "-1024", "1"
    transformation.RescaleType = "HU"
    voi.WindowCenter, voi.WindowWidth = "40", "400"
    shared.PixelMeasuresSequence = [measures]
    shared.PixelValueTransformationSequence = [transformation]
    shared.FrameVOILUTSequence = [voi]
    ds.SharedFunctionalGroupsSequence = [shared]
    groups = []
    for index in range(len(codestreams)):
        group, content, position = Dataset(), Dataset(), Dataset()
        content.InStackPositionNumber = index + 1
        position.ImagePositionPatient = ["-179.2", "-179.2", f"{-1.25 * index:.2f}"]
        group.FrameContentSequence, group.PlanePositionSequence = [content], [position]
        groups.append(group)
    ds.PerFrameFunctionalGroupsSequence = groups
    ds.file_meta.TransferSyntaxUID = UID(syntax)
    lengths = np.array([len(c) for c in codestreams], dtype=np.int64)
    return write_fragments(fp, ds, codestreams, lengths)


def compressed_ct_volume(
    syntax: str, frames: int, rows: int = 512, columns: int = 512, distinct: int = 4
) -> bytes:
    """A CT volume of ``frames`` frames from ``compressed_ct``'s first ``distinct``
    slices (``ct_volume``): frame ``k`` decodes to ``ct_pixels(k % distinct, rows, columns)``."""
    slices = [compressed_ct(syntax, k, rows, columns) for k in range(min(frames, distinct))]
    return ct_volume(slices, frames)


def ct_volume(slices: Sequence[bytes], frames: int) -> bytes:
    """A CT volume (``write_ct_volume``) of ``frames`` frames: the codestreams of
    ``slices`` (single-frame lossless CT objects of one syntax and size) in turn.

    Raises:
        ValueError: no slice, or not a lossless syntax of ``CT_SYNTAXES``.
    """
    from pydicom import dcmread
    from pydicom.encaps import get_frame

    if not slices:
        raise ValueError("a CT volume takes one or more slices")
    read = [dcmread(io.BytesIO(data)) for data in slices]
    codestreams = [get_frame(ds.PixelData, 0, number_of_frames=1) for ds in read]
    first, out = read[0], io.BytesIO()
    frames_in_turn = [codestreams[k % len(codestreams)] for k in range(frames)]
    syntax = str(first.file_meta.TransferSyntaxUID)
    write_ct_volume(out, syntax, frames_in_turn, first.Rows, first.Columns)
    return out.getvalue()


def jpeg_baseline(
    photometric: Literal["MONOCHROME2", "YBR_FULL_422"],
    index: int = 0,
    rows: int = 256,
    columns: int = 256,
    quality: int = 90,
) -> bytes:
    """An 8-bit JPEG Baseline secondary capture (Pillow): a CT slice windowed to 8 bits
    (MONOCHROME2), or an H&E-like RGB tile stored as YBR_FULL_422 (4:2:2)."""
    colour = photometric == "YBR_FULL_422"
    key = ("jpeg-baseline", photometric, index, rows, columns, quality)
    ds = base_dataset(_SC_STORAGE, uid(*key, "sop"), "OT", uid(*key, "study"), uid(*key, "series"))
    ds.ImageType = ["DERIVED", "SECONDARY"]
    ds.ConversionType = "WSD"
    ds.InstanceNumber = index + 1
    image_pixel(ds, rows, columns, (8, 8), signed=False)
    if colour:
        ds.SamplesPerPixel, ds.PlanarConfiguration = 3, 0
        frame = jpeg_rgb(tissue_tile(index, rows, columns), quality)
    else:
        frame = _jpeg_grey(ct_grey(index, rows, columns), quality)
    ds.PhotometricInterpretation = photometric
    return _encapsulated(ds, JPEGBaseline8Bit, frame)


def ct_grey(index: int, rows: int = 512, columns: int = 512) -> npt.NDArray[np.uint8]:
    """CT slice ``index`` (``ct_pixels``) windowed to 8 bits (centre 40, width 400 HU),
    as a workstation's secondary capture of it stores it."""
    hu = ct_pixels(index, rows, columns).astype(np.float64) - 1024
    grey: npt.NDArray[np.uint8] = np.clip((hu - (40 - 200)) * 255 / 400, 0, 255).astype(np.uint8)
    return grey


def _jpeg_grey(grey: npt.NDArray[np.uint8], quality: int) -> bytes:
    """One 8-bit greyscale JPEG Baseline frame, encoded by Pillow (libjpeg)."""
    out = io.BytesIO()
    Image.fromarray(grey).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def jpeg_series_slice(index: int, rows: int = 512, columns: int = 512, quality: int = 90) -> bytes:
    """Slice ``index`` of an 8-bit JPEG Baseline series: ``ct_grey(index)`` as a MONOCHROME2
    Secondary Capture object of one frame, encoded by Pillow at ``quality``, Lossy Image
    Compression and its ratio said; one series (and study) per size and quality, the SOP
    Instance UID naming the slice.

    The shape of an archive's 8-bit single-frame images (secondary captures, exported
    X-ray and ultrasound frames): a slice decodes to ``rows x columns`` bytes (pydicom's
    ``pixel_array``: ``uint8``), with no Modality LUT.
    """
    key = ("jpeg-series", rows, columns, quality)
    ds = base_dataset(
        _SC_STORAGE, uid(*key, index, "sop"), "OT", uid(*key, "study"), uid(*key, "series")
    )
    ds.ImageType = ["DERIVED", "SECONDARY"]
    ds.ConversionType = "WSD"
    ds.InstanceNumber = index + 1
    image_pixel(ds, rows, columns, (8, 8), signed=False)
    return _encapsulated(ds, JPEGBaseline8Bit, _jpeg_grey(ct_grey(index, rows, columns), quality))


def compressed_samples(
    ct_size: int = 512, slide_tiles: tuple[int, int] = (12, 10)
) -> list[tuple[str, bytes]]:
    """The demo's compressed objects: one CT slice per ``CT_SYNTAXES`` entry, both JPEG
    baseline captures, and a JPEG-tiled slide of ``slide_tiles`` (across, down) tiles
    of 256 (12 x 10: ~2.2 MB). About 4 MB in all."""
    out = [
        (f"compressed/ct-{UID(syntax).keyword}.dcm", compressed_ct(syntax, 0, ct_size, ct_size))
        for syntax in CT_SYNTAXES
    ]
    out.append(("compressed/jpeg-baseline-monochrome2.dcm", jpeg_baseline("MONOCHROME2")))
    out.append(("compressed/jpeg-baseline-ybr-full-422.dcm", jpeg_baseline("YBR_FULL_422")))
    across, down = slide_tiles
    slide = jpeg_slide_bytes(tiles_across=across, tiles_down=down)
    out.append((f"slide/jpeg-tiled-{across}x{down}x256.dcm", slide))
    return out
