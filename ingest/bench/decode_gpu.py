"""Decode references on the GPU: nvImageCodec's own batched decode and NVIDIA's pydicom plugin.

On the same frames as the CPU references (``decode``):

- ``nvimgcodec`` (the ceiling): every frame's codestream split out beforehand and
  held in memory (``decode._frames_of``), then ``nvimgcodec.Decoder.decode`` over
  batches of ``BATCH`` frames, on the GPU, the decoded images left on the device
  (no copy to the host), one device synchronisation at the end of the run. The
  colour conversion is the one the worker asks of the device
  (``ingest.dicom.device_codecs.matching_colour``: YBR to RGB for JPEG YBR_FULL(_422)
  and JPEG 2000 YBR_ICT/RCT, else the samples unchanged; also for JPEG 2000, which
  the worker measured faster on its CPU processes).
- ``nvimgcodec-plugin`` (the peer users have): NVIDIA's pydicom plugin
  (``nvidia.nvimgcodec.tools.dicom.pydicom_plugin``) registered, then the loop of
  ``pydicom-loop``: ``dcmread`` + ``pixel_array`` per object, ``iter_pixels`` per
  frame of a multi-frame object; one frame a decode call, copied to the host. The
  plugin is named as the decoding plugin, so a frame it fails is an error rather
  than a silent fall-back to a CPU plugin; it is unregistered in ``close``.

Both are skipped, with the reason, where CUDA or nvImageCodec is absent
(``nvimgcodec_missing``, ``plugin_missing``), and, from ``prepare``
(``ReaderSkipped``), on a workload whose frames have no decoder there (RLE).
Nothing is imported at module import time.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from typing import Any

import numpy as np

from ingest.bench import gpu as bench_gpu
from ingest.bench.decode import _check, _frames_of, pydicom_loop
from ingest.bench.readers import ReaderSkipped
from ingest.bench.workloads import Workload

BATCH = 128  # frames a decode call of the ceiling
PLUGIN_MODULE = "nvidia.nvimgcodec.tools.dicom.pydicom_plugin"
PLUGIN_LABEL = "0.8.0+nvimgcodec"  # the plugin's NVIMGCODEC_PLUGIN_LABEL in 0.8 and 0.9


def nvimgcodec_missing() -> str | None:
    """None when CUDA and nvImageCodec can be used here, else why not (nothing imported)."""
    why = bench_gpu.cuda_missing()
    if why is not None:
        return why
    try:
        found = importlib.util.find_spec("nvidia.nvimgcodec") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "nvImageCodec (nvidia-nvimgcodec-cu13) is not installed"


def plugin_missing() -> str | None:
    """None when NVIDIA's pydicom plugin can be imported here, else why not."""
    why = nvimgcodec_missing()
    if why is not None:
        return why
    try:
        importlib.import_module(PLUGIN_MODULE)
    except Exception as exc:  # ImportError, or a library that does not load
        return f"{PLUGIN_MODULE} cannot be imported ({type(exc).__name__}: {exc})"
    return None


class NvImageCodecReader:
    """The ceiling: nvImageCodec's batched decode of every frame, held in memory, on the GPU."""

    name = "nvimgcodec"

    def __init__(self, batch: int = BATCH, device_id: int = 0) -> None:
        self.batch, self.device_id = batch, device_id
        self._batches: list[tuple[str, list[np.ndarray]]] = []
        self._decoder: Any = None
        self._params: dict[str, Any] = {}
        self._version = ""

    def prepare(self, workload: Workload) -> None:
        from ingest.dicom.codec_read import syntax_name
        from ingest.dicom.device_codecs import matching_colour

        runs: list[tuple[str, list[np.ndarray]]] = []
        for path in workload.files:
            codec, frames = _frames_of(path)
            colour = matching_colour(codec)
            if colour is None:
                raise ReaderSkipped(
                    f"nvImageCodec does not decode {syntax_name(codec.transfer_syntax_uid)} "
                    f"{codec.photometric_interpretation} as pydicom does",
                    "CPU only",
                )
            arrays = [np.frombuffer(frame, dtype=np.uint8) for frame in frames]
            if runs and runs[-1][0] == colour:
                runs[-1][1].extend(arrays)
            else:
                runs.append((colour, arrays))
        self._batches = [
            (colour, arrays[i : i + self.batch])
            for colour, arrays in runs
            for i in range(0, len(arrays), self.batch)
        ]
        from nvidia import nvimgcodec

        self._version = str(getattr(nvimgcodec, "__version__", "?"))
        # fancy upsampling: 4:2:2 chroma interpolated as libjpeg does (as the worker asks)
        self._decoder = nvimgcodec.Decoder(device_id=self.device_id, options=":fancy_upsampling=1")
        spec = {"rgb": nvimgcodec.ColorSpec.SRGB, "unchanged": nvimgcodec.ColorSpec.UNCHANGED}
        self._params = {
            colour: nvimgcodec.DecodeParams(allow_any_depth=True, color_spec=value)
            for colour, value in spec.items()
        }

    def run(self, workload: Workload) -> dict[str, Any]:
        import cupy
        from nvidia import nvimgcodec

        frames = nbytes = 0
        held: list[Any] = []  # the last batch's images, alive until the synchronisation
        for colour, arrays in self._batches:
            streams = [nvimgcodec.CodeStream(array) for array in arrays]
            held = self._decoder.decode(streams, params=self._params[colour], cuda_stream=0)
            for index, image in enumerate(held):
                if image is None:
                    raise RuntimeError(
                        f"nvimgcodec on {workload.name}: frame {frames + index} did not decode"
                    )
                cai = image.__cuda_array_interface__
                nbytes += math.prod(cai["shape"]) * np.dtype(cai["typestr"]).itemsize
            frames += len(held)
        cupy.cuda.Device(self.device_id).synchronize()
        del held
        extra = {
            "batch": self.batch,
            "decode_calls": len(self._batches),
            "output": "device",
            "nvimgcodec": self._version,
        }
        return _check(self.name, workload, frames, nbytes) | extra

    def close(self) -> None:
        self._decoder, self._params, self._batches = None, {}, []


class NvPluginReader:
    """The peer: NVIDIA's pydicom plugin, one frame a call to the host, in pydicom's loop."""

    name = "nvimgcodec-plugin"

    def __init__(self) -> None:
        self._plugin: Any = None
        self._label = PLUGIN_LABEL

    def prepare(self, workload: Workload) -> None:
        from pydicom.pixels.decoders.base import get_decoder

        from ingest.dicom.codec_read import syntax_name

        if len(workload.files) != len(workload.objects):
            raise ValueError(f"{workload.name}: no local files to decode")
        plugin = importlib.import_module(PLUGIN_MODULE)
        self._label = str(getattr(plugin, "NVIMGCODEC_PLUGIN_LABEL", PLUGIN_LABEL))
        if not plugin.register():
            raise RuntimeError(f"{PLUGIN_MODULE}.register() failed")
        self._plugin = plugin
        if self._label not in get_decoder(workload.syntax).available_plugins:
            raise ReaderSkipped(
                f"NVIDIA's pydicom plugin has no decoder for {syntax_name(workload.syntax)}",
                "no plugin",
            )

    def run(self, workload: Workload) -> dict[str, Any]:
        return pydicom_loop(self.name, workload, self._label) | {"decoding_plugin": self._label}

    def close(self) -> None:
        if self._plugin is not None:
            self._plugin.unregister()  # pydicom's other readers get their own plugins back
        self._plugin = None
