"""Compressed frames decoded on the device by nvImageCodec, straight into the input arena.

A ``ChunkJob`` with ``encoded`` frames carries codestreams instead of samples.
The device thread decodes every encoded frame of a batch in one nvImageCodec
call (frames of one object and of many together, each with its own colour conversion: the
batched call is what makes the GPU fast: one frame a call is many times slower),
on the runner's own stream, each frame into its place in the runner's input
arena, which an output image wraps. The preprocessing kernel then reads decoded
frames exactly as it reads copied samples, and the decoded values never visit
host memory.

nvImageCodec is called through its C API (``ingest_gpu.nvimgcodec_api``), which
gives the GIL away twice a batch; its Python module takes it back for every frame,
which in a busy worker costs most of the decode's rate. Facts this relies on:

- The decode call runs the host parts of the decode and waits for its own work;
  the output is complete in the stream's order, so the kernel issued after it on
  the same stream reads finished frames, and the host bytes may be reused once it
  returns.
- A frame that cannot be decoded reports its own failure (its neighbours are
  unaffected); the frames the hardware and CUDA decoders refuse get a second call
  with the hybrid and CPU ones (``BACKENDS``, ``FALLBACK_BACKENDS``). An output image
  too small for what a codestream declares fails the whole call. So each frame's
  declared size, channels and sample width are checked against the job's format
  first; a frame that disagrees,
  and one that fails, fail their job alone with ``DeviceDecodeError``, which the
  caller answers by decoding on the CPU.
- The wrapped arena memory is ours: nvImageCodec allocates no output image,
  so steady state allocates nothing beyond the arenas' growth
  (``gpu/ingest_gpu/transfer.py``) and nvImageCodec's own scratch, sized by the batch.
  The output image of a place in the arena is kept and given again to later
  batches that decode a frame of the same description there (a slide's batches
  all look alike).
- A codestream's header is parsed when it is made, a few microseconds with the
  GIL held, and depends on no decoder, so ``parse_each`` may run on any thread:
  the pipeline parses a slide's frames as it splits them, while the device thread
  decodes earlier ones. Frames may be views of the pinned ring slots they were
  read into (no host copy); their owner keeps them until the job's
  ``on_consumed``, and the codestream keeps a reference to its bytes.

Only formats whose result the CPU path (pydicom's ``pixel_array``) gives the
same way are sent here (``ingest/dicom/device_codecs.py`` decides); Bits
Stored masking and sign extension are the kernel's (``gpu/ingest_gpu/preprocess.py``), as
for stored samples.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np

from ingest_gpu import nvimgcodec_api as api
from ingest_gpu.formats import PixelFormat

Colour = Literal["unchanged", "rgb"]  # keep the codestream's samples; or convert YCbCr to RGB
JpegDecoder = Literal["hardware", "cuda"]  # which of nvImageCodec's JPEG decoders goes first
Parsed = api.CodeStream  # a frame's codestream, made and checked against its header
MAX_KEPT_IMAGES: Final = 8192  # places in the arena whose output image is kept for the next batches
# fancy upsampling: 4:2:2 chroma interpolated as libjpeg does it (pydicom's decoders)
OPTIONS: Final = ":fancy_upsampling=1"
# nvImageCodec's backends, in order, by the JPEG decoder that goes first: the GPU's
# hardware JPEG engines (the least CPU a frame for one process), or the CUDA decoders
# (nvJPEG's, nvJPEG2000's: processes that share a GPU contend for its engines, and went
# faster with the CUDA decoder first); each takes what the first leaves. HTJ2K and JPEG
# 2000 frames go to the CUDA decoder either way. Not the hybrid and CPU ones that every
# backend would add to the same call: in a worker, whose own threads and the servers
# share the host, they took most of a slide's 512-pixel tiles at 900 CPU us each (98
# with these two) and made the decode slower, not faster.
BACKENDS: Final[dict[JpegDecoder, tuple[int, ...]]] = {
    "hardware": (api.HW_GPU_ONLY, api.GPU_ONLY),
    "cuda": (api.GPU_ONLY, api.HW_GPU_ONLY),
}
# the frames those two refuse (some small or unusual JPEGs the CUDA decoder fails on)
# get a second call with the backends that decode them, before the CPU path
FALLBACK_BACKENDS: Final = (api.HYBRID_CPU_GPU, api.CPU_ONLY)


class DeviceDecodeError(Exception):
    """The device could not decode a job's frames; the CPU decoders may still."""


@dataclass(frozen=True, slots=True)
class EncodedFrames:
    """A job's codestreams, one a frame, and the colour conversion pydicom applies to them;
    ``parsed``: each frame's codestream, once ``parse`` made them."""

    frames: tuple[bytes | memoryview, ...]
    colour: Colour = "unchanged"
    parsed: tuple[Parsed, ...] | None = None


def parse_each(
    frames: Sequence[bytes | memoryview], fmt: PixelFormat, colour: Colour
) -> list[Parsed | DeviceDecodeError]:
    """Each frame's codestream, made and checked against ``fmt``, or the error that
    keeps it off the device: the host part of the decode, done on the thread that split
    the frames out, so that the device thread only decodes.
    """
    try:
        lib = api.library()
    except api.NvImageCodecError as exc:
        return [DeviceDecodeError(f"nvImageCodec is unavailable ({exc})")] * len(frames)
    parsed: list[Parsed | DeviceDecodeError] = []
    for frame in frames:
        try:
            parsed.append(_code_stream(lib, frame, fmt, colour))
        except DeviceDecodeError as exc:
            parsed.append(exc)
    return parsed


def parse(encoded: EncodedFrames, fmt: PixelFormat) -> EncodedFrames:
    """``encoded`` with every frame parsed (``parse_each``).

    Raises:
        DeviceDecodeError: a frame the device cannot take, or no nvImageCodec.
    """
    parsed = []
    for each in parse_each(encoded.frames, fmt, encoded.colour):
        if isinstance(each, DeviceDecodeError):
            raise each
        parsed.append(each)
    return dataclasses.replace(encoded, parsed=tuple(parsed))


def nvimgcodec_unavailable_reason() -> str | None:
    """None when nvImageCodec is installed here, else why not (nothing is loaded)."""
    try:
        found = importlib.util.find_spec("nvidia.nvimgcodec") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "nvImageCodec (nvidia-nvimgcodec-cu13) is not installed"


class NvDecoder:
    """One nvImageCodec decoder on the device thread; created there, at the first
    encoded job. ``jpeg``: the JPEG decoder that goes first (``BACKENDS``).

    Raises (constructor):
        api.NvImageCodecError: nvImageCodec is not installed, or cannot start.
    """

    def __init__(
        self, device_index: int, stats: dict[str, int | float], jpeg: JpegDecoder = "hardware"
    ) -> None:
        self._lib = api.library()
        self._device_index = device_index
        self._decoder = api.Decoder(device_index, options=OPTIONS, backends=BACKENDS[jpeg])
        self._fallback: api.Decoder | None = None  # made at the first frame it is needed for
        self._stats = stats
        self._images: dict[tuple[int, api.Declared, Colour, int], api.Image] = {}
        for key in (
            "device_decoded_frames",
            "device_decode_calls",
            "device_decode_failures",
            "device_decode_fallbacks",
        ):
            stats.setdefault(key, 0)

    def decode(
        self,
        work: Sequence[tuple[EncodedFrames, PixelFormat, int]],
        stream_handle: int,
    ) -> list[BaseException | None]:
        """Decode each ``(frames, fmt, ptr)``: frame ``k`` to ``ptr + k * fmt.frame_bytes``.

        Returns one entry per item: None, or the ``DeviceDecodeError`` that
        fails it (its memory then holds whatever was written).
        """
        failed: list[BaseException | None] = [None] * len(work)
        call: list[tuple[int, int, api.CodeStream, api.Image]] = []
        kept = self._images
        if len(kept) > MAX_KEPT_IMAGES:
            kept.clear()
        for item, (encoded, fmt, ptr) in enumerate(work):
            parsed = encoded.parsed
            if parsed is None:
                try:
                    parsed = parse(encoded, fmt).parsed
                except DeviceDecodeError as exc:
                    failed[item] = exc
                    continue
                assert parsed is not None
            size, colour = fmt.frame_bytes, encoded.colour
            for k, stream in enumerate(parsed):
                place = (ptr + k * size, stream.declared, colour, stream_handle)
                image = kept.get(place)
                if image is None:
                    try:
                        image = kept[place] = api.Image(
                            self._lib, place[0], stream.declared, colour, stream_handle
                        )
                    except api.NvImageCodecError as exc:
                        failed[item] = DeviceDecodeError(f"frame {k}: {exc}")
                        break
                call.append((item, k, stream, image))
        frames = [f for f in call if failed[f[0]] is None]
        if frames:
            done, cause = self._decode_call(self._decoder, frames)
            refused = [i for i, ok in enumerate(done) if not ok]
            if refused:
                self._stats["device_decode_fallbacks"] += len(refused)
                try:
                    fallback = self._fallback_decoder()
                except api.NvImageCodecError as exc:
                    cause = exc
                else:
                    again, cause = self._decode_call(fallback, [frames[i] for i in refused])
                    for i, ok in zip(refused, again, strict=True):
                        done[i] = ok
            for (item, k, _, _), ok in zip(frames, done, strict=True):
                if not ok and failed[item] is None:
                    error = DeviceDecodeError(f"nvImageCodec could not decode frame {k}")
                    error.__cause__ = cause
                    failed[item] = error
            self._stats["device_decoded_frames"] += sum(done)
        self._stats["device_decode_failures"] += sum(f is not None for f in failed)
        return failed

    def _decode_call(
        self, decoder: api.Decoder, frames: list[tuple[int, int, api.CodeStream, api.Image]]
    ) -> tuple[list[bool], BaseException | None]:
        """Whether each frame decoded, in one call, and the error that failed the call
        as a whole (its frames then did not decode)."""
        self._stats["device_decode_calls"] += 1
        try:
            return decoder.decode([f[2] for f in frames], [f[3] for f in frames]), None
        except api.NvImageCodecError as exc:
            return [False] * len(frames), exc

    def _fallback_decoder(self) -> api.Decoder:
        if self._fallback is None:
            self._fallback = api.Decoder(
                self._device_index, options=OPTIONS, backends=FALLBACK_BACKENDS
            )
        return self._fallback


def _address(frame: bytes | memoryview) -> tuple[object, int, int]:
    """An object that keeps ``frame``'s bytes alive, their address and length (no copy)."""
    if isinstance(frame, bytes):
        address = ctypes.cast(ctypes.c_char_p(frame), ctypes.c_void_p).value
        return frame, address or 0, len(frame)
    array = np.frombuffer(frame, dtype=np.uint8)
    return array, array.__array_interface__["data"][0], array.nbytes


def _code_stream(
    lib: api.Library, frame: bytes | memoryview, fmt: PixelFormat, colour: Colour
) -> Parsed:
    """The frame's codestream (over its bytes, no copy), checked against the header.

    Raises:
        DeviceDecodeError: the codestream cannot be parsed or declares another image.
    """
    owner, address, length = _address(frame)
    try:
        stream = api.CodeStream(lib, owner, address, length)
    except api.NvImageCodecError as exc:
        raise DeviceDecodeError(f"nvImageCodec cannot parse the codestream ({exc})") from exc
    declared = stream.declared
    typestr = declared.typestr
    channels = 3 if colour == "rgb" else declared.channels
    itemsize = np.dtype(typestr).itemsize if typestr else 0
    if typestr is None or (declared.height, declared.width, channels, itemsize) != (
        fmt.rows,
        fmt.columns,
        fmt.samples,
        fmt.itemsize,
    ):
        bits = f"{itemsize * 8} bits" if typestr else f"type {declared.sample_type:#x}"
        raise DeviceDecodeError(
            f"the codestream declares {declared.height} x {declared.width} x {channels}"
            f" samples of {bits}; the header {fmt.rows} x {fmt.columns} x"
            f" {fmt.samples} of {fmt.bits_allocated}"
        )
    return stream
