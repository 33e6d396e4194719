"""Stored frames to output values for every transfer syntax and pixel semantic pydicom 3 decodes.

What the native path (``header``, ``gpu``) does not take as stored (``needs_codec``:
compressed, big endian, deflated, 1-bit, YBR, PALETTE COLOR, Modality LUT
Sequence) is decoded here: a frame comes out exactly as pydicom 3's
``ds.pixel_array[k]`` (default options: YBR_FULL/YBR_FULL_422 to RGB, Bits
Stored masked or sign-extended), through the palette (``apply_color_lut``) or
the Modality LUT Sequence (``apply_modality_lut``), in little-endian integers.
Exact because it is pydicom's own decoder run on one frame (``Decoder.as_array``,
same plugins), then ``codec_luts``' copies of the two LUT functions. A
:class:`Codec` (``codec_read``) and these functions are pure and picklable, for a
process pool (the pylibjpeg plugins hold the GIL), and safe in threads.

pydicom warns where a decode meets something odd; swapping warning filters is
process-wide in Python 3.11 and would race ``parse``'s threads, so nothing here
makes it warn: options were checked when the codec was made (``validate=False``)
and a JPEG colour frame whose codestream contradicts Photometric Interpretation
(JFIF marker, RGB component IDs) is given the value pydicom would switch to, as
pydicom finds it. pydicom's and pylibjpeg's log lines (a failing plugin logs a
traceback) are dropped while this thread decodes.

A JPEG, JPEG-LS or JPEG 2000 frame must have a header no larger than the image
(so a lying codestream cannot make a decoder allocate more than a frame) and
end with its end marker: libjpeg and CharLS decode truncated codestreams, even
a few header bytes, to zeros without a word, and pydicom returns those. What
does not decode raises ``MalformedDicom`` naming the transfer syntax and the
frame; messages hold element names and numbers, never values.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from math import ceil
from typing import Any, Final

import numpy as np
from pydicom.encaps import encapsulate
from pydicom.pixels.decoders.base import get_decoder
from pydicom.pixels.utils import _get_jpg_parameters
from pydicom.uid import JPEGBaseline8Bit

from ingest.dicom.codec_luts import Array, Lut, apply_lut, apply_palette
from ingest.dicom.codec_read import (
    Codec,
    codec_from_dataset,
    conversions,
    missing_gpl_decoder,
    needs_codec,
)
from ingest.dicom.codestreams import j2k_size, jpeg_size
from ingest.dicom.syntaxes import (
    ENCAPSULATED_UNCOMPRESSED,
    EXPLICIT_VR_BE,
    J2K_CODESTREAMS,
    JPEG_CODESTREAMS,
    NATIVE,
    SYNTAXES,
)
from ingest.errors import MalformedDicom, UnsupportedDicom
from ingest_gpu.formats import PixelFormat

__all__ = [
    "Codec",
    "Lut",
    "codec_from_dataset",
    "conversions",
    "decode_encapsulated",
    "decode_native",
    "decoded_format",
    "needs_codec",
]

_RGB_IDS: Final = ([82, 71, 66], [114, 103, 98])  # "RGB", "rgb"


def decoded_format(codec: Codec) -> PixelFormat:
    """The layout of what ``decode_*`` return: final values, little endian, interleaved."""
    dtype = _output_dtype(codec)
    return PixelFormat(
        rows=codec.rows,
        columns=codec.columns,
        frames=codec.number_of_frames,
        samples=3 if codec.palette is not None else codec.samples_per_pixel,
        bits_allocated=dtype.itemsize * 8,
        bits_stored=dtype.itemsize * 8,
        signed=dtype.kind == "i",
        planar=False,
    )


def decode_encapsulated(codec: Codec, frames: Sequence[bytes], first: int = 0) -> Array:
    """Frames given as their codestreams (each frame's fragments joined), decoded.

    Returns shape ``(len(frames), *codec.frame_shape)`` in ``decoded_format``'s
    dtype: ``ds.pixel_array[k]``, then the palette or Modality LUT Sequence.
    ``first`` is the index of ``frames[0]`` in the object, for messages. For
    Encapsulated Uncompressed each item is one frame's samples.

    Raises:
        MalformedDicom: a codestream that does not decode to this image (naming the
            transfer syntax and the frame's index).
    """
    if codec.transfer_syntax_uid in NATIVE:
        raise ValueError(f"{codec.syntax_name} is native: use decode_native")
    out = np.empty((len(frames), *codec.frame_shape), dtype=_output_dtype(codec))
    with _quiet():
        for k, frame in enumerate(frames):
            where = f"frame {first + k}"
            _put(codec, out, k, _finish(codec, _decode_frame(codec, bytes(frame), where)), where)
    return out


def decode_native(codec: Codec, pixel_data: bytes | memoryview, first: int, count: int) -> Array:
    """Frames ``[first, first + count)`` of native Pixel Data, decoded like ``decode_encapsulated``.

    ``pixel_data`` is the element's value from its start, whole or at least up
    to the last frame wanted; a Deflated object's after inflation.

    Raises:
        MalformedDicom: ``pixel_data`` ends before the last frame wanted.
    """
    if codec.transfer_syntax_uid not in NATIVE:
        raise ValueError(f"{codec.syntax_name} is not native: use decode_encapsulated")
    if first < 0 or count < 0 or first + count > codec.number_of_frames:
        raise ValueError(f"frames {first}..{first + count} of {codec.number_of_frames}")
    length = _native_frame_length(codec)
    swap_pairs = _swaps_ow_pairs(codec)
    need = ceil(length * (first + count))
    if swap_pairs and length % 2 and (first + count - 1) % 2 == 0:
        need += 1  # pydicom reads one byte past such a frame: the next one's, or the pad
    if count and len(pixel_data) < need:
        raise MalformedDicom(
            f"{codec.syntax_name}: Pixel Data holds {len(pixel_data)} bytes;"
            f" frames {first}..{first + count - 1} need {need}"
        )
    whole = ceil(length * codec.number_of_frames)
    full = whole // 2 * 3  # as pydicom refuses it: full YBR stored, labelled YBR_FULL_422
    if codec.photometric_interpretation == "YBR_FULL_422" and len(pixel_data) >= full + full % 2:
        raise MalformedDicom(
            f"{codec.syntax_name}: Pixel Data of {len(pixel_data)} bytes is a third larger"
            f" than YBR_FULL_422 needs ({whole})"
        )
    out = np.empty((count, *codec.frame_shape), dtype=_output_dtype(codec))
    view = memoryview(pixel_data)
    where = f"frames {first}..{first + count - 1}"
    with _quiet():
        if not count:
            pass
        elif codec.bits_allocated == 1:
            arr = _unpacked(codec, view, first, count)
            for k in range(count):
                _put(codec, out, k, _finish(codec, arr[k]), where)
        elif not (swap_pairs and length % 2):
            size = int(length)  # frames of whole bytes: one call for all of them
            chunk = view[first * size : (first + count) * size]
            arr = _as_array(codec, chunk, None, count, where=where)
            arr = arr.reshape(count, *_stored_shape(codec))
            for k in range(count):
                _put(codec, out, k, _finish(codec, arr[k]), where)
        else:  # frame k's words straddle frame k+1's: pydicom reads each with its neighbour
            for k in range(first, first + count):
                arr = _as_array(codec, view, k, codec.number_of_frames, where=f"frame {k}")
                _put(codec, out, k - first, _finish(codec, arr), where)
    return out


def _unpacked(codec: Codec, view: memoryview, first: int, count: int) -> Array:
    """Bits Allocated 1: the bits of frames ``[first, first + count)``, one byte each.

    pydicom's whole-object decode (``np.unpackbits``, little bit order; planar
    colour planes interleaved); its one-frame decode reads a byte short when a
    frame starts inside a byte.
    """
    pixels = codec.rows * codec.columns * codec.samples_per_pixel
    start, end = first * pixels, (first + count) * pixels
    packed = np.frombuffer(view[start // 8 : ceil(end / 8)], dtype=np.uint8)
    bits = np.unpackbits(packed, bitorder="little")[start % 8 : start % 8 + end - start]
    if codec.planar_configuration == 1:
        planes = bits.reshape(count, codec.samples_per_pixel, codec.rows, codec.columns)
        return planes.transpose(0, 2, 3, 1)
    return bits.reshape(count, *_stored_shape(codec))


def _decode_frame(codec: Codec, frame: bytes, where: str) -> Array:
    uid = codec.transfer_syntax_uid
    if not frame:
        raise MalformedDicom(f"{codec.syntax_name} {where}: no bytes")
    if uid == ENCAPSULATED_UNCOMPRESSED:  # one frame's native samples (a pad byte may follow)
        length = ceil(_native_frame_length(codec))
        if len(frame) < length:
            raise MalformedDicom(f"{codec.syntax_name} {where}: {len(frame)} bytes, not {length}")
        return _as_array(codec, frame[:length], None, 1, where=where)
    photometric = codec.photometric_interpretation
    jpeg = uid in JPEG_CODESTREAMS
    if jpeg or uid in J2K_CODESTREAMS:
        _check_size(codec, jpeg_size(frame) if jpeg else j2k_size(frame), where)
        if b"\xff\xd9" not in frame[-10:]:  # EOI / EOC, where pydicom looks for it
            raise MalformedDicom(f"{codec.syntax_name} {where}: the codestream has no end marker")
    if jpeg:
        photometric = _conformed(codec, _get_jpg_parameters(frame))  # pydicom's own parse
    return _as_array(codec, encapsulate([frame]), 0, 1, where=where, photometric=photometric)


def _conformed(codec: Codec, info: dict[str, Any]) -> str:
    """The Photometric Interpretation pydicom decodes a JPEG (-LS) colour frame with.

    pydicom's ``DecodeRunner._conform_jpg_colorspace``, which also warns.
    """
    photometric = codec.photometric_interpretation
    if codec.samples_per_pixel != 3:
        return photometric
    if info.get("component_ids") in _RGB_IDS and photometric != "RGB":
        return "RGB"
    for marker in info.get("app", {}).values():
        if marker.startswith(b"JFIF") and "YBR" not in photometric:
            baseline = codec.transfer_syntax_uid == JPEGBaseline8Bit
            return "YBR_FULL_422" if baseline else "YBR_FULL"
    return photometric


def _put(codec: Codec, out: Array, k: int, values: Array, where: str) -> None:
    """``out[k] = values``, refusing what would need a cast or a broadcast to fit."""
    if values.dtype != out.dtype or values.shape != out.shape[1:]:
        raise UnsupportedDicom(
            f"{codec.syntax_name} {where}: decoded to {values.dtype} {values.shape},"
            f" not {out.dtype} {out.shape[1:]}"
        )
    out[k] = values


def _as_array(
    codec: Codec,
    src: bytes | memoryview,
    at: int | None,
    frames: int,
    *,
    where: str,
    photometric: str | None = None,
) -> Array:
    """pydicom's decode of frame ``at`` of ``src`` (all its ``frames`` when None)."""
    syntax = SYNTAXES[codec.transfer_syntax_uid]
    decoder = get_decoder(syntax.decoder_uid)
    options: dict[str, Any] = {
        "rows": codec.rows,
        "columns": codec.columns,
        "samples_per_pixel": codec.samples_per_pixel,
        "bits_allocated": codec.bits_allocated,
        "bits_stored": codec.bits_stored,
        "pixel_representation": codec.pixel_representation,
        "photometric_interpretation": photometric or codec.photometric_interpretation,
        "planar_configuration": codec.planar_configuration,
        "number_of_frames": frames,
        "pixel_keyword": "PixelData",
        "pixel_vr": codec.pixel_vr,
    }
    # the syntax's faster plugin first where it is installed (the same values), then
    # pydicom's order, the fallback for streams only it tolerates
    first = syntax.plugin
    plugins = (first, "") if first and first in decoder.available_plugins else ("",)
    failure: BaseException | None = None
    for plugin in plugins:
        try:
            arr, _ = decoder.as_array(
                src, index=at, validate=False, decoding_plugin=plugin, **options
            )
            return arr
        except MemoryError:
            raise
        except Exception as exc:  # the plugins raise anything on bad input
            failure = exc
        except BaseException as exc:
            # pyo3's PanicException (pylibjpeg-rle) is not an Exception.
            if type(exc).__name__ != "PanicException":
                raise
            failure = exc
    missing = missing_gpl_decoder(codec.transfer_syntax_uid)
    if missing is not None:  # what is installed could not; what is left out might
        raise missing from failure
    raise MalformedDicom(
        f"{codec.syntax_name} {where}: the Pixel Data does not decode ({type(failure).__name__})"
    ) from failure


def _finish(codec: Codec, arr: Array) -> Array:
    """Little endian, then the palette or the Modality LUT Sequence, in their dtype."""
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if codec.palette is not None:
        return apply_palette(arr, codec.palette)
    if codec.modality_lut is not None:
        return apply_lut(arr, codec.modality_lut)
    return arr


def _output_dtype(codec: Codec) -> np.dtype[Any]:
    if codec.palette is not None:
        return np.dtype(f"<u{codec.palette[0].bits // 8}")
    if codec.modality_lut is not None:
        return np.dtype(f"<u{codec.modality_lut.bits // 8}")
    if codec.bits_allocated == 1:
        return np.dtype("u1")
    return np.dtype(f"<{'ui'[codec.pixel_representation]}{codec.bits_allocated // 8}")


def _stored_shape(codec: Codec) -> tuple[int, ...]:
    """One frame as pydicom returns it, before a palette adds its channel axis."""
    if codec.samples_per_pixel == 1:
        return (codec.rows, codec.columns)
    return (codec.rows, codec.columns, codec.samples_per_pixel)


def _native_frame_length(codec: Codec) -> float:
    """Bytes of one native frame, as pydicom counts them (fractional for packed bits)."""
    pixels = codec.rows * codec.columns * codec.samples_per_pixel
    if codec.bits_allocated == 1:
        return pixels / 8
    length = pixels * codec.bits_allocated // 8
    if codec.photometric_interpretation == "YBR_FULL_422":
        length = length // 3 * 2  # PS3.3 C.7.6.3.1.2: two chroma samples per two pixels
    return length


def _swaps_ow_pairs(codec: Codec) -> bool:
    """Big-endian 8-bit OW: pydicom swaps the bytes of each 16-bit word."""
    return (
        codec.transfer_syntax_uid == EXPLICIT_VR_BE
        and codec.bits_allocated == 8
        and codec.pixel_vr == "OW"
    )


def _check_size(codec: Codec, size: tuple[int, int, int] | None, where: str) -> None:
    """Refuse a codestream without a frame header, or whose header claims more than a frame."""
    if size is None:
        raise MalformedDicom(f"{codec.syntax_name} {where}: the codestream has no frame header")
    height, width, components = size
    if not (height and width and components):  # a JPEG height of 0 (a DNL marker later)
        raise MalformedDicom(  # makes libjpeg and CharLS grow their buffers without bound
            f"{codec.syntax_name} {where}: the codestream's frame header gives"
            f" {width} x {height} x {components}"
        )
    if height * width * components > codec.rows * codec.columns * codec.samples_per_pixel:
        raise MalformedDicom(
            f"{codec.syntax_name} {where}: the codestream is {width} x {height}"
            f" x {components}, larger than the {codec.columns} x {codec.rows}"
            f" x {codec.samples_per_pixel} image"
        )


# a failing plugin logs its traceback on these loggers; the error says it already
_state = threading.local()


def _drop_while_decoding(record: logging.LogRecord) -> bool:
    return not getattr(_state, "on", False)


for _name in ("pydicom", "pydicom.pixels.decoders.base", "pydicom.pixels.utils", "pylibjpeg.utils"):
    logging.getLogger(_name).addFilter(_drop_while_decoding)


@contextmanager
def _quiet() -> Iterator[None]:
    _state.on = True
    try:
        yield
    finally:
        _state.on = False
