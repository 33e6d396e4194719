"""Frames decoded on the device (nvImageCodec, ``ingest_gpu.decode``) against the CPU path.

Runs on the device machine (``pytest -m gpu``); skipped without CUDA or
nvImageCodec. Every compressed file that ships with pydicom and that nvImageCodec
decodes as pydicom does (``matching_colour``: what the worker sends to the
device, and JPEG 2000, which it keeps on the CPU for speed), this project's JPEG
samples and slide tiles, and its CT slices in every compressed syntax
(``tests/data/compressed``: written by ``compressed_ct(uid, index=3, rows=128,
columns=96)``, which needs encoders the device machine lacks) go to the device
thread in one batch (frames of many objects in one nvImageCodec call): each
output equals the CPU path's (``decode_encapsulated``, then the NumPy twin of the
kernel) exactly for lossless syntaxes and within 40 dB PSNR for lossy ones. A
frame the device cannot decode fails its job alone. Both orders of nvImageCodec's JPEG
decoders (the hardware one first, the CUDA one first) give the same results.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from io import BytesIO
from pathlib import Path

import numpy as np
import pydicom.data
import pytest
from pydicom import dcmread
from pydicom.encaps import generate_frames

from ingest.dicom.codec import Codec, codec_from_dataset, decode_encapsulated, decoded_format
from ingest.dicom.device_codecs import MATCHING_SYNTAXES, device_format, matching_colour
from ingest.dicom.syntaxes import LOSSLESS
from ingest.embedded.samples_compressed import jpeg_baseline
from ingest.embedded.samples_slide import jpeg_slide_bytes
from ingest_gpu.decode import (
    DeviceDecodeError,
    EncodedFrames,
    JpegDecoder,
    nvimgcodec_unavailable_reason,
    parse,
)
from ingest_gpu.formats import Transform
from ingest_gpu.preprocess import preprocess_numpy
from ingest_gpu.thread import ChunkJob, ChunkResult, DeviceThread, cuda_unavailable_reason
from tests.paths import DATA
from tests.reference import psnr

reason = cuda_unavailable_reason() or nvimgcodec_unavailable_reason()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(reason is not None, reason=f"no device decode: {reason}"),
]
TRANSFORM = Transform(rescale=False)
# sample files whose codestreams nvImageCodec refuses: the worker decodes them on the CPU
DEVICE_REFUSED = {"pydicom/JPEG2000-embedded-sequence-delimiter.dcm"}  # its width reads as negative


def _objects() -> dict[str, bytes]:
    folder = Path(pydicom.data.__file__).parent / "test_files"
    found = {f"pydicom/{p.name}": p.read_bytes() for p in sorted(folder.glob("*.dcm"))}
    data = DATA / "compressed"
    found |= {f"data/{p.name}": p.read_bytes() for p in sorted(data.glob("*.dcm"))}
    found["samples/jpeg-mono"] = jpeg_baseline("MONOCHROME2")
    found["samples/jpeg-ybr"] = jpeg_baseline("YBR_FULL_422")
    found["samples/jpeg-slide"] = jpeg_slide_bytes(tiles_across=5, tiles_down=4)
    return found


def _cases() -> list[tuple[str, Codec, list[bytes]]]:
    cases = []
    for name, data in _objects().items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                ds = dcmread(BytesIO(data))
                codec = codec_from_dataset(ds, str(ds.file_meta.TransferSyntaxUID))
            except Exception:
                continue  # not an image pydicom decodes: the CPU tests cover those
            if matching_colour(codec) is None:
                continue
            frames = list(generate_frames(ds.PixelData, number_of_frames=codec.number_of_frames))
        cases.append((name, codec, frames))
    return cases


CASES = _cases()


def _job(codec: Codec, frames: Sequence[bytes | memoryview]) -> ChunkJob:
    colour = matching_colour(codec)
    assert colour is not None
    return ChunkJob(
        data=memoryview(b""),
        fmt=device_format(codec),
        transform=TRANSFORM,
        first_element=0,
        on_consumed=lambda: None,
        encoded=EncodedFrames(tuple(frames), colour),
    )


def _cpu(codec: Codec, frames: list[bytes]) -> np.ndarray:
    decoded = decode_encapsulated(codec, frames)
    fmt = decoded_format(codec)
    raw = np.ascontiguousarray(decoded).reshape(-1).view(np.uint8)
    return preprocess_numpy(raw, fmt, TRANSFORM, 0)


def _run(
    jobs: list[ChunkJob], jpeg: JpegDecoder = "hardware"
) -> tuple[list[ChunkResult | BaseException], dict[str, int | float]]:
    with DeviceThread("cuda", jpeg=jpeg) as thread:
        outcomes = thread.submit(jobs).result(timeout=120)
        again = thread.submit(jobs).result(timeout=120)  # steady state: nothing allocated
        stats = thread.stats()
    assert [type(o) for o in again] == [type(o) for o in outcomes]
    return outcomes, stats


def test_the_sample_files_cover_every_device_syntax() -> None:
    syntaxes = {codec.transfer_syntax_uid for _, codec, _ in CASES}
    assert syntaxes == MATCHING_SYNTAXES


@pytest.mark.parametrize("jpeg", ["hardware", "cuda"])  # the JPEG decoder tried first
def test_device_decode_equals_the_cpu_path_in_one_batch(jpeg: JpegDecoder) -> None:
    jobs = [_job(codec, frames) for _, codec, frames in CASES]
    outcomes, stats = _run(jobs, jpeg)
    refused = {}
    for (name, codec, frames), outcome in zip(CASES, outcomes, strict=True):
        if isinstance(outcome, DeviceDecodeError):
            refused[name] = str(outcome)
            continue
        assert isinstance(outcome, ChunkResult), (name, outcome)
        assert outcome.host is not None
        want = _cpu(codec, frames)
        if codec.transfer_syntax_uid not in LOSSLESS:
            assert psnr(outcome.host, want) >= 40.0, name
        else:
            assert outcome.host.tobytes() == want.tobytes(), name
    assert refused.keys() == DEVICE_REFUSED, refused
    total = sum(len(f) for name, _, f in CASES if name not in refused)
    assert stats["device_decoded_frames"] == 2 * total
    assert stats["device_decode_calls"] <= 4  # a batch: one call, and one for the frames refused
    assert stats["bytes_h2d"] == 0  # the decoded values never left the device


def test_a_frame_the_device_cannot_decode_fails_its_job_alone() -> None:
    name, codec, frames = next(c for c in CASES if c[0] == "samples/jpeg-slide")
    broken = [frames[0][:40] + bytes(len(frames[0]) - 40), *frames[1:]]
    lying = [frames[0][:2] + b"\xff\xd8" * 8]
    jobs = [_job(codec, frames), _job(codec, broken), _job(codec, lying), _job(codec, frames)]
    outcomes, _ = _run(jobs)
    assert isinstance(outcomes[0], ChunkResult), outcomes[0]
    assert isinstance(outcomes[3], ChunkResult), outcomes[3]
    assert isinstance(outcomes[1], DeviceDecodeError)
    assert isinstance(outcomes[2], DeviceDecodeError)
    assert outcomes[0].host is not None
    assert outcomes[3].host is not None
    assert outcomes[0].host.tobytes() == outcomes[3].host.tobytes(), name


def test_the_device_allocates_nothing_in_steady_state() -> None:
    jobs = [_job(codec, frames) for _, codec, frames in CASES]
    with DeviceThread("cuda") as thread:
        thread.submit(jobs).result(timeout=120)
        before = thread.stats()["device_allocations"]
        for _ in range(3):
            thread.submit(jobs).result(timeout=120)
        assert thread.stats()["device_allocations"] == before


def test_groups_of_one_object_are_placed_by_their_first_sample() -> None:
    """A multi-frame object goes to the device in groups; each group's job starts at its
    first frame's sample, and the groups' outputs joined are the whole object's."""
    _, codec, frames = next(c for c in CASES if c[0] == "samples/jpeg-slide")
    whole = _job(codec, frames)
    cut = len(frames) // 3
    fmt = whole.fmt
    parts = [
        _job(codec, frames[:cut]),
        dataclasses.replace(_job(codec, frames[cut:]), first_element=cut * fmt.frame_elements),
    ]
    outcomes, _ = _run([whole, *parts])
    assert all(isinstance(o, ChunkResult) and o.host is not None for o in outcomes), outcomes
    hosts = [o.host for o in outcomes if isinstance(o, ChunkResult) and o.host is not None]
    assert np.concatenate(hosts[1:]).tobytes() == hosts[0].tobytes()


def test_frames_parsed_off_the_device_thread_and_views_decode_the_same() -> None:
    """The pipeline parses a group's codestreams on its own thread (``parse``) and hands
    frames that are views of the ring slot they were read into: the same outputs; a
    frame that declares another image is refused by ``parse`` itself."""
    _, codec, frames = next(c for c in CASES if c[0] == "samples/jpeg-slide")
    slot = bytearray(b"".join(frames))
    views, at = [], 0
    for frame in frames:
        views.append(memoryview(slot)[at : at + len(frame)])
        at += len(frame)
    plain = _job(codec, frames)
    viewed = _job(codec, views)
    assert viewed.encoded is not None
    parsed = dataclasses.replace(viewed, encoded=parse(viewed.encoded, viewed.fmt))
    outcomes, stats = _run([plain, parsed])
    hosts = [o.host for o in outcomes if isinstance(o, ChunkResult) and o.host is not None]
    assert len(hosts) == 2, outcomes
    assert hosts[0].tobytes() == hosts[1].tobytes()
    assert stats["device_decode_failures"] == 0
    lying = EncodedFrames((frames[0],), "rgb")
    small = dataclasses.replace(plain.fmt, rows=plain.fmt.rows // 2)
    with pytest.raises(DeviceDecodeError, match="declares"):
        parse(lying, small)
