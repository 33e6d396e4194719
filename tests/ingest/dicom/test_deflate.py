"""Deflated Explicit VR Little Endian: inflated a bounded step at a time, through the real worker.

The inflater (``ingest.dicom.deflate.Inflater``) never returns more than it is
asked for, nor keeps more than a piece of its input, whatever the stream
inflates to; its errors name the syntax. The header of an inflated data set is
read by the same parser as any other (``inflated_header``), bounded as any other.

Through the worker against the real broker and S3 server: pydicom's
``image_dfl.dcm``, pydicom's samples written back Deflated by pydicom (palette,
1-bit, YBR, RGB, padded, implicit VR turned explicit ...), a multi-frame object
of three decoding groups read in 64 KiB ranges through a ring of four slots, and
one whose trailing padding inflates to 256 MiB: each equal to pydicom's
``pixel_array`` then the Modality LUT, its sidecar saying ``inflate`` and the
digest of its stored bytes. The corpus of bad Deflated objects
(``bad_inputs.deflated_cases``: cut, corrupt, trailed by garbage, bombs) is
dead-lettered naming the syntax, with peak RSS within the ring and a fixed margin.
"""

from __future__ import annotations

import re
import tracemalloc
import uuid
import warnings
import zlib
from io import BytesIO

import numpy as np
import pytest
from pydicom import dcmread, dcmwrite
from pydicom.uid import DeflatedExplicitVRLittleEndian

from ingest.dicom.codec import conversions, decode_native
from ingest.dicom.deflate import (
    INPUT_PIECE,
    MAX_TRAILING,
    META,
    Inflater,
    inflated_header,
)
from ingest.dicom.header import DicomHeader, NeedMoreBytes
from ingest.dicom.parse import parse_header
from ingest.embedded import samples
from ingest.embedded.stack import Stack
from ingest.errors import DeflatedDataSet, LimitExceeded, MalformedDicom, UnsupportedDicom
from tests import bad_inputs, harness
from tests.bad_inputs import DEFLATED, MIB, deflate_file, zeros
from tests.harness import RSS_HEADROOM, PeakRss
from tests.reference import reference_array

pytestmark = pytest.mark.usefixtures("aws_environment")

NAMED = re.escape(DEFLATED)
PYDICOM_SAMPLES = (
    "CT_small.dcm",  # 16-bit signed, rescale
    "MR_small_padded.dcm",  # Pixel Data longer than needed, trailing padding
    "MR_small_implicit.dcm",  # implicit VR, written explicit
    "rtdose.dcm",  # 15 frames, 32-bit
    "examples_palette.dcm",  # PALETTE COLOR
    "liver_1frame.dcm",  # Bits Allocated 1
    "SC_rgb_small_odd.dcm",  # 3 x 3 RGB, a pad byte
    "SC_ybr_full_422_uncompressed.dcm",  # YBR_FULL_422
    "examples_rgb_color.dcm",
    "examples_overlay.dcm",  # 12 of 16 bits stored
)


def written_deflated(data: bytes) -> bytes:
    """``data`` written back by pydicom as Deflated Explicit VR Little Endian."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = dcmread(BytesIO(data))
        ds.file_meta.TransferSyntaxUID = DeflatedExplicitVRLittleEndian
        out = BytesIO()
        dcmwrite(out, ds, enforce_file_format=True)
    return out.getvalue()


def raw_deflate(data: bytes | bytearray) -> bytes:
    deflater = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    return deflater.compress(data) + deflater.flush()


def inflate_all(stream: bytes, max_length: int) -> bytes:
    inflater = Inflater()
    inflater.give(stream)
    out = bytearray()
    while piece := inflater.inflate(max_length):
        assert len(piece) <= max_length
        out += piece
    inflater.finish()
    return bytes(out)


# -- the inflater ------------------------------------------------------------------------


@pytest.mark.parametrize("max_length", [1, 4096, MIB])
def test_inflater_never_returns_more_than_asked(max_length: int) -> None:
    data = np.random.default_rng(5).bytes(300_000) + bytes(2 * MIB)
    assert inflate_all(raw_deflate(data), max_length) == data


def test_a_bomb_is_inflated_in_bounded_memory() -> None:
    """64 MiB of zeros from ~65 KB: each step at most its bound, nothing else kept."""
    deflater = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    stream = b"".join(deflater.compress(piece) for piece in zeros(64 * MIB)) + deflater.flush()
    assert len(stream) < 70_000
    inflater = Inflater()
    tracemalloc.start()
    try:
        inflater.give(stream)
        total = 0
        while piece := inflater.inflate(MIB):
            assert len(piece) <= MIB
            total += len(piece)
            del piece
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    inflater.finish()
    assert total == inflater.inflated == 64 * MIB
    assert peak < 3 * MIB, f"{peak} bytes traced"


def test_input_is_taken_in_pieces() -> None:
    """A large buffer given at once is handed to zlib a piece at a time: what zlib keeps
    of a step's unread input is a piece, not the rest of the buffer (a copy each step)."""
    data = np.random.default_rng(6).bytes(8 * MIB)  # incompressible: input ~ output
    stream = raw_deflate(data)
    inflater = Inflater()
    inflater.give(memoryview(stream))
    tracemalloc.start()
    try:
        for _ in range(200):
            assert 0 < len(inflater.inflate(1024)) <= 1024
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * INPUT_PIECE + 64 * 1024, f"{peak} bytes traced"


def test_inflater_refuses_corrupt_truncated_and_trailed_streams() -> None:
    stream = raw_deflate(np.random.default_rng(7).bytes(100_000) + bytes(50_000))
    corrupt = bytes([stream[0] | 0b110]) + stream[1:]  # BTYPE 11 is reserved
    with pytest.raises(MalformedDicom, match=f"{NAMED}.*deflate stream is corrupt"):
        inflate_all(corrupt, MIB)
    with pytest.raises(MalformedDicom, match=f"{NAMED}.*truncated"):
        inflate_all(stream[: len(stream) // 2], MIB)
    with pytest.raises(MalformedDicom, match=f"{NAMED}.*follow the end"):
        inflate_all(stream + bytes(MAX_TRAILING + 1), MIB)
    inflater = Inflater()  # garbage given after the end, in a later buffer
    inflater.give(stream)
    while inflater.inflate(MIB):
        pass
    with pytest.raises(MalformedDicom, match="follow the end"):
        inflater.give(b"x" * (MAX_TRAILING + 1))
    # a pad byte, or a CRC-32 and length as in image_dfl.dcm, is ignored as pydicom does
    inflate_all(stream + b"\0", MIB)
    inflate_all(stream + bytes(MAX_TRAILING), MIB)


def test_inflater_use_errors() -> None:
    inflater = Inflater()
    inflater.give(raw_deflate(bytes(1000)))
    with pytest.raises(ValueError, match="positive"):
        inflater.inflate(0)
    with pytest.raises(RuntimeError, match="not inflated yet"):
        inflater.give(b"more")


# -- the header of an inflated data set ---------------------------------------------------


def test_the_parser_tells_a_deflated_object_apart() -> None:
    data = samples.example_bytes("image_dfl.dcm")
    with pytest.raises(DeflatedDataSet, match=NAMED) as told:
        parse_header(data, len(data))
    assert isinstance(told.value, UnsupportedDicom)  # a caller that does not inflate refuses it
    assert told.value.data_set_offset == bad_inputs.meta_end(data) == 334


def test_inflated_header_of_image_dfl_and_its_pixels() -> None:
    data = samples.example_bytes("image_dfl.dcm")
    inflated = inflate_all(data[334:], 4096)
    stored = len(data) - 334
    short = inflated_header(inflated[:100], False, stored, max_header_bytes=MIB)
    assert isinstance(short, NeedMoreBytes)
    assert short.at_least > 100
    header = inflated_header(inflated[:2000], False, stored, max_header_bytes=MIB)
    assert isinstance(header, DicomHeader)
    assert inflated_header(inflated, True, stored, max_header_bytes=MIB) == header
    assert header.transfer_syntax_uid == DEFLATED
    assert header.codec is not None
    assert conversions(header.codec) == ("inflate",)
    assert header.pixel.shape == (1, 512, 512)
    value = inflated[header.pixel_offset : header.pixel_offset + header.pixel_length]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = dcmread(BytesIO(data)).pixel_array
    assert np.array_equal(decode_native(header.codec, value, 0, 1)[0], expected)


def test_inflated_header_bounds() -> None:
    ct = samples.example_bytes("CT_small.dcm")
    data_set = ct[bad_inputs.meta_end(ct) :]
    at = bad_inputs.pixel_tag_at(ct) - bad_inputs.meta_end(ct)
    big = data_set[:at] + bad_inputs.private_ob(300_000) + data_set[at:]
    with pytest.raises(LimitExceeded, match=f"{NAMED}.*header larger than 262144"):
        inflated_header(big[:262_144], False, 10_000, max_header_bytes=262_144)
    # Pixel Data the stored stream could not inflate to: refused from the header
    with pytest.raises(MalformedDicom, match=f"{NAMED}.*inflates to .* at most"):
        inflated_header(data_set[:10_000], False, 20, max_header_bytes=MIB)
    meta_first = ct[144 : bad_inputs.meta_end(ct)] + data_set
    with pytest.raises(MalformedDicom, match="group 0002"):
        inflated_header(meta_first, True, 30_000, max_header_bytes=MIB)
    with pytest.raises(MalformedDicom, match=f"{NAMED}.*truncated"):
        inflated_header(data_set[: at + 2000], True, 30_000, max_header_bytes=MIB)
    assert META[128:132] == b"DICM"


# -- through the worker ---------------------------------------------------------------------


def good_objects() -> dict[str, bytes]:
    objects = {"pydicom/image_dfl.dcm": samples.example_bytes("image_dfl.dcm")}
    for name in PYDICOM_SAMPLES:
        objects[f"pydicom-deflated/{name}"] = written_deflated(samples.example_bytes(name))
    planar = samples.synthetic_rgb(3, 64, 80, planar=True)
    objects["synthetic/rgb-planar.dcm"] = written_deflated(planar)
    # three decoding groups of 1,024, 1,024 and 52 frames: 17 MB inflated (without plane
    # positions, whose 2,100 items would take the header past this test's 256 KiB)
    objects["synthetic/multiframe-2100.dcm"] = written_deflated(
        samples.synthetic_multiframe(2100, 64, 64, plane_positions=False)
    )
    ct = samples.example_bytes("CT_small.dcm")
    trailer = b"\xfc\xff\xfc\xffOB\0\0" + (256 * MIB).to_bytes(4, "little")
    objects["synthetic/padding-256-mib.dcm"] = deflate_file(
        ct, [ct[bad_inputs.meta_end(ct) :], trailer, *zeros(256 * MIB)]
    )
    objects |= {f"deflated/{name}.dcm": data for name, data in bad_inputs.deflated_goods()}
    return objects


@pytest.mark.integration
@pytest.mark.anyio
@pytest.mark.timeout(300)
# slow for one GET: the streamed inflation (ranges) is the path the other leaves out
@pytest.mark.parametrize(
    "part_size",
    [pytest.param(None, id="ranges"), pytest.param(32 * MIB, id="one-get", marks=pytest.mark.slow)],
)
async def test_deflated_objects_through_the_worker(stack: Stack, part_size: int | None) -> None:
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    good = good_objects()
    bad = {f"bad/{case.name}.dcm": case for case in bad_inputs.deflated_cases()}
    objects = good | {key: case.data for key, case in bad.items()}
    assert len(good["synthetic/multiframe-2100.dcm"]) > 4 * 64 * 1024  # more than the ring
    await harness.upload(stack, names.source_bucket, objects.items())
    messages = [harness.aws_notification(names.source_bucket, [key]) for key in objects]
    await harness.publish(stack, names.source_topic, messages)
    ring = {"ring_slots": "4"} | ({"part_size": str(part_size)} if part_size else {})
    settings = harness.make_settings(
        stack, names, max_header_bytes=str(bad_inputs.MAX_HEADER_BYTES), **ring
    )

    with PeakRss() as rss:
        run = await harness.run_worker(settings, stop_after=len(objects))

    ring_bytes = settings.ring_slots * settings.slot_size
    print(f"\npeak RSS growth: {rss.growth / MIB:.1f} MiB (ring {ring_bytes / MIB:.1f} MiB)")
    assert rss.growth < ring_bytes + RSS_HEADROOM
    outcomes = {o.ref.key: o for o in run.outcomes if o.ref is not None}
    assert sorted(outcomes) == sorted(objects)
    errors = {key: f"{type(o.error).__name__}: {o.error}" for key, o in outcomes.items() if o.error}
    assert sorted(errors) == sorted(bad), errors
    for key, case in bad.items():
        error = outcomes[key].error
        assert isinstance(error, case.error), (key, errors[key])
        if case.syntax is not None:
            assert DEFLATED in str(error), (key, errors[key])
    for key, data in good.items():
        base = f"out/{names.source_bucket}/{key}"
        out = harness.load_npy(await harness.get_object(stack, names.output_bucket, f"{base}.npy"))
        expected = reference_array(data, None, "float32")
        assert out.shape == expected.shape, key
        assert out.tobytes() == expected.tobytes(), key
        sidecar = harness.load_json(
            await harness.get_object(stack, names.output_bucket, f"{base}.json")
        )
        assert sidecar["transfer_syntax_uid"] == DEFLATED, key
        assert sidecar["conversions"][0] == "inflate", key
        assert sidecar["source"]["crc64nvme"] == harness.crc64nvme(data), key
        assert sidecar["source"]["size"] == len(data), key
