"""The worker end to end on the GPU: same objects, same servers, outputs bit-identical.

Runs on the device machine (``pytest -m gpu``); skipped where CUDA is absent.
The CPU run of the same corpus is checked against the same reference in
``tests/ingest/test_worker.py``, so equality here means the GPU path equals its NumPy twin.
"""

from __future__ import annotations

import uuid
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
from pydicom import dcmread

from ingest.dicom.device_codecs import MIN_DEVICE_J2K_FRAMES
from ingest.dicom.syntaxes import SYNTAXES
from ingest.embedded.samples import EXAMPLES_DECODED, example_bytes
from ingest.embedded.samples_compressed import ct_volume
from ingest.embedded.samples_slide import write_jpeg_slide
from ingest.embedded.stack import Stack
from ingest_gpu.decode import nvimgcodec_unavailable_reason
from ingest_gpu.thread import cuda_unavailable_reason
from tests import harness
from tests.paths import DATA
from tests.reference import psnr, reference_array

reason = cuda_unavailable_reason()
pytestmark = [
    pytest.mark.anyio,
    pytest.mark.integration,
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(reason is not None, reason=f"no CUDA: {reason}"),
    pytest.mark.usefixtures("aws_environment"),
]
VOLUMES = DATA / "volume"


def _is_lossy(data: bytes) -> bool:
    """The object's transfer syntax allows lossy compression: another decoder may differ."""
    meta = dcmread(BytesIO(data), stop_before_pixels=True, force=True).file_meta
    syntax = SYNTAXES.get(str(meta.get("TransferSyntaxUID", "")))
    return syntax is not None and not syntax.lossless


@pytest.mark.parametrize(
    ("window", "dtype", "part"),
    [
        (None, "float32", 64 * 1024),
        ((40.0, 400.0), "float16", 64 * 1024),
        (None, "float32", 8 << 20),
    ],
    ids=["plain-64k", "window-f16-64k", "plain-8m"],
)
async def test_gpu_outputs_equal_the_reference(
    stack: Stack, window: tuple[float, float] | None, dtype: str, part: int
) -> None:
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    objects = harness.corpus()
    await harness.upload(stack, names.source_bucket, objects.items())
    await harness.publish(
        stack,
        names.source_topic,
        [harness.aws_notification(names.source_bucket, [k]) for k in objects],
    )
    settings = harness.make_settings(
        stack,
        names,
        device="cuda",
        part_size=str(part),
        output_dtype=dtype,
        window=f"{window[0]},{window[1]}" if window else "none",
    )
    run = await harness.run_worker(settings, stop_after=len(objects))
    assert all(o.processed is not None for o in run.outcomes), [
        (o.ref.key if o.ref else None, o.error) for o in run.outcomes if o.error
    ]
    for key, data in objects.items():
        out = harness.load_npy(
            await harness.get_object(
                stack, names.output_bucket, f"out/{names.source_bucket}/{key}.npy"
            )
        )
        expected = reference_array(data, window, dtype)
        assert out.dtype == np.dtype(dtype), key
        assert out.tobytes() == expected.tobytes(), key
    results = await harness.read_json_topic(stack, names.results_topic)
    assert {r["backend"] for r in results} == {"cuda"}


@pytest.mark.parametrize(
    ("part", "gpu_decode"),
    [(64 * 1024, "auto"), (8 << 20, "auto"), (8 << 20, "off")],
    ids=["ranges-64k", "one-get-8m", "one-get-8m-cpu-decode"],
)
async def test_gpu_decoded_objects_equal_the_reference(
    stack: Stack, tmp_path: Path, part: int, gpu_decode: str
) -> None:
    """Objects decoded before the device (compressed, big endian, palette, YBR, 1-bit)
    and a JPEG-tiled slide. Decoded on the CPU, the outputs are bit-identical to the
    reference; with the device decoding what it can (nvImageCodec), lossless syntaxes
    are still bit-identical and lossy ones within the lossy bound (40 dB)."""
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    objects = {f"pydicom/{n}": example_bytes(n) for n in EXAMPLES_DECODED}
    write_jpeg_slide(tmp_path / "slide.dcm", tiles_across=9, tiles_down=7)  # 3 groups
    objects["slide/jpeg.dcm"] = (tmp_path / "slide.dcm").read_bytes()
    for name in ("ct-jpeg2000-lossless-256", "ct-htj2k-lossless-256"):  # J2K: from 32 frames
        slice_ = (VOLUMES / f"{name}.dcm").read_bytes()  # the device lacks HTJ2K's encoder
        objects[f"volume/{name}.dcm"] = ct_volume([slice_], MIN_DEVICE_J2K_FRAMES + 2)
    await harness.upload(stack, names.source_bucket, objects.items())
    await harness.publish(
        stack,
        names.source_topic,
        [harness.aws_notification(names.source_bucket, [k]) for k in objects],
    )
    settings = harness.make_settings(
        stack, names, device="cuda", part_size=str(part), ring_slots="8", gpu_decode=gpu_decode
    )
    run = await harness.run_worker(settings, stop_after=len(objects))
    assert all(o.processed is not None for o in run.outcomes), [
        (o.ref.key if o.ref else None, o.error) for o in run.outcomes if o.error
    ]
    on_device = gpu_decode == "auto" and nvimgcodec_unavailable_reason() is None
    assert run.ring is not None
    assert run.ring.in_use == 0  # frames' slots all given back
    assert run.device is not None
    assert (run.device.get("device_decoded_frames", 0) > 0) == on_device
    if on_device:  # the slide's 63 tiles and both volumes: JPEG 2000 too, in a volume
        assert run.device["device_decoded_frames"] >= 63 + 2 * (MIN_DEVICE_J2K_FRAMES + 2)
    for key, data in objects.items():
        out = harness.load_npy(
            await harness.get_object(
                stack, names.output_bucket, f"out/{names.source_bucket}/{key}.npy"
            )
        )
        want = reference_array(data, None, "float32")
        if on_device and _is_lossy(data):
            assert out.shape == want.shape, key
            assert psnr(out, want) >= 40.0, key
        else:
            assert out.tobytes() == want.tobytes(), key
    results = await harness.read_json_topic(stack, names.results_topic)
    assert {r["backend"] for r in results} == {"cuda"}
