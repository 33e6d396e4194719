"""nvImageCodec's C API (``nvimgcodec.h`` of 0.9) through ``ctypes``: the calls the decoder makes.

The device decoder talks to ``libnvimgcodec.so.0`` directly rather than through
nvImageCodec's Python module for the GIL. The module's ``Decoder.decode`` runs with
the GIL released but takes it back once or more for every sample of a batch (to
build the sample's Python result); each time another Python thread holds it (the
event loop, a reader thread), getting it back waits up to the switch interval. In
the worker, where such threads are always busy, a batch of 256 x 256 tiles decoded
at a fifteenth of its rate alone
(``python3 -m ingest.bench.diagnostics.decode_backends --gil-busy 2``).

Here, as in ``ingest_gpu.driver``, two handles on the same library: ``Library.hold``
(``ctypes.PyDLL``) keeps the GIL for the calls that return at once (a codestream's
header parsed, an image made, a result read, a handle destroyed: microseconds), and
``Library.free`` (``ctypes.CDLL``) releases it for the calls that take long (the
batch's decode and the wait for it; making the instance and a decoder). A batch then
gives the GIL away twice, whatever its size.

The structures below are the header's, field for field, for the version
``SUPPORTED`` names; the library reports its version (``nvimgcodecGetProperties``)
and any other is refused at load (``NvImageCodecError``), so a layout that changed
never reaches a call. Only what the decoder needs is declared.

Output images follow the Python module's ``Decoder.decode`` (``python/decoder.cpp``
in nvImageCodec's published source), so that the values equal what its callers got:
interleaved samples, the codestream's sample type (``allow_any_depth``), and the
colour conversion of ``ColorSpec.SRGB`` or ``ColorSpec.UNCHANGED`` (``output_info``).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import threading
from typing import Any, Final, Literal, NamedTuple

SUPPORTED: Final = (0, 9)  # major, minor: the header these structures copy
MAX_CODEC_NAME_SIZE: Final = 256
MAX_NUM_PLANES: Final = 32

# nvimgcodecStructureType_t
_PROPERTIES, _INSTANCE_CREATE_INFO, _DECODE_PARAMS, _ORIENTATION = 1, 2, 5, 7
_IMAGE_INFO, _IMAGE_PLANE_INFO, _BACKEND, _BACKEND_PARAMS, _EXECUTION_PARAMS = 11, 12, 17, 29, 30
# nvimgcodecBackendKind_t
CPU_ONLY, GPU_ONLY, HYBRID_CPU_GPU, HW_GPU_ONLY = 1, 2, 3, 4
_SUCCESS: Final = 0  # nvimgcodecStatus_t
PROCESSING_SUCCESS: Final = 1  # nvimgcodecProcessingStatus_t
_DEVICE_STRIDED: Final = 1  # nvimgcodecImageBufferKind_t
_HOST_STRIDED: Final = 2

# nvimgcodecColorSpec_t
COLORSPEC_UNCHANGED, COLORSPEC_SRGB, COLORSPEC_GRAY = 0, 1, 2
# nvimgcodecChromaSubsampling_t
SAMPLING_NONE, SAMPLING_GRAY = 0, 7
# nvimgcodecSampleFormat_t
I_UNCHANGED, I_Y, I_YA, I_RGB, I_BGR, I_YUV, I_RGBA = 2, 4, 6, 8, 10, 12, 14
# a codestream's sample format (planar or interleaved) -> the interleaved output's,
# and whether the output is grey (the chroma subsampling the module then sets)
_INTERLEAVED: Final = {
    3: (I_Y, True),
    4: (I_Y, True),
    5: (I_YA, True),
    6: (I_YA, True),
    7: (I_RGB, False),
    8: (I_RGB, False),
    9: (I_BGR, False),
    10: (I_BGR, False),
    11: (I_YUV, None),
    12: (I_YUV, None),
    13: (I_RGBA, False),
    14: (I_RGBA, False),
}
# nvimgcodecSampleDataType_t -> numpy typestr
TYPESTRS: Final = {
    0x0801: "|i1",
    0x0802: "|u1",
    0x1003: "<i2",
    0x1004: "<u2",
    0x2005: "<i4",
    0x2006: "<u4",
    0x1009: "<f2",
    0x200B: "<f4",
    0x400D: "<f8",
}

_p, _size, _int, _u32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint32


class NvImageCodecError(Exception):
    """nvImageCodec's library is missing, of another version, or a call failed."""


class _Header(ctypes.Structure):
    """The three fields every nvImageCodec structure starts with."""

    _fields_ = [("struct_type", _int), ("struct_size", _size), ("struct_next", _p)]

    def __init__(self, struct_type: int, **fields: Any) -> None:
        super().__init__(struct_type, ctypes.sizeof(self), None, **fields)


class Properties(_Header):
    _fields_ = [("version", _u32), ("cudart_version", _u32)]


class InstanceCreateInfo(_Header):
    _fields_ = [
        ("load_builtin_modules", _int),
        ("load_extension_modules", _int),
        ("extension_modules_path", ctypes.c_char_p),
        ("create_debug_messenger", _int),
        ("debug_messenger_desc", _p),
        ("message_severity", _u32),
        ("message_category", _u32),
    ]


class ExecutionParams(_Header):
    _fields_ = [
        ("device_allocator", _p),
        ("pinned_allocator", _p),
        ("max_num_cpu_threads", _int),
        ("executor", _p),
        ("device_id", _int),
        ("pre_init", _int),
        ("skip_pre_sync", _int),
        ("num_backends", _int),
        ("backends", _p),
    ]


class BackendParams(_Header):
    _fields_ = [("load_hint", ctypes.c_float), ("load_hint_policy", _int)]


class Backend(_Header):
    _fields_ = [("kind", _int), ("params", BackendParams)]


class Orientation(_Header):
    _fields_ = [("rotated", _int), ("flip_x", _int), ("flip_y", _int)]


class ImagePlaneInfo(_Header):
    _fields_ = [
        ("width", _u32),
        ("height", _u32),
        ("row_stride", _size),
        ("num_channels", _u32),
        ("sample_type", _int),
        ("precision", ctypes.c_uint8),
    ]


class ImageInfo(_Header):
    _fields_ = [
        ("codec_name", ctypes.c_char * MAX_CODEC_NAME_SIZE),
        ("color_spec", _int),
        ("chroma_subsampling", _int),
        ("sample_format", _int),
        ("orientation", Orientation),
        ("num_planes", _u32),
        ("plane_info", ImagePlaneInfo * MAX_NUM_PLANES),
        ("buffer", _p),
        ("buffer_kind", _int),
        ("cuda_stream", _p),
    ]


class DecodeParams(_Header):
    _fields_ = [("apply_exif_orientation", _int)]


class Declared(NamedTuple):
    """What a codestream's header declares, as the output image is made from it (a
    tuple: made for every frame, and a key of the kept output images)."""

    height: int
    width: int
    channels: int  # the codestream's: max(planes, channels of plane 0)
    sample_type: int  # nvimgcodecSampleDataType_t
    precision: int
    color_spec: int
    chroma_subsampling: int
    sample_format: int

    @property
    def typestr(self) -> str | None:
        """The numpy typestr of a sample, None for a type numpy has not."""
        return TYPESTRS.get(self.sample_type)


Conversion = Literal["unchanged", "rgb"]


def output_info(declared: Declared, conversion: Conversion) -> tuple[int, int, int, int]:
    """The output image's ``(sample_format, color_spec, chroma_subsampling, channels)``
    for a codestream: what nvImageCodec's Python ``Decoder.decode`` sets for
    ``ColorSpec.SRGB`` (``rgb``) and ``ColorSpec.UNCHANGED``, interleaved."""
    if conversion == "rgb":
        return I_RGB, COLORSPEC_SRGB, SAMPLING_NONE, 3
    channels = declared.channels
    if declared.color_spec in (COLORSPEC_GRAY, COLORSPEC_SRGB):
        fmt, grey = _INTERLEAVED.get(declared.sample_format, (I_UNCHANGED, None))
        chroma = (
            declared.chroma_subsampling
            if grey is None
            else (SAMPLING_GRAY if grey else SAMPLING_NONE)
        )
        return fmt, declared.color_spec, chroma, channels
    grey = channels == 1
    return (
        I_UNCHANGED,
        COLORSPEC_GRAY if grey else COLORSPEC_SRGB,
        SAMPLING_GRAY if grey else SAMPLING_NONE,
        channels,
    )


def _check(status: int, call: str) -> None:
    if status != _SUCCESS:
        raise NvImageCodecError(f"{call} failed with nvimgcodecStatus_t {status}")


class Library:
    """``libnvimgcodec.so.0`` of the installed wheel, its two handles and one instance."""

    def __init__(self) -> None:
        path = library_path()
        hold, free = ctypes.PyDLL(path), ctypes.CDLL(path)
        for lib in (hold, free):
            lib.nvimgcodecGetProperties.argtypes = [ctypes.POINTER(Properties)]
            lib.nvimgcodecInstanceCreate.argtypes = [_p, ctypes.POINTER(InstanceCreateInfo)]
            lib.nvimgcodecDecoderCreate.argtypes = [
                _p,
                _p,
                ctypes.POINTER(ExecutionParams),
                ctypes.c_char_p,
            ]
            lib.nvimgcodecDecoderDestroy.argtypes = [_p]
            lib.nvimgcodecCodeStreamCreateFromHostMem.argtypes = [_p, _p, _p, _size, _p]
            lib.nvimgcodecCodeStreamGetImageInfo.argtypes = [_p, ctypes.POINTER(ImageInfo)]
            lib.nvimgcodecCodeStreamDestroy.argtypes = [_p]
            lib.nvimgcodecImageCreate.argtypes = [_p, _p, ctypes.POINTER(ImageInfo)]
            lib.nvimgcodecImageDestroy.argtypes = [_p]
            lib.nvimgcodecDecoderDecode.argtypes = [
                _p,
                _p,
                _p,
                _int,
                ctypes.POINTER(DecodeParams),
                _p,
            ]
            lib.nvimgcodecFutureWaitForAll.argtypes = [_p]
            lib.nvimgcodecFutureGetProcessingStatus.argtypes = [_p, _p, ctypes.POINTER(_size)]
            lib.nvimgcodecFutureDestroy.argtypes = [_p]
        self.hold, self.free = hold, free
        properties = Properties(_PROPERTIES)
        _check(hold.nvimgcodecGetProperties(ctypes.byref(properties)), "nvimgcodecGetProperties")
        major, minor = properties.version // 1000, properties.version % 1000 // 100
        if (major, minor) != SUPPORTED:
            raise NvImageCodecError(
                f"nvImageCodec {major}.{minor} is installed; this build speaks to"
                f" {SUPPORTED[0]}.{SUPPORTED[1]} (pip install 'nvidia-nvimgcodec-cu13~="
                f"{SUPPORTED[0]}.{SUPPORTED[1]}.0')"
            )
        self.version = f"{major}.{minor}.{properties.version % 100}"
        info = InstanceCreateInfo(
            _INSTANCE_CREATE_INFO, load_builtin_modules=1, load_extension_modules=1
        )
        instance = _p()
        _check(
            free.nvimgcodecInstanceCreate(ctypes.byref(instance), ctypes.byref(info)),
            "nvimgcodecInstanceCreate",
        )
        self.instance = instance  # one a process, kept for its life as the Python module does


_lock = threading.Lock()
_scratch = threading.local()  # a thread's ImageInfo that codestreams' headers are read into


@functools.cache
def library_path() -> str:
    """Where the installed wheel's ``libnvimgcodec.so.0`` is (nothing is loaded).

    Raises:
        NvImageCodecError: nvImageCodec is not installed, or its library is missing.
    """
    try:
        spec = importlib.util.find_spec("nvidia.nvimgcodec")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise NvImageCodecError("nvImageCodec (nvidia-nvimgcodec-cu13) is not installed")
    path = os.path.join(next(iter(spec.submodule_search_locations)), "libnvimgcodec.so.0")
    if not os.path.exists(path):
        raise NvImageCodecError(f"nvImageCodec's library is missing ({path})")
    return path


_loaded: Library | NvImageCodecError | None = None


def library() -> Library:
    """The process's library and instance, made at the first call.

    Raises:
        NvImageCodecError: not installed, another version, or the instance failed
            (the same error on every later call).
    """
    global _loaded
    with _lock:
        if _loaded is None:
            try:
                _loaded = Library()
            except (OSError, NvImageCodecError) as exc:
                error = exc if isinstance(exc, NvImageCodecError) else None
                _loaded = error or NvImageCodecError(f"nvImageCodec cannot be loaded ({exc})")
        if isinstance(_loaded, NvImageCodecError):
            raise _loaded
        return _loaded


class CodeStream:
    """A codestream over bytes it does not copy (``data`` is kept while it lives), and
    what its header declares.

    Raises (constructor):
        NvImageCodecError: the bytes are no codestream nvImageCodec can parse.
    """

    __slots__ = ("_destroy", "data", "declared", "handle")

    def __init__(self, lib: Library, data: Any, address: int, length: int) -> None:
        self.data = data
        handle = _p()
        status = lib.hold.nvimgcodecCodeStreamCreateFromHostMem(
            lib.instance, ctypes.byref(handle), address, length, None
        )
        _check(status, "nvimgcodecCodeStreamCreateFromHostMem")
        self.handle: int = handle.value or 0
        self._destroy = lib.hold.nvimgcodecCodeStreamDestroy
        info = _scratch.__dict__.get("info")
        if info is None:
            info = _scratch.info = ImageInfo(_IMAGE_INFO)
        _check(
            lib.hold.nvimgcodecCodeStreamGetImageInfo(self.handle, ctypes.byref(info)),
            "nvimgcodecCodeStreamGetImageInfo",
        )
        plane = info.plane_info[0]
        self.declared = Declared(
            plane.height,
            plane.width,
            max(info.num_planes, plane.num_channels),
            plane.sample_type,
            plane.precision,
            info.color_spec,
            info.chroma_subsampling,
            info.sample_format,
        )

    def __del__(self) -> None:
        if self.handle:
            self._destroy(self.handle)
            self.handle = 0


class Image:
    """An output image over memory it does not own: ``rows x columns`` interleaved
    samples at ``address`` (device memory, or host memory with ``host``), the
    conversion ``output_info`` gives for ``declared``, ordered on ``stream``.

    Raises (constructor):
        NvImageCodecError: nvImageCodec refused the description.
    """

    __slots__ = ("_destroy", "handle")

    def __init__(
        self,
        lib: Library,
        address: int,
        declared: Declared,
        conversion: Conversion,
        stream: int,
        host: bool = False,
    ) -> None:
        sample_format, color_spec, chroma, channels = output_info(declared, conversion)
        itemsize = declared.sample_type >> 11  # the type's bits over 8, in its high byte
        info = ImageInfo(
            _IMAGE_INFO,
            color_spec=color_spec,
            chroma_subsampling=chroma,
            sample_format=sample_format,
            orientation=Orientation(_ORIENTATION),
            num_planes=1,
            buffer=address,
            buffer_kind=_HOST_STRIDED if host else _DEVICE_STRIDED,
            cuda_stream=stream or None,
        )
        info.plane_info[0] = ImagePlaneInfo(
            _IMAGE_PLANE_INFO,
            width=declared.width,
            height=declared.height,
            row_stride=declared.width * channels * itemsize,
            num_channels=channels,
            sample_type=declared.sample_type,
            precision=declared.precision,
        )
        handle = _p()
        _check(
            lib.hold.nvimgcodecImageCreate(lib.instance, ctypes.byref(handle), ctypes.byref(info)),
            "nvimgcodecImageCreate",
        )
        self.handle: int = handle.value or 0
        self._destroy = lib.hold.nvimgcodecImageDestroy

    def __del__(self) -> None:
        if self.handle:
            self._destroy(self.handle)
            self.handle = 0


class Pending:
    """A decode call under way: ``wait`` for whether each of its frames decoded."""

    def __init__(self, lib: Library, future: Any, n: int) -> None:
        self._lib, self._future, self._n = lib, future, n

    def wait(self) -> list[bool]:
        """Whether each frame decoded, once the call's work is complete in each image's
        stream order; the codestreams' bytes may then be reused. Call it once.

        Raises:
            NvImageCodecError: the call as a whole failed.
        """
        future, n, lib = self._future, self._n, self._lib
        if future is None:
            return []
        self._future = None
        try:
            _check(lib.free.nvimgcodecFutureWaitForAll(future), "nvimgcodecFutureWaitForAll")
            statuses = (_u32 * n)()
            size = _size()
            _check(
                lib.hold.nvimgcodecFutureGetProcessingStatus(future, statuses, ctypes.byref(size)),
                "nvimgcodecFutureGetProcessingStatus",
            )
        finally:
            lib.hold.nvimgcodecFutureDestroy(future)
        return [s == PROCESSING_SUCCESS for s in statuses]


class Decoder:
    """An nvImageCodec decoder for one device, with ``options`` as the module's
    ``Decoder(options=...)``: the ``backends`` kinds named (load hint 1 each, in that
    order), or every backend where none is (the module's default).

    Raises (constructor):
        NvImageCodecError: the library, or the decoder, could not be made.
    """

    def __init__(
        self,
        device_id: int,
        options: str = "",
        cpu_threads: int = 0,
        backends: tuple[int, ...] = (),
    ) -> None:
        self._lib = lib = library()
        self._backends = (Backend * max(1, len(backends)))(
            *[
                Backend(
                    _BACKEND,
                    kind=kind,
                    params=BackendParams(_BACKEND_PARAMS, load_hint=1.0, load_hint_policy=2),
                )
                for kind in backends
            ]
        )
        params = ExecutionParams(
            _EXECUTION_PARAMS,
            device_id=device_id,
            max_num_cpu_threads=cpu_threads,
            num_backends=len(backends),
            backends=ctypes.addressof(self._backends) if backends else None,
        )
        handle = _p()
        _check(
            lib.free.nvimgcodecDecoderCreate(
                lib.instance, ctypes.byref(handle), ctypes.byref(params), options.encode()
            ),
            "nvimgcodecDecoderCreate",
        )
        self._handle: int = handle.value or 0
        self._params = DecodeParams(_DECODE_PARAMS, apply_exif_orientation=0)

    def decode(self, streams: list[CodeStream], images: list[Image]) -> list[bool]:
        """Decode ``streams[k]`` into ``images[k]``; whether each succeeded. The output
        is complete in each image's stream order when this returns (nvImageCodec waits
        for its own work), and the codestreams' bytes may be reused.

        Raises:
            NvImageCodecError: the call as a whole failed.
        """
        return self.start(streams, images).wait()

    def start(self, streams: list[CodeStream], images: list[Image]) -> Pending:
        """Start decoding ``streams[k]`` into ``images[k]``; ``wait`` on the result says
        whether each succeeded. Until then the codestreams and images must live and
        their memory must not be reused.

        Raises:
            NvImageCodecError: the call as a whole failed.
        """
        n = len(streams)
        lib = self._lib
        if not n:
            return Pending(lib, None, 0)
        handles = (_p * n)(*[s.handle for s in streams])
        outputs = (_p * n)(*[i.handle for i in images])
        future = _p()
        _check(
            lib.free.nvimgcodecDecoderDecode(
                self._handle, handles, outputs, n, ctypes.byref(self._params), ctypes.byref(future)
            ),
            "nvimgcodecDecoderDecode",
        )
        return Pending(lib, future, n)

    def close(self) -> None:
        """Destroy the decoder (waits for nothing: no decode may be running)."""
        if self._handle:
            self._lib.free.nvimgcodecDecoderDestroy(self._handle)
            self._handle = 0

    def __del__(self) -> None:
        self.close()
