"""The real worker against the real broker (Tansu) and S3 server (SeaweedFS).

Every uploaded DICOM object must come out as an array equal to pydicom's
``pixel_array`` through the modality LUT (and the window when set), with its
sidecar, its result event and a decryptable audit record; bad objects and bad
notifications end in the dead-letter topic while the worker keeps going; and a
restarted worker neither redoes committed work nor skips uncommitted work.
"""

from __future__ import annotations

import io
import json
import uuid

import anyio
import numpy as np
import pytest
from botocore.utils import calculate_tree_hash

from ingest.audit.verify import object_records, verify_trail
from ingest.dicom.parse import DicomHeader, parse_header
from ingest.embedded.samples import (
    not_dicom,
    synthetic_ct_series,
    synthetic_multiframe,
)
from ingest.embedded.samples_slide import jpeg_slide_bytes
from ingest.embedded.stack import Stack
from ingest.worker import Worker
from tests import harness
from tests.reference import reference_array

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.usefixtures("aws_environment"),
]


# "small-slots": the notifications tell the sizes, and with 2 MiB parts in 2 slots every
# object fits a 1 MiB small slot, at most 4 at once (backpressure: 32 objects in flight).
# "window" is slow: the window and float16 are the preprocessing's, tested in tests/gpu/.
@pytest.mark.parametrize(
    ("window", "dtype", "ring"),
    [
        pytest.param(None, "float32", {}, id="plain"),
        pytest.param((40.0, 400.0), "float16", {}, id="window", marks=pytest.mark.slow),
        pytest.param(
            None,
            "float32",
            {"part_size": str(2 * 1024 * 1024), "ring_slots": "2"},
            id="small-slots",
        ),
    ],
)
async def test_outputs_sidecars_results_audit_and_dead_letters(
    stack: Stack, window: tuple[float, float] | None, dtype: str, ring: dict[str, str]
) -> None:
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    objects = harness.corpus()
    bad_key, bad_body = not_dicom()
    await harness.upload(stack, names.source_bucket, [*objects.items(), (bad_key, bad_body)])
    sizes = {k: len(v) for k, v in objects.items()} if ring else {}
    messages = [harness.aws_notification(names.source_bucket, [k], sizes) for k in objects]
    messages.insert(2, b'{"Records": [{"eventName": 42}]}')  # malformed, mid-stream
    messages.append(harness.aws_notification(names.source_bucket, [bad_key]))
    await harness.publish(stack, names.source_topic, messages)
    overrides = {
        "output_dtype": dtype,
        "window": f"{window[0]},{window[1]}" if window else "none",
        **ring,
    }
    settings = harness.make_settings(stack, names, **overrides)

    run = await harness.run_worker(settings, stop_after=len(objects) + 2)

    processed = {o.ref.key: o.processed for o in run.outcomes if o.ref and o.processed}
    assert sorted(processed) == sorted(objects)
    assert run.ring is not None
    assert (run.ring.small_acquired >= len(objects)) == bool(ring)  # 64 KiB slots: none
    results = harness.by_key(await harness.read_json_topic(stack, names.results_topic))
    assert sorted(results) == sorted(objects)
    for key, data in objects.items():
        expected = reference_array(data, window, dtype)
        out = harness.load_npy(
            await harness.get_object(
                stack, names.output_bucket, f"out/{names.source_bucket}/{key}.npy"
            )
        )
        assert out.dtype == np.dtype(dtype), key
        assert out.shape == expected.shape, key
        assert out.tobytes() == expected.tobytes(), key  # bit-identical, NaN-safe
        sidecar = harness.load_json(
            await harness.get_object(
                stack, names.output_bucket, f"out/{names.source_bucket}/{key}.json"
            )
        )
        assert sidecar == results[key]
        source = sidecar["source"]
        assert (source["bucket"], source["key"], source["size"]) == (
            names.source_bucket,
            key,
            len(data),
        )
        assert source["crc64nvme"] == harness.crc64nvme(data)  # the default digest
        assert source["sha256"] is None
        assert sidecar["shape"] == list(expected.shape)
        assert sidecar["dtype"] == dtype
        assert sidecar["window"] == (list(window) if window else None)
        assert sidecar["backend"] == "cpu"
        assert sidecar["sop_instance_uid"]

    dlq = await harness.read_json_topic(stack, names.dlq_topic)
    assert sorted((d["key"] or "", d["reason"]) for d in dlq) == [
        ("", "bad_notification"),
        (bad_key, "not_dicom"),
    ]
    malformed = next(d for d in dlq if d["key"] is None)
    assert malformed["record"]["value"] == '{"Records": [{"eventName": 42}]}'
    assert malformed["attempts"] == 1

    trail = verify_trail(
        await harness.read_topic_raw(stack, names.audit_topic),
        keys={settings.audit_key_id: harness.AUDIT_KEY},
        trust_on_first_use=True,  # each trail's own key: the tests set no site key
    )
    audit = object_records(trail.records)
    assert len(audit) == len(objects) + 2
    assert trail.ok, trail.findings
    audited = {r["key"]: r for r in audit if r["outcome"] == "success"}
    assert sorted(audited) == sorted(objects)
    for key, record in audited.items():
        assert record["sop_instance_uid"] == results[key]["sop_instance_uid"]
        assert record["etag"] == results[key]["source"]["etag"]


async def test_tree_hash_of_every_object_whatever_order_its_ranges_arrive(stack: Stack) -> None:
    """``source_hash=sha256-tree``: the sidecar's ``sha256_tree`` is botocore's tree hash of
    the object (its ranges hashed as they were read, at 64 KiB parts), and ``sha256`` null;
    the arrays are unchanged."""
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    objects = harness.corpus()
    padding = b"\xfc\xff\xfc\xffOB\x00\x00" + (300_000).to_bytes(4, "little") + bytes(300_000)
    objects["trailer/mf.dcm"] = synthetic_multiframe(6, 96, 128) + padding  # read for the hash
    trailed = synthetic_multiframe(6, 96, 128, encapsulated="basic") + padding
    objects["trailer/encapsulated.dcm"] = trailed  # after the Sequence Delimiter
    objects["leaves/mf.dcm"] = synthetic_multiframe(40, 192, 128)  # 2 MB: two leaves and a bit
    await harness.upload(stack, names.source_bucket, objects.items())
    await harness.publish(
        stack,
        names.source_topic,
        [harness.aws_notification(names.source_bucket, [k]) for k in objects],
    )
    settings = harness.make_settings(stack, names, source_hash="sha256-tree")

    run = await harness.run_worker(settings, stop_after=len(objects))

    assert all(o.processed for o in run.outcomes)
    results = harness.by_key(await harness.read_json_topic(stack, names.results_topic))
    assert sorted(results) == sorted(objects)
    for key, data in objects.items():
        source = results[key]["source"]
        assert source["sha256"] is None, key
        assert source["sha256_tree"] == calculate_tree_hash(io.BytesIO(data)), key
        out = harness.load_npy(
            await harness.get_object(
                stack, names.output_bucket, f"out/{names.source_bucket}/{key}.npy"
            )
        )
        assert out.tobytes() == reference_array(data, None, "float32").tobytes(), key


@pytest.mark.parametrize("graceful", [True, False], ids=["sigterm-like", "crash-like"])
async def test_restart_neither_redoes_committed_nor_skips_uncommitted(
    stack: Stack, graceful: bool
) -> None:
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    slices = synthetic_ct_series(12, rows=64, columns=64)
    await harness.upload(stack, names.source_bucket, slices)
    keys = [key for key, _ in slices]  # offset i announces keys[i]
    await harness.publish(
        stack,
        names.source_topic,
        [harness.aws_notification(names.source_bucket, [k]) for k in keys],
    )
    settings = harness.make_settings(stack, names, max_objects_in_flight="2")

    first = await harness.run_worker(settings, stop_after=5, graceful=graceful)
    committed = await harness.settled_committed_offset(stack, names.group, names.source_topic)
    first_keys = set(harness.keys_of(first.outcomes))
    assert set(keys[:committed]) <= first_keys  # committed means processed
    if graceful:
        assert committed >= 5  # everything finished before the stop was committed

    second = await harness.run_worker(settings, stop_after=len(keys) - committed)
    second_keys = harness.keys_of(second.outcomes)
    assert sorted(second_keys) == sorted(keys[committed:])  # nothing committed redone, none skipped
    assert await harness.committed_offset(stack, names.group, names.source_topic) == len(keys)
    results = await harness.read_json_topic(stack, names.results_topic)
    assert {r["source"]["key"] for r in results} == set(keys)


async def test_a_device_that_cannot_be_set_up_fails_the_start_with_its_own_error(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device is set up on its thread while the clients start; its error, not the
    "device setup failed" of the ring's allocation queued behind it, ends the start."""

    def broken() -> None:
        raise OSError("no device here")

    monkeypatch.setattr("ingest_gpu.thread.CpuRunner", broken)
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    with anyio.fail_after(60), pytest.raises(OSError, match="no device here"):
        await Worker(harness.make_settings(stack, names, device="cpu")).run()


async def test_a_ranged_object_s_per_frame_values_are_read_while_it_is_read(
    stack: Stack,
) -> None:
    """A native object read in ranges, whose per-frame functional groups are parsed while
    its first ranges arrive and its frames' plane positions while its chunks go through:
    its values rescaled per frame, and its record's geometry that of the header read in
    full."""
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    data, key = synthetic_multiframe(16, 96, 96), "enhanced/ranged.dcm"
    await harness.upload(stack, names.source_bucket, [(key, data)])
    notification = harness.aws_notification(names.source_bucket, [key])
    await harness.publish(stack, names.source_topic, [notification])
    settings = harness.make_settings(stack, names, part_size=str(64 * 1024), ring_slots="8")

    run = await harness.run_worker(settings, stop_after=1)

    assert [o.error for o in run.outcomes] == [None]
    out = harness.load_npy(
        await harness.get_object(stack, names.output_bucket, f"out/{names.source_bucket}/{key}.npy")
    )
    assert out.tobytes() == reference_array(data, None, "float32").tobytes()
    full = parse_header(data, len(data))
    assert isinstance(full, DicomHeader)
    assert full.geometry is not None
    result = harness.by_key(await harness.read_json_topic(stack, names.results_topic))[key]
    assert result["geometry"] == json.loads(json.dumps(full.geometry.as_json()))
    assert len(result["geometry"]["frame_positions"]) == 16


async def test_exact_output_types_and_geometry_in_sidecars(stack: Stack) -> None:
    """``OUTPUT_DTYPE=exact``: each array in the narrowest type that holds pydicom's values
    exactly, whichever read path it took (one GET, ranged chunks, per-frame rescale values
    read while the chunks arrive, decoded JPEG tiles); each sidecar names that type and
    carries the object's geometry, a slide its matrix."""
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    corpus = harness.corpus()
    chosen = ("pydicom/", "ct/", "rgb/planar", "slide/tiles", "signed/")  # each read path
    objects = {k: v for k, v in corpus.items() if k.startswith(chosen)}
    objects["slide/jpeg.dcm"] = jpeg_slide_bytes(tiles_across=3, tiles_down=2, tile=32)
    objects["enhanced/large.dcm"] = synthetic_multiframe(16, 96, 96)  # per-frame, ranged
    await harness.upload(stack, names.source_bucket, objects.items())
    await harness.publish(
        stack,
        names.source_topic,
        [harness.aws_notification(names.source_bucket, [k]) for k in objects],
    )
    settings = harness.make_settings(stack, names, output_dtype="exact")

    run = await harness.run_worker(settings, stop_after=len(objects))

    assert all(o.processed for o in run.outcomes)
    results = harness.by_key(await harness.read_json_topic(stack, names.results_topic))
    expected_types = {
        "ct/ct-series/slice-0001.dcm": "int16",  # slope 1, intercept -1024
        "pydicom/examples_rgb_color.dcm": "uint8",
        "slide/jpeg.dcm": "uint8",
        "rgb/planar.dcm": "uint8",
        "pydicom/rtdose.dcm": "uint32",
        "enhanced/large.dcm": "float32",  # slopes 0.5 .. 1.25
    }
    for key, data in objects.items():
        out = harness.load_npy(
            await harness.get_object(
                stack, names.output_bucket, f"out/{names.source_bucket}/{key}.npy"
            )
        )
        values = reference_array(data, None, "float64")
        assert out.shape == values.shape, key
        assert np.array_equal(out.astype(np.float64), values), key  # exact, not rounded
        assert out.tobytes() == reference_array(data, None, str(out.dtype)).tobytes(), key
        assert results[key]["dtype"] == str(out.dtype), key
        if key in expected_types:
            assert str(out.dtype) == expected_types[key], key
        assert out.dtype.itemsize <= 4 or key.startswith("pydicom/"), key
        assert results[key]["geometry"] is not None, key
    ct = results["ct/ct-series/slice-0002.dcm"]["geometry"]
    assert ct["frame_of_reference_uid"]
    assert ct["affine"][2][3] == -1.25  # the second slice's position
    assert ct["missing"] == ["SpacingBetweenSlices"]
    enhanced = results["enhanced/large.dcm"]["geometry"]
    assert len(enhanced["frame_positions"]) == 16
    assert enhanced["slice_step_from"] == "frame positions"
    slide = results["slide/jpeg.dcm"]["slide"]
    assert slide["dimension_organization"] == "TILED_FULL"  # its order places the tiles
    assert (slide["tiles_across"], slide["tiles_down"]) == (3, 2)
    assert slide["frame_columns"] is None
    assert slide["pixel_spacing"] == [0.00025, 0.00025]
