"""Which compressed objects the device decodes (nvImageCodec), and in what layout.

The device decodes a frame only where its result is the CPU path's
(``ingest.dicom.codec``: pydicom's ``pixel_array``): exactly for the lossless
syntaxes, within the lossy bound for the others (``tests/gpu/test_decode.py`` checks
both on the device). Checked with nvImageCodec 0.9 over pydicom's and this project's
compressed samples:

- JPEG Baseline: monochrome, and YBR_FULL / YBR_FULL_422 converted to RGB (as
  pydicom converts them). A JPEG labelled RGB is not sent: pydicom reads its
  codestream's markers to decide whether it holds YCbCr, which nvImageCodec
  does not do the same way.
- JPEG Lossless SV1 is not sent: nvJPEG's lossless decoder decodes it into
  its own buffers, but into the caller's (``ingest_gpu.decode``) it wrote out of bounds
  on a 128 x 96 slice (CUDA error 700). JPEG Lossless with another predictor,
  JPEG Extended (12-bit), JPEG-LS and RLE have no device decoder.
- HTJ2K Lossless (and RPCL): monochrome, RGB as stored, YBR_ICT / YBR_RCT
  converted to RGB (the codestream's own component transform, as pydicom does).
  HTJ2K (1.2.840.10008.1.2.4.203, lossy allowed) is not sent: on a lossy 12-bit
  128 x 96 slice nvImageCodec's result was 25.8 dB from openjpeg's, under the
  40 dB bound.
- JPEG 2000 (Part 1) decodes on the device exactly as on the CPU, but nvJPEG2000 is
  fast only over large batches: one frame a call is many times slower than
  nvImageCodec's batched call. Single-frame objects reach the device a few at a
  time, too few to batch, and the worker's CPU processes decode them faster, so they
  stay on the CPU. An object of ``MIN_DEVICE_J2K_FRAMES`` frames or more (an
  Enhanced CT series, a slide) fills batches of its own and goes to the device,
  which decodes it faster than the CPU processes do (docs/benchmarks.md, "Decoding
  compressed objects"). The bound is one device group of 512 x 512 frames in hook
  mode, not a measured crossover: no volume between a single frame and the
  benchmark's 1,200-frame one was measured.

Palette colour and the Modality LUT Sequence are table look-ups pydicom applies
after decoding: those objects stay on the CPU path. The device output is the
decoded sample in 8 or 16 bits; Bits Stored masking and sign extension are the
kernel's, as for stored samples (``ingest_gpu.formats.PixelFormat``).
"""

from __future__ import annotations

from typing import Final

from pydicom.uid import JPEGBaseline8Bit

from ingest.dicom.codec_read import Codec
from ingest.dicom.syntaxes import J2K_CODESTREAMS, SYNTAXES
from ingest_gpu.decode import Colour
from ingest_gpu.formats import PixelFormat

# where nvImageCodec's result is pydicom's (exact, or within the lossy bound)
MATCHING_SYNTAXES: Final = frozenset(uid for uid, s in SYNTAXES.items() if s.device)
# JPEG 2000 Part 1 (not HTJ2K): fast on the device only in large batches
J2K_PART1: Final = frozenset(uid for uid, s in SYNTAXES.items() if s.family == "jpeg2000")
# what the worker sends to the device: those, JPEG 2000 only in objects of many frames
DEVICE_SYNTAXES: Final = MATCHING_SYNTAXES
MIN_DEVICE_J2K_FRAMES: Final = 32
_MONOCHROME: Final = frozenset({"MONOCHROME1", "MONOCHROME2"})
# Smaller frames decode faster on the CPU processes: from these sizes on, the device's
# batches overtake a pool of one process a core (sooner for JPEG colour tiles than for
# JPEG monochrome and HTJ2K). Where they lie depends on the machine: python -m
# ingest.bench.diagnostics.decode_crossover measures them.
MIN_DEVICE_PIXELS_JPEG_COLOUR: Final = 128 * 128
MIN_DEVICE_PIXELS: Final = 256 * 256


def device_colour(codec: Codec) -> Colour | None:
    """The conversion the device applies to ``codec``'s frames, or None: CPU only (a
    syntax in ``DEVICE_SYNTAXES``, frames of at least ``MIN_DEVICE_PIXELS``, JPEG 2000
    in objects of at least ``MIN_DEVICE_J2K_FRAMES``)."""
    if codec.transfer_syntax_uid not in DEVICE_SYNTAXES:
        return None
    if codec.transfer_syntax_uid in J2K_PART1 and codec.number_of_frames < MIN_DEVICE_J2K_FRAMES:
        return None
    colour = matching_colour(codec)
    jpeg_colour = codec.transfer_syntax_uid == JPEGBaseline8Bit and colour == "rgb"
    least = MIN_DEVICE_PIXELS_JPEG_COLOUR if jpeg_colour else MIN_DEVICE_PIXELS
    return colour if codec.rows * codec.columns >= least else None


def matching_colour(codec: Codec) -> Colour | None:
    """The conversion that makes nvImageCodec's frames pydicom's, or None where none does
    (``MATCHING_SYNTAXES``; the bench's nvImageCodec reader decodes with it)."""
    uid, photometric = codec.transfer_syntax_uid, codec.photometric_interpretation
    if uid not in MATCHING_SYNTAXES or codec.bits_allocated not in (8, 16):
        return None
    if codec.palette is not None or codec.modality_lut is not None:
        return None
    if photometric in _MONOCHROME:
        return "unchanged"
    if uid == JPEGBaseline8Bit and photometric in ("YBR_FULL", "YBR_FULL_422"):
        return "rgb"
    j2k = uid in J2K_CODESTREAMS
    if j2k and photometric in ("YBR_ICT", "YBR_RCT"):
        return "rgb"
    if j2k and photometric == "RGB":
        return "unchanged"
    return None


def device_format(codec: Codec) -> PixelFormat:
    """The layout the device decodes the object's frames to: interleaved samples of Bits
    Allocated, with the header's Bits Stored and sign for the kernel."""
    return PixelFormat(
        rows=codec.rows,
        columns=codec.columns,
        frames=codec.number_of_frames,
        samples=codec.samples_per_pixel,
        bits_allocated=codec.bits_allocated,
        bits_stored=codec.bits_stored,
        signed=codec.pixel_representation == 1,
        planar=False,
    )
