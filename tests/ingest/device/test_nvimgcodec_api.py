"""nvImageCodec's C API binding (``ingest_gpu.nvimgcodec_api``) on the CPU.

The device decoder reaches ``libnvimgcodec.so.0`` through ``ctypes`` structures
copied from ``nvimgcodec.h``. nvImageCodec's CPU decoders (libjpeg-turbo, and its
JPEG 2000 parser) go through the same structures, so without a GPU these tests
check that the binding parses codestreams, describes output images and decodes into
memory it does not own exactly as the codestream holds: baseline JPEG grey and
YCbCr (converted to RGB, as pydicom converts YBR_FULL_422) against Pillow, which
decodes with the same libjpeg-turbo. Where a C compiler is present, the
structures' sizes and field offsets are compared with the wheel's header itself.
"""

from __future__ import annotations

import ctypes
import io
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image as PILImage

from ingest_gpu import nvimgcodec_api as api
from ingest_gpu.decode import nvimgcodec_unavailable_reason

pytestmark = pytest.mark.skipif(
    nvimgcodec_unavailable_reason() is not None, reason="nvImageCodec is not installed"
)
CPU_ONLY = -99999  # NVIMGCODEC_DEVICE_CPU_ONLY


def _jpeg(pixels: np.ndarray, subsampling: int = 0) -> bytes:
    out = io.BytesIO()
    PILImage.fromarray(pixels).save(out, "JPEG", quality=90, subsampling=subsampling)
    return out.getvalue()


def _stream(lib: api.Library, data: bytes) -> api.CodeStream:
    address = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
    return api.CodeStream(lib, data, address, len(data))


def _smooth(rows: int, columns: int, channels: int) -> np.ndarray:
    y, x = np.mgrid[0:rows, 0:columns]
    planes = [(x * (3 + c) + y * (5 - c)) % 256 for c in range(channels)]
    return np.stack(planes, axis=-1).astype(np.uint8).squeeze()


def test_the_installed_library_is_the_version_the_structures_copy() -> None:
    lib = api.library()
    assert tuple(int(v) for v in lib.version.split(".")[:2]) == api.SUPPORTED


def test_a_codestream_declares_what_its_header_says() -> None:
    lib = api.library()
    grey = _stream(lib, _jpeg(_smooth(40, 72, 1)))
    assert (grey.declared.height, grey.declared.width, grey.declared.channels) == (40, 72, 1)
    assert grey.declared.typestr == "|u1"
    assert grey.declared.color_spec == api.COLORSPEC_GRAY
    colour = _stream(lib, _jpeg(_smooth(48, 64, 3), subsampling=1))  # 4:2:2
    assert (colour.declared.height, colour.declared.width, colour.declared.channels) == (48, 64, 3)
    assert colour.declared.chroma_subsampling == 2  # NVIMGCODEC_SAMPLING_422


def test_bytes_that_are_no_codestream_are_refused() -> None:
    with pytest.raises(api.NvImageCodecError, match="nvimgcodecStatus_t"):
        _stream(api.library(), b"\x00" * 64)


@pytest.mark.parametrize(
    ("channels", "subsampling", "conversion"),
    [(1, 0, "unchanged"), (3, 0, "rgb"), (3, 1, "rgb"), (3, 2, "rgb")],
)
def test_a_batch_decodes_into_memory_it_does_not_own(
    channels: int, subsampling: int, conversion: api.Conversion
) -> None:
    lib = api.library()
    decoder = api.Decoder(CPU_ONLY, backends=(api.CPU_ONLY,))
    sources = [_smooth(32 + 8 * k, 48, channels) for k in range(3)]
    encoded = [_jpeg(s, subsampling) for s in sources]
    streams = [_stream(lib, e) for e in encoded]
    outputs = [
        np.full((s.shape[0], 48, 3 if conversion == "rgb" else 1), 7, np.uint8) for s in sources
    ]
    images = [
        api.Image(lib, out.ctypes.data, stream.declared, conversion, 0, host=True)
        for out, stream in zip(outputs, streams, strict=True)
    ]
    assert decoder.decode(streams, images) == [True, True, True]
    for out, data in zip(outputs, encoded, strict=True):
        expected = np.asarray(
            PILImage.open(io.BytesIO(data)).convert("RGB" if conversion == "rgb" else "L")
        )
        np.testing.assert_array_equal(out.reshape(expected.shape), expected)
    decoder.close()


def test_a_frame_that_fails_fails_alone() -> None:
    lib = api.library()
    decoder = api.Decoder(CPU_ONLY)
    good = _jpeg(_smooth(32, 32, 1))
    cut = good[: good.index(b"\xff\xda") + 20]  # the header and the start of its scan
    streams = [_stream(lib, good), _stream(lib, cut), _stream(lib, good)]
    outputs = [np.zeros((32, 32, 1), np.uint8) for _ in streams]
    images = [
        api.Image(lib, o.ctypes.data, s.declared, "unchanged", 0, host=True)
        for o, s in zip(outputs, streams, strict=True)
    ]
    done = decoder.decode(streams, images)
    assert done == [True, False, True]
    np.testing.assert_array_equal(outputs[2][..., 0], np.asarray(PILImage.open(io.BytesIO(good))))


def test_output_images_follow_the_python_module() -> None:
    """``ColorSpec.UNCHANGED`` keeps grey and RGB as they are, interleaved; others
    decode to sRGB or grey by their channels; ``SRGB`` is always three channels."""

    def declared(color_spec: int, sample_format: int, channels: int) -> api.Declared:
        return api.Declared(8, 8, channels, 0x0802, 8, color_spec, 3, sample_format)

    assert api.output_info(declared(api.COLORSPEC_GRAY, 3, 1), "unchanged") == (
        api.I_Y,
        api.COLORSPEC_GRAY,
        api.SAMPLING_GRAY,
        1,
    )
    assert api.output_info(declared(api.COLORSPEC_SRGB, 7, 3), "unchanged") == (
        api.I_RGB,
        api.COLORSPEC_SRGB,
        api.SAMPLING_NONE,
        3,
    )
    assert api.output_info(declared(3, 11, 3), "unchanged") == (  # sYCC
        api.I_UNCHANGED,
        api.COLORSPEC_SRGB,
        api.SAMPLING_NONE,
        3,
    )
    assert api.output_info(declared(3, 11, 3), "rgb") == (
        api.I_RGB,
        api.COLORSPEC_SRGB,
        api.SAMPLING_NONE,
        3,
    )


STRUCTS = {
    "Properties": "nvimgcodecProperties_t",
    "InstanceCreateInfo": "nvimgcodecInstanceCreateInfo_t",
    "ExecutionParams": "nvimgcodecExecutionParams_t",
    "Orientation": "nvimgcodecOrientation_t",
    "ImagePlaneInfo": "nvimgcodecImagePlaneInfo_t",
    "ImageInfo": "nvimgcodecImageInfo_t",
    "DecodeParams": "nvimgcodecDecodeParams_t",
    "BackendParams": "nvimgcodecBackendParams_t",
    "Backend": "nvimgcodecBackend_t",
}
ENUMS = {
    "_PROPERTIES": "NVIMGCODEC_STRUCTURE_TYPE_PROPERTIES",
    "_INSTANCE_CREATE_INFO": "NVIMGCODEC_STRUCTURE_TYPE_INSTANCE_CREATE_INFO",
    "_DECODE_PARAMS": "NVIMGCODEC_STRUCTURE_TYPE_DECODE_PARAMS",
    "_ORIENTATION": "NVIMGCODEC_STRUCTURE_TYPE_ORIENTATION",
    "_IMAGE_INFO": "NVIMGCODEC_STRUCTURE_TYPE_IMAGE_INFO",
    "_IMAGE_PLANE_INFO": "NVIMGCODEC_STRUCTURE_TYPE_IMAGE_PLANE_INFO",
    "_EXECUTION_PARAMS": "NVIMGCODEC_STRUCTURE_TYPE_EXECUTION_PARAMS",
    "_BACKEND": "NVIMGCODEC_STRUCTURE_TYPE_BACKEND",
    "_BACKEND_PARAMS": "NVIMGCODEC_STRUCTURE_TYPE_BACKEND_PARAMS",
    "CPU_ONLY": "NVIMGCODEC_BACKEND_KIND_CPU_ONLY",
    "HW_GPU_ONLY": "NVIMGCODEC_BACKEND_KIND_HW_GPU_ONLY",
    "I_UNCHANGED": "NVIMGCODEC_SAMPLEFORMAT_I_UNCHANGED",
    "I_Y": "NVIMGCODEC_SAMPLEFORMAT_I_Y",
    "I_YA": "NVIMGCODEC_SAMPLEFORMAT_I_YA",
    "I_RGB": "NVIMGCODEC_SAMPLEFORMAT_I_RGB",
    "I_BGR": "NVIMGCODEC_SAMPLEFORMAT_I_BGR",
    "I_YUV": "NVIMGCODEC_SAMPLEFORMAT_I_YUV",
    "I_RGBA": "NVIMGCODEC_SAMPLEFORMAT_I_RGBA",
    "SAMPLING_GRAY": "NVIMGCODEC_SAMPLING_GRAY",
}


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to read the header")
def test_the_structures_match_the_wheels_header(tmp_path: Path) -> None:
    """Every declared structure's size and field offsets, and the enum values used,
    as the C compiler lays them out from the installed wheel's ``nvimgcodec.h``."""
    include = Path(api.library_path()).parent / "include"
    if not (include / "nvimgcodec.h").exists():
        pytest.skip("this nvImageCodec wheel ships no header")
    lines = [
        "#include <stdio.h>",
        "#include <stddef.h>",
        "#include <nvimgcodec.h>",
        "int main(void) {",
    ]
    expected: list[int] = []
    for ours, theirs in STRUCTS.items():
        structure = getattr(api, ours)
        lines.append(f'printf("%zu\\n", sizeof({theirs}));')
        expected.append(ctypes.sizeof(structure))
        for name, *_ in [*api._Header._fields_, *structure._fields_]:
            lines.append(f'printf("%zu\\n", offsetof({theirs}, {name}));')
            expected.append(getattr(structure, name).offset)
    for ours, theirs in ENUMS.items():
        lines.append(f'printf("%d\\n", (int){theirs});')
        expected.append(getattr(api, ours))
    lines.append("return 0; }")
    source = tmp_path / "layout.c"
    source.write_text("\n".join(lines))
    # the one CUDA type the header uses, without CUDA's headers
    (tmp_path / "cuda_runtime_api.h").write_text("typedef struct CUstream_st* cudaStream_t;\n")
    binary = tmp_path / "layout"
    compiled = subprocess.run(
        ["cc", f"-I{tmp_path}", f"-I{include}", str(source), "-o", str(binary)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert compiled.returncode == 0, compiled.stderr
    printed = subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout
    assert [int(v) for v in printed.split()] == expected
