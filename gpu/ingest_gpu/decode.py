"""Compressed frames decoded on the device by nvImageCodec, straight into the input arena.

A ``ChunkJob`` with ``encoded`` frames carries codestreams instead of samples.
The device thread decodes every encoded frame of a batch in one nvImageCodec
call per colour conversion (frames of one object and of many together: the
batched call is what makes the GPU fast: one frame a call is many times slower),
on the runner's own stream, each frame into its place in the runner's input
arena, which ``nvimgcodec.as_image`` wraps as the frame's output image. The
preprocessing kernel then reads decoded frames exactly as it reads copied
samples, and the decoded values never visit host memory.

Facts this relies on (nvImageCodec 0.9, ``python/decoder.cpp``):

- ``Decoder.decode`` parses the codestreams and runs the host parts of the
  decode in the call and waits for its own work; the output is complete in
  ``cuda_stream``'s order, so the kernel issued after it on the same stream
  reads finished frames, and the host bytes may be reused once it returns.
- A frame that cannot be decoded comes back as ``None`` (its neighbours are
  unaffected), but an output image too small for what a codestream declares
  fails the whole call. So each frame's declared size, channels and sample
  width are checked against the job's format first; a frame that disagrees,
  and one that comes back ``None``, fail their job alone with
  ``DeviceDecodeError``, which the caller answers by decoding on the CPU.
- The wrapped arena memory is ours: nvImageCodec allocates no output image,
  so steady state allocates nothing beyond the arenas' growth
  (``gpu/ingest_gpu/transfer.py``) and nvImageCodec's own scratch, sized by the batch.
  The wrapping ``Image`` of a place in the arena is kept and given again to
  later batches that decode a frame of the same shape there (a slide's batches
  all look alike), since making one costs as much host time as a frame's decode.
- A ``CodeStream`` parses its codestream's header with the GIL released (twice
  a frame: made, then read) and depends on no decoder, so ``parse_each`` may run
  on any thread: the pipeline parses a slide's frames as it splits them, while
  the device thread decodes earlier ones. Frames may be views of the pinned ring
  slots they were read into (no host copy); their owner keeps them until the
  job's ``on_consumed``.

Only formats whose result the CPU path (pydicom's ``pixel_array``) gives the
same way are sent here (``ingest/dicom/device_codecs.py`` decides); Bits
Stored masking and sign extension are the kernel's (``gpu/ingest_gpu/preprocess.py``), as
for stored samples.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np

from ingest_gpu.formats import PixelFormat

Colour = Literal["unchanged", "rgb"]  # keep the codestream's samples; or convert YCbCr to RGB
Parsed = tuple[Any, str]  # a frame's CodeStream and its output's typestr
MAX_KEPT_IMAGES: Final = 8192  # places in the arena whose Image is kept for the next batches


class DeviceDecodeError(Exception):
    """The device could not decode a job's frames; the CPU decoders may still."""


@dataclass(frozen=True, slots=True)
class EncodedFrames:
    """A job's codestreams, one a frame, and the colour conversion pydicom applies to them;
    ``parsed``: each frame's ``CodeStream`` and output typestr, once ``parse`` made them."""

    frames: tuple[bytes | memoryview, ...]
    colour: Colour = "unchanged"
    parsed: tuple[Parsed, ...] | None = None


def parse_each(
    frames: Sequence[bytes | memoryview], fmt: PixelFormat, colour: Colour
) -> list[Parsed | DeviceDecodeError]:
    """Each frame's ``CodeStream``, made and checked against ``fmt``, or the error that
    keeps it off the device: the host part of the decode, done on the thread that split
    the frames out (one thread: many threads each releasing the GIL a frame at a time
    slow each other down), so that the device thread only decodes.
    """
    try:
        from nvidia import nvimgcodec
    except ImportError as exc:
        return [DeviceDecodeError(f"nvImageCodec is unavailable ({exc})")] * len(frames)
    parsed: list[Parsed | DeviceDecodeError] = []
    for frame in frames:
        try:
            parsed.append(_code_stream(nvimgcodec, frame, fmt, colour))
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
    """None when nvImageCodec can be imported here, else why not (no import is made)."""
    try:
        found = importlib.util.find_spec("nvidia.nvimgcodec") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "nvImageCodec (nvidia-nvimgcodec-cu13) is not installed"


class _Output:
    """A frame's place in the arena, as a CUDA array for ``nvimgcodec.as_image``."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, shape: tuple[int, int, int], typestr: str) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


class NvDecoder:
    """One nvImageCodec decoder on the device thread; created there, at the first
    encoded job.

    Raises (constructor):
        ImportError: nvImageCodec is not installed.
    """

    def __init__(self, device_index: int, stats: dict[str, int | float]) -> None:
        from nvidia import nvimgcodec

        self._nv = nvimgcodec
        # fancy upsampling: 4:2:2 chroma interpolated as libjpeg does it (pydicom's decoders)
        self._decoder = nvimgcodec.Decoder(device_id=device_index, options=":fancy_upsampling=1")
        self._params = {
            "unchanged": nvimgcodec.DecodeParams(
                allow_any_depth=True, color_spec=nvimgcodec.ColorSpec.UNCHANGED
            ),
            "rgb": nvimgcodec.DecodeParams(
                allow_any_depth=True, color_spec=nvimgcodec.ColorSpec.SRGB
            ),
        }
        self._stats = stats
        self._images: dict[tuple[int, tuple[int, int, int], str], Any] = {}
        for key in ("device_decoded_frames", "device_decode_calls", "device_decode_failures"):
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
        calls: dict[Colour, list[tuple[int, int, Any, Any]]] = {"unchanged": [], "rgb": []}
        if len(self._images) > MAX_KEPT_IMAGES:
            self._images.clear()
        for item, (encoded, fmt, ptr) in enumerate(work):
            parsed = encoded.parsed
            if parsed is None:
                try:
                    parsed = parse(encoded, fmt).parsed
                except DeviceDecodeError as exc:
                    failed[item] = exc
                    continue
                assert parsed is not None
            shape = (fmt.rows, fmt.columns, fmt.samples)
            size, kept, call = fmt.frame_bytes, self._images, calls[encoded.colour]
            for k, (stream, typestr) in enumerate(parsed):
                place = (ptr + k * size, shape, typestr)
                image = kept.get(place)
                if image is None:
                    out = _Output(place[0], shape, typestr)
                    image = kept[place] = self._nv.as_image(out, cuda_stream=stream_handle)
                call.append((item, k, stream, image))
        for colour, frames in calls.items():
            frames = [f for f in frames if failed[f[0]] is None]
            if not frames:
                continue
            self._stats["device_decode_calls"] += 1
            try:
                images = self._decoder.decode(
                    [f[2] for f in frames],
                    images=[f[3] for f in frames],
                    params=self._params[colour],
                    cuda_stream=stream_handle,
                )
            except Exception as exc:  # the call as a whole: its frames go to the CPU
                images = [None] * len(frames)
                cause: BaseException | None = exc
            else:
                cause = None
            decoded = 0
            for (item, k, _, _), image in zip(frames, images, strict=True):
                if image is None and failed[item] is None:
                    error = DeviceDecodeError(f"nvImageCodec could not decode frame {k}")
                    error.__cause__ = cause
                    failed[item] = error
                decoded += image is not None
            self._stats["device_decoded_frames"] += decoded
        self._stats["device_decode_failures"] += sum(f is not None for f in failed)
        return failed


def _code_stream(
    nv: Any, frame: bytes | memoryview, fmt: PixelFormat, colour: Colour
) -> tuple[Any, str]:
    """The frame's ``CodeStream`` (over its bytes, no copy) and its output's typestr.

    Raises:
        DeviceDecodeError: the codestream cannot be parsed or declares another image.
    """
    data = np.frombuffer(frame, dtype=np.uint8)
    try:
        stream = nv.CodeStream(data)
        height, width = stream.height, stream.width
        channels = 3 if colour == "rgb" else stream.num_channels
        dtype = np.dtype(stream.dtype)
    except Exception as exc:
        raise DeviceDecodeError(f"nvImageCodec cannot parse the codestream ({exc})") from exc
    declared = (height, width, channels, dtype.itemsize)
    wanted = (fmt.rows, fmt.columns, fmt.samples, fmt.itemsize)
    if declared != wanted:
        raise DeviceDecodeError(
            f"the codestream declares {height} x {width} x {channels} samples of"
            f" {dtype.itemsize * 8} bits; the header {fmt.rows} x {fmt.columns} x"
            f" {fmt.samples} of {fmt.bits_allocated}"
        )
    return stream, dtype.str
