"""Compressed frames decoded on the device by nvImageCodec, straight into the input arena.

A ``ChunkJob`` with ``encoded`` frames carries codestreams instead of samples.
The device thread decodes every encoded frame of a batch in one nvImageCodec
call per colour conversion (frames of one object and of many together: the
batched call is what makes the GPU fast, 10-20 times one frame a call), on the
runner's own stream, each frame into its place in the runner's input arena,
which ``nvimgcodec.as_image`` wraps as the frame's output image. The
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
  (``gpu/transfer.py``) and nvImageCodec's own scratch, sized by the batch.

Only formats whose result the CPU path (pydicom's ``pixel_array``) gives the
same way are sent here (``ingest/dicom/device_codecs.py`` decides); Bits
Stored masking and sign extension are the kernel's (``gpu/preprocess.py``), as
for stored samples.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from gpu.formats import PixelFormat

Colour = Literal["unchanged", "rgb"]  # keep the codestream's samples; or convert YCbCr to RGB


class DeviceDecodeError(Exception):
    """The device could not decode a job's frames; the CPU decoders may still."""


@dataclass(frozen=True, slots=True)
class EncodedFrames:
    """A job's codestreams, one a frame, and the colour conversion pydicom applies to them."""

    frames: tuple[bytes | memoryview, ...]
    colour: Colour = "unchanged"


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
        for item, (encoded, fmt, ptr) in enumerate(work):
            for k, frame in enumerate(encoded.frames):
                try:
                    stream, typestr = self._code_stream(frame, fmt, encoded.colour)
                except DeviceDecodeError as exc:
                    failed[item] = exc
                    break
                shape = (fmt.rows, fmt.columns, fmt.samples)
                out = _Output(ptr + k * fmt.frame_bytes, shape, typestr)
                image = self._nv.as_image(out, cuda_stream=stream_handle)
                calls[encoded.colour].append((item, k, stream, image))
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
            for (item, k, _, _), image in zip(frames, images, strict=True):
                if image is None and failed[item] is None:
                    error = DeviceDecodeError(f"nvImageCodec could not decode frame {k}")
                    error.__cause__ = cause
                    failed[item] = error
                elif image is not None:
                    self._stats["device_decoded_frames"] += 1
        self._stats["device_decode_failures"] += sum(f is not None for f in failed)
        return failed

    def _code_stream(
        self, frame: bytes | memoryview, fmt: PixelFormat, colour: Colour
    ) -> tuple[Any, str]:
        """The frame's ``CodeStream`` (over its bytes, no copy) and its output's typestr.

        Raises:
            DeviceDecodeError: the codestream cannot be parsed or declares another image.
        """
        data = np.frombuffer(frame, dtype=np.uint8)
        try:
            stream = self._nv.CodeStream(data)
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
