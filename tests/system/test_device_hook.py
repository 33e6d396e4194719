"""A user hook gets every output chunk on the device thread; with no sink nothing is written."""

from __future__ import annotations

import io
import uuid

import numpy as np
import pytest
from botocore.utils import calculate_tree_hash

from ingest.embedded.samples import synthetic_ct_series, synthetic_multiframe
from ingest.embedded.stack import Stack
from ingest_gpu.thread import cuda_unavailable_reason
from tests import harness, hook_probe
from tests.reference import reference_array

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("aws_environment"),
]
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(cuda_unavailable_reason() is not None, reason="no CUDA"),
        ],
    ),
]


async def _published(stack: Stack, objects: dict[str, bytes]) -> harness.Names:
    """Fresh buckets and topics, ``objects`` uploaded and a notification for each published."""
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    await harness.upload(stack, names.source_bucket, objects.items())
    await harness.publish(
        stack,
        names.source_topic,
        [harness.aws_notification(names.source_bucket, [k]) for k in objects],
    )
    return names


@pytest.mark.parametrize("source_hash", ["crc64nvme", "sha256", "sha256-tree", "none"])
@pytest.mark.parametrize("device", DEVICES)
async def test_hook_sees_every_chunk_and_no_sink_writes_nothing(
    stack: Stack, device: str, source_hash: str
) -> None:
    objects = dict(synthetic_ct_series(2, rows=64, columns=64))
    objects["big/mf.dcm"] = synthetic_multiframe(9, 96, 128)  # several 64 KiB chunks
    objects["big/mf2.dcm"] = synthetic_multiframe(24, 192, 128)  # 1.2 MB: two tree leaves
    # Encapsulated Uncompressed: chunks of frames a fragment each, item headers between
    objects["slide/mf.dcm"] = synthetic_multiframe(9, 96, 128, encapsulated="extended")
    names = await _published(stack, objects)
    hook_probe.CHUNKS.clear()
    settings = harness.make_settings(
        stack,
        names,
        device=device,
        sink="none",
        hook="tests.hook_probe:collect",
        source_hash=source_hash,
    )
    run = await harness.run_worker(settings, stop_after=len(objects))
    assert all(o.processed for o in run.outcomes)
    assert {"dicom-ingest-device"} == hook_probe.THREADS
    for key, data in objects.items():
        chunks = sorted(
            (c for c in hook_probe.CHUNKS if c[0].key == key), key=lambda c: c[0].first_element
        )
        assert chunks, key
        assert {c[0].backend for c in chunks} == {device}
        values = np.concatenate([host for _, host in chunks])
        expected = reference_array(data, None, "float32")
        assert chunks[0][0].shape == expected.shape
        assert values.tobytes() == expected.ravel().tobytes(), key
    results = await harness.read_json_topic(stack, names.results_topic)
    assert len(results) == len(objects)
    assert all(r["output"] is None for r in results)
    for r in results:  # the source digest asked for is exact; the other is absent
        data = objects[r["source"]["key"]]
        sha256 = harness.sha256(data) if source_hash == "sha256" else None
        tree = calculate_tree_hash(io.BytesIO(data)) if source_hash == "sha256-tree" else None
        crc = harness.crc64nvme(data) if source_hash == "crc64nvme" else None
        got = (r["source"]["sha256"], r["source"]["sha256_tree"], r["source"]["crc64nvme"])
        assert got == (sha256, tree, crc)
    async with harness.s3_client(stack) as s3:
        listing = await s3.list_objects_v2(Bucket=names.output_bucket)
    assert listing.get("KeyCount", 0) == 0  # nothing left the device


@pytest.mark.gpu
@pytest.mark.skipif(cuda_unavailable_reason() is not None, reason="no CUDA")
async def test_a_hook_takes_the_chunks_into_pytorch_without_a_copy(stack: Stack) -> None:
    """``torch.from_dlpack`` on the hook's array shares its memory, and a tensor the hook
    keeps still holds its chunk's values after the worker has gone on and stopped."""
    torch = pytest.importorskip("torch")
    objects = dict(synthetic_ct_series(3, rows=64, columns=64))
    objects["big/mf.dcm"] = synthetic_multiframe(9, 96, 128)  # several chunks
    names = await _published(stack, objects)
    hook_probe.TENSORS.clear()
    settings = harness.make_settings(
        stack, names, device="cuda", sink="none", hook="tests.hook_probe:into_torch"
    )
    run = await harness.run_worker(settings, stop_after=len(objects))
    assert all(o.processed for o in run.outcomes)
    assert len({c[0].key for c in hook_probe.TENSORS}) == len(objects)
    assert all(shared for _, _, shared in hook_probe.TENSORS)
    for key, data in objects.items():
        chunks = sorted(
            (c for c in hook_probe.TENSORS if c[0].key == key), key=lambda c: c[0].first_element
        )
        assert all(t.is_cuda and t.dtype == torch.float32 for _, t, _ in chunks)
        assert len(chunks) > 1 or not key.startswith("big/"), key  # later chunks came after
        values = torch.cat([t for _, t, _ in chunks]).cpu().numpy()
        expected = reference_array(data, None, "float32")
        assert values.tobytes() == expected.ravel().tobytes(), key
    hook_probe.TENSORS.clear()
