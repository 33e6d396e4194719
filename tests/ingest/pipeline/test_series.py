"""ingest/pipeline/series.py: series volumes written by the real worker on the real stack.

Each volume must equal its slices' arrays (pydicom's values, as every output is)
stacked in their order along the slice normal, whatever order the slices came
in, with two series interleaved, a slice missing then arriving late, a worker
process SIGKILLed mid-series (slices written or held), a PET series completed by
its Number of Slices, and a series whose quiet period a stopped worker never saw
out (its pending marker is picked up at the next start).
"""

from __future__ import annotations

import io
import json
import random
import signal
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import highdicom
import nibabel
import numpy as np
import pydicom
import pytest

from ingest.dicom.parse import DicomHeader, parse_header
from ingest.embedded.samples import synthetic_ct_series, synthetic_pet_series
from ingest.embedded.stack import Stack
from ingest.errors import SinkError
from ingest.pipeline.series import HELD_RECORD_LINGER_S
from ingest.settings import Settings
from ingest.sink.output import OutputSink
from ingest.worker import Outcome, Worker
from tests import harness, hook_probe
from tests.chaos import WorkerProcess, no_orphans, worker_environment
from tests.reference import reference_array

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("aws_environment"),
]


def series_prefix(data: bytes) -> str:
    header = parse_header(data, len(data))
    assert isinstance(header, DicomHeader)
    assert header.geometry is not None
    ids = (
        header.study_instance_uid,
        header.series_instance_uid,
        header.geometry.frame_of_reference_uid,
    )
    return "out/series/" + "/".join(str(v) for v in ids) + "/"


def expected_volume(slices: Sequence[tuple[str, bytes]]) -> np.ndarray:
    """The slices' reference arrays, stacked by their position along the normal (z here)."""
    ordered = sorted(
        slices, key=lambda s: float(pydicom.dcmread(io.BytesIO(s[1])).ImagePositionPatient[2])
    )
    return np.concatenate([reference_array(data, None, "float32") for _, data in ordered])


def pending_key(prefix: str) -> str:
    """The pending marker of the series whose volumes are under ``prefix``."""
    return "out/series-pending/" + prefix.removeprefix("out/series/")[:-1] + ".json"


async def get_json(stack: Stack, bucket: str, key: str) -> dict[str, Any] | None:
    try:
        return harness.load_json(await harness.get_object(stack, bucket, key))
    except Exception:
        return None


async def run_until(
    settings: Settings,
    outcomes: int,
    stack: Stack,
    bucket: str,
    latest: Sequence[str],
    slices: int | None = None,
) -> list[Outcome]:
    """Run a worker until ``outcomes`` objects are done and each series' ``latest`` sidecar
    exists (of ``slices`` slices, when given)."""
    seen: list[Outcome] = []
    worker = Worker(settings, seen.append)

    async def written() -> bool:
        for key in latest:
            document = await get_json(stack, bucket, key)
            if document is None or (slices is not None and len(document["slices"]) != slices):
                return False
        return True

    async with anyio.create_task_group() as group:
        group.start_soon(worker.run)
        with anyio.fail_after(60):
            while len(seen) < outcomes or not await written():  # noqa: ASYNC110 (S3 is polled)
                await anyio.sleep(0.1)
        worker.stop()
    return seen


async def publish(stack: Stack, names: harness.Names, keys: Sequence[str]) -> None:
    messages = [harness.aws_notification(names.source_bucket, [k]) for k in keys]
    await harness.publish(stack, names.source_topic, messages)


async def volume_of(stack: Stack, bucket: str, prefix: str) -> tuple[dict[str, Any], np.ndarray]:
    latest = await get_json(stack, bucket, prefix + "latest.json")
    assert latest is not None
    assert latest["npy"] is not None, latest["refused"]
    array = harness.load_npy(await harness.get_object(stack, bucket, latest["npy"]))
    return latest, array


async def test_shuffled_and_interleaved_series_make_one_volume_each(stack: Stack) -> None:
    """Two series, interleaved and each out of order: a volume each, also handed to the
    series hook eight slices a slab on the device thread."""
    hook_probe.SLABS.clear()
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    first = [(f"a/{k}", d) for k, d in synthetic_ct_series(10, 16, 16, seed=11)]
    second = [(f"b/{k}", d) for k, d in synthetic_ct_series(4, 16, 16, seed=12)]
    arrivals = first + second
    random.Random(5).shuffle(arrivals)  # the two series interleaved, each out of order
    await harness.upload(stack, names.source_bucket, arrivals)
    await publish(stack, names, [k for k, _ in arrivals])
    settings = harness.make_settings(
        stack,
        names,
        series="volume",
        series_quiet_s="30",
        series_hook="tests.hook_probe:collect_slabs",
    )
    prefixes = [series_prefix(first[0][1]), series_prefix(second[0][1])]

    wanted = [p + "latest.json" for p in prefixes]
    await run_until(settings, len(arrivals), stack, names.output_bucket, wanted)

    for prefix, slices in zip(prefixes, (first, second), strict=True):
        latest, array = await volume_of(stack, names.output_bucket, prefix)
        want = expected_volume(slices)
        assert array.shape == want.shape
        assert array.tobytes() == want.tobytes()  # every slice in its place, bit for bit
        assert latest["complete_by_data"]
        affine = np.asarray(latest["affine"])
        # highdicom's volume of the same files: the same axes, its slices in its own
        # order (here the other way along the normal), so the same points
        theirs = highdicom.get_volume_from_series(
            [pydicom.dcmread(io.BytesIO(data)) for _, data in slices]
        ).affine
        np.testing.assert_allclose(affine[:, 1:3], theirs[:, 1:3], atol=1e-9)
        points = len(slices) - 1
        ends = {tuple(np.round(affine @ [k, 0, 0, 1], 6)) for k in (0, points)}
        assert ends == {tuple(np.round(theirs @ [k, 0, 0, 1], 6)) for k in (0, points)}
        z = [s["position"][2] for s in latest["slices"]]
        assert z == sorted(z)  # along the normal (0, 0, 1)
        np.testing.assert_allclose(affine @ [len(z) - 1, 0, 0, 1], [-179.2, -179.2, z[-1], 1])
        assert latest["refused"] == []
        version = await get_json(stack, names.output_bucket, f"{prefix}{latest['version']}.json")
        assert version == latest
        assert await get_json(stack, names.output_bucket, pending_key(prefix)) is None  # done
        slabs = [s for s in hook_probe.SLABS if s[0].version == latest["version"]]
        assert [s.first_slice for s, _, _ in slabs] == list(range(0, len(slices), 8))
        assert all(s.shape == array.shape for s, _, _ in slabs)
        assert np.concatenate([host for _, host, _ in slabs]).tobytes() == array.tobytes()
        assert {thread for _, _, thread in slabs} == {"dicom-ingest-device"}
        assert slabs[0][0].affine == tuple(tuple(row) for row in latest["affine"])


async def test_a_missing_slice_then_the_late_slice(stack: Stack) -> None:
    """The quiet period ends with a slice missing: a sidecar says why there is no volume.
    The slice comes late (and an old one again): a new version holds them all, the
    first stays as it was."""
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    slices = synthetic_ct_series(5, 16, 16, seed=21)
    late = slices[2]
    early = [s for s in slices if s is not late]
    await harness.upload(stack, names.source_bucket, slices)
    prefix = series_prefix(slices[0][1])
    settings = harness.make_settings(stack, names, series="volume", series_quiet_s="1")

    await publish(stack, names, [k for k, _ in early])
    latest_key = [prefix + "latest.json"]
    await run_until(settings, len(early), stack, names.output_bucket, latest_key, len(early))
    refused = await get_json(stack, names.output_bucket, prefix + "latest.json")
    assert refused is not None
    assert refused["npy"] is None
    assert "1 missing slice(s)" in refused["refused"][0]
    first_version = prefix + refused["version"] + ".json"

    await publish(stack, names, [late[0], early[0][0]])
    await run_until(settings, 2, stack, names.output_bucket, latest_key, len(slices))

    latest, array = await volume_of(stack, names.output_bucket, prefix)
    assert latest["version"] != refused["version"]
    assert latest["complete_by_data"]
    assert array.tobytes() == expected_volume(slices).tobytes()
    assert await get_json(stack, names.output_bucket, first_version) == refused  # unchanged


async def _one_volume_and_nothing_lost(
    stack: Stack, names: harness.Names, prefix: str, slices: Sequence[tuple[str, bytes]]
) -> None:
    """The series' volume, complete by its count and written once as one version; no dead
    letter; every slice's offset committed."""
    latest, array = await volume_of(stack, names.output_bucket, prefix)
    assert latest["complete_by"] == "images_in_acquisition"
    assert len(latest["slices"]) == len(slices)
    assert array.tobytes() == expected_volume(slices).tobytes()
    keys = await output_keys(stack, names.output_bucket)
    versions = [k for k in keys if k.startswith(prefix) and k.count("/") == prefix.count("/")]
    assert sorted(versions) == sorted(  # one version, written once
        [latest["npy"], f"{prefix}{latest['version']}.json", f"{prefix}latest.json"]
    )
    assert await harness.read_json_topic(stack, names.dlq_topic) == []
    assert await harness.settled_committed_offset(stack, names.group, names.source_topic) == len(
        slices
    )


async def _series_sent(
    stack: Stack, slices: Sequence[tuple[str, bytes]], shuffle: int | None = None
) -> harness.Names:
    """Fresh names, ``slices`` uploaded and their notifications published: in their own
    order, or shuffled by ``random.Random(shuffle)``."""
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    arrivals = list(slices)
    if shuffle is not None:
        random.Random(shuffle).shuffle(arrivals)
    await harness.upload(stack, names.source_bucket, arrivals)
    await publish(stack, names, [k for k, _ in arrivals])
    return names


async def _processed(worker: WorkerProcess, count: int) -> None:
    """Until the worker process has logged ``count`` objects processed."""
    with anyio.fail_after(60):
        while worker.counts["processed"] < count:
            worker.poll_log()
            await anyio.sleep(0.02)


async def _volume_written(stack: Stack, bucket: str, prefix: str, worker: WorkerProcess) -> None:
    """Until the series' ``latest.json`` is there, the worker process alive meanwhile."""
    with anyio.fail_after(60):
        while await get_json(stack, bucket, prefix + "latest.json") is None:
            assert worker.alive(), worker.log_tail()
            await anyio.sleep(0.1)


@pytest.mark.parametrize(
    "slices_mode",
    ["write", pytest.param("hold", marks=pytest.mark.slow)],  # hold: the SIGTERM test below
)
async def test_a_sigkill_mid_series_loses_nothing(
    stack: Stack, tmp_path: Path, slices_mode: str
) -> None:
    """The real ``dicom-ingest worker`` process, SIGKILLed after some of a series' slices;
    the next worker redoes what was not committed and the series' last slice writes the
    whole volume, once. Held slices (``hold``) die with the first worker, their offsets
    uncommitted: the second has them again."""
    slices = synthetic_ct_series(12, 64, 64, seed=31)
    names = await _series_sent(stack, slices, shuffle=7)
    env = worker_environment(
        stack,
        names,
        series="volume",
        series_slices=slices_mode,
        series_quiet_s="600",
        max_objects_in_flight="2",
    )
    prefix = series_prefix(slices[0][1])

    with no_orphans():
        first = WorkerProcess(env, tmp_path / "first.log").start()
        await _processed(first, 4)
        first.kill()  # SIGKILL: no drain, no final commit, no LeaveGroup
        assert first.counts["processed"] < len(slices)  # mid-series
        if slices_mode == "hold":  # nothing durable of the held slices: nothing committed
            assert await harness.committed_offset(stack, names.group, names.source_topic) == 0
            keys = await output_keys(stack, names.output_bucket)
            assert not [k for k in keys if k.endswith(".npy")]  # no slice's values anywhere
        second = WorkerProcess(env, tmp_path / "second.log").start()
        await _volume_written(stack, names.output_bucket, prefix, second)
        second.signal(signal.SIGTERM)
        assert await second.wait(30) == 0

    await _one_volume_and_nothing_lost(stack, names, prefix, slices)
    results = await harness.read_json_topic(stack, names.results_topic)
    assert {r["source"]["key"] for r in results} == {k for k, _ in slices}  # redone: twice


async def test_a_sigterm_mid_series_spills_held_slices(stack: Stack, tmp_path: Path) -> None:
    """``SERIES_SLICES=hold``: the real worker process gets SIGTERM after some of a series'
    slices. It exits 0 well within its shutdown deadline, its held slices written as
    outputs of their own and their offsets committed (nothing it finished is redone);
    a second worker processes the rest and writes the whole volume, once."""
    slices = synthetic_ct_series(12, 64, 64, seed=33)
    names = await _series_sent(stack, slices, shuffle=3)
    deadline_s = 10.0
    env = worker_environment(
        stack,
        names,
        series="volume",
        series_slices="hold",
        series_quiet_s="600",
        max_objects_in_flight="2",
        shutdown_deadline_s=str(deadline_s),
    )
    prefix = series_prefix(slices[0][1])

    with no_orphans():
        first = WorkerProcess(env, tmp_path / "first.log").start()
        await _processed(first, 4)
        first.signal(signal.SIGTERM)
        stopping = anyio.current_time()
        assert await first.wait(deadline_s + 10) == 0, first.log_tail()
        assert anyio.current_time() - stopping < deadline_s / 2  # nothing waited for the deadline
        done = first.counts["processed"]
        assert done < len(slices)  # mid-series
        assert await get_json(stack, names.output_bucket, prefix + "latest.json") is None
        # what the first finished is durable and committed: its held slices' own .npy
        committed = await harness.settled_committed_offset(stack, names.group, names.source_topic)
        assert committed == done
        keys = await output_keys(stack, names.output_bucket)
        assert len([k for k in keys if k.endswith(".npy")]) == done
        # committed, and not in a volume yet: the series' pending marker says so
        assert await get_json(stack, names.output_bucket, pending_key(prefix)) is not None
        second = WorkerProcess(env, tmp_path / "second.log").start()
        await _volume_written(stack, names.output_bucket, prefix, second)
        second.signal(signal.SIGTERM)
        assert await second.wait(deadline_s + 10) == 0, second.log_tail()
        assert second.counts["processed"] == len(slices) - done  # none redone

    await _one_volume_and_nothing_lost(stack, names, prefix, slices)
    results = await harness.read_json_topic(stack, names.results_topic)
    assert sorted(r["source"]["key"] for r in results) == sorted(k for k, _ in slices)  # once each


async def test_number_of_slices_completes_a_pet_series(stack: Stack) -> None:
    """PET slices name no Images in Acquisition but Number of Slices: with a quiet period
    longer than the test, the last of them to arrive writes the volume."""
    slices = synthetic_pet_series(6, 16, 16, seed=81)
    names = await _series_sent(stack, slices, shuffle=9)
    prefix = series_prefix(slices[0][1])
    settings = harness.make_settings(stack, names, series="volume", series_quiet_s="600")

    await run_until(settings, len(slices), stack, names.output_bucket, [prefix + "latest.json"])

    latest, array = await volume_of(stack, names.output_bucket, prefix)
    assert latest["complete_by"] == "number_of_slices"
    assert latest["complete_by_data"]
    assert array.tobytes() == expected_volume(slices).tobytes()
    key = slices[0][0]
    sidecar = await get_json(stack, names.output_bucket, f"out/{names.source_bucket}/{key}.json")
    assert sidecar is not None
    assert sidecar["instance"]["number_of_slices"] == len(slices)
    assert sidecar["instance"]["images_in_acquisition"] is None


async def test_a_pending_series_is_written_after_a_restart(stack: Stack) -> None:
    """Without Images in Acquisition only the quiet period completes a series; a worker
    stopped before it ended leaves a pending marker, which the next start takes up."""
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    slices = []
    for key, data in synthetic_ct_series(4, 16, 16, seed=41):
        ds = pydicom.dcmread(io.BytesIO(data))
        del ds.ImagesInAcquisition
        buffer = io.BytesIO()
        ds.save_as(buffer)
        slices.append((key, buffer.getvalue()))
    await harness.upload(stack, names.source_bucket, slices)
    await publish(stack, names, [k for k, _ in slices])
    prefix = series_prefix(slices[0][1])
    patient = harness.make_settings(stack, names, series="volume", series_quiet_s="600")

    await harness.run_worker(patient, stop_after=len(slices))
    assert await get_json(stack, names.output_bucket, prefix + "latest.json") is None
    restarted = harness.make_settings(stack, names, series="volume", series_quiet_s="0.2")
    await run_until(restarted, 0, stack, names.output_bucket, [prefix + "latest.json"])

    latest, array = await volume_of(stack, names.output_bucket, prefix)
    assert not latest["complete_by_data"]
    assert array.tobytes() == expected_volume(slices).tobytes()


async def output_keys(stack: Stack, bucket: str) -> list[str]:
    async with harness.s3_client(stack) as s3:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return [item["Key"] async for page in pages for item in page.get("Contents", [])]


async def test_held_slices_write_only_the_volume_and_its_nifti(
    stack: Stack, tmp_path: Path
) -> None:
    """``SERIES_SLICES=hold``: no slice has a ``.npy`` of its own, the volume (and its
    ``.nii.gz``, which nibabel reads as the same voxels and affine) holds them, and
    every offset is committed once the volume is durable."""
    slices = synthetic_ct_series(9, 16, 16, seed=51)
    names = await _series_sent(stack, slices, shuffle=8)
    prefix = series_prefix(slices[0][1])
    settings = harness.make_settings(
        stack,
        names,
        series="volume",
        series_slices="hold",
        series_format="both",
        series_quiet_s="600",
        output_dtype="exact",
    )

    await run_until(settings, len(slices), stack, names.output_bucket, [prefix + "latest.json"])

    latest, array = await volume_of(stack, names.output_bucket, prefix)
    want = expected_volume(slices)
    assert array.dtype == np.int16  # exact: CT's values as they are
    np.testing.assert_array_equal(array, want)
    assert [s["npy"] for s in latest["slices"]] == [None] * len(slices)  # held: none their own
    keys = await output_keys(stack, names.output_bucket)
    assert [k for k in keys if k.endswith(".npy")] == [latest["npy"]]
    assert sum(k.endswith(".json") and "/members/" not in k for k in keys) >= len(slices)
    records = [k for k in keys if "/members/" in k]  # shared: held within half a second
    assert records
    assert all("/members/held-" in k for k in records)
    recorded = [
        m["sop_instance_uid"]
        for k in records
        for m in (await get_json(stack, names.output_bucket, k) or {})["members"]
    ]
    assert sorted(recorded) == sorted(s["sop_instance_uid"] for s in latest["slices"])
    assert await harness.settled_committed_offset(stack, names.group, names.source_topic) == len(
        slices
    )
    # the NIfTI: nibabel reads the same voxels, (column, row, slice), and the RAS affine
    assert latest["nifti"] == latest["npy"].removesuffix(".npy") + ".nii.gz"
    path = tmp_path / "volume.nii.gz"
    path.write_bytes(await harness.get_object(stack, names.output_bucket, latest["nifti"]))
    image = nibabel.load(path)
    assert isinstance(image, nibabel.Nifti1Image)
    np.testing.assert_array_equal(np.asarray(image.dataobj), array.transpose(2, 1, 0))
    lps = np.asarray(latest["affine"])
    ras = np.diag([-1.0, -1.0, 1.0, 1.0]) @ lps[:, [2, 1, 0, 3]]
    np.testing.assert_allclose(image.affine, ras, atol=1e-4)


def count_requests(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count the output sink's requests by operation and what they are of (``PUT member``,
    ``LIST member``, ``PUT marker``, ``PUT slice``...), multipart parts and all."""
    counts: Counter[str] = Counter()

    def of(key: str) -> str:
        if "series-pending/" in key:
            return "marker"
        if "series-manifests/" in key:
            return "manifest"
        if "/members/" in key:
            return "member"
        return "volume" if "out/series/" in key else "slice"

    def counted(name: str, operation: str) -> None:
        inner = getattr(OutputSink, name)

        async def call(self: OutputSink, key: str, *args: Any, **kwargs: Any) -> Any:
            counts[f"{operation} {of(key)}"] += 1
            return await inner(self, key, *args, **kwargs)

        monkeypatch.setattr(OutputSink, name, call)

    for name, operation in [
        ("put", "PUT"),
        ("get", "GET"),
        ("keys", "LIST"),
        ("delete", "DELETE"),
        ("_upload_part", "PART"),
    ]:
        counted(name, operation)
    return counts


@pytest.mark.parametrize("slices_mode", ["write", "hold"])
async def test_the_requests_a_slice_pays(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, slices_mode: str
) -> None:
    """Each slice committed before its series' volume (``write``) PUTs its member record
    and needs the pending marker, and slices that meet share one PUT of it; a held
    slice's offset waits for the volume, so ``hold`` writes no marker, and the held
    slices' records are shared (those held within half a second of each other, and
    those pending when the volume is planned, in one). The series' manifest is looked
    for once, however many slices come together, and again at most once a second."""
    counts = count_requests(monkeypatch)
    slices = synthetic_ct_series(12, 64, 64, seed=57)
    names = await _series_sent(stack, slices)
    prefix = series_prefix(slices[0][1])
    settings = harness.make_settings(
        stack, names, series="volume", series_slices=slices_mode, series_quiet_s="600"
    )

    started = time.monotonic()
    await run_until(settings, len(slices), stack, names.output_bucket, [prefix + "latest.json"])
    seconds = time.monotonic() - started

    _, array = await volume_of(stack, names.output_bucket, prefix)
    assert array.tobytes() == expected_volume(slices).tobytes()
    assert 1 <= counts["GET manifest"] <= 1 + int(seconds)
    if slices_mode == "hold":
        assert 1 <= counts["PUT member"] <= 1 + int(seconds / HELD_RECORD_LINGER_S)
        assert counts["PUT marker"] == 0
        assert counts["PUT slice"] == len(slices)  # sidecars: no slice's .npy
    else:
        assert counts["PUT member"] == len(slices)
        assert 1 <= counts["PUT marker"] <= len(slices)
        assert counts["PUT slice"] == 2 * len(slices)
    assert await get_json(stack, names.output_bucket, pending_key(prefix)) is None
    assert await harness.settled_committed_offset(stack, names.group, names.source_topic) == len(
        slices
    )


async def test_a_held_slice_spilled_after_its_shared_record_is_read_as_spilled(
    stack: Stack,
) -> None:
    """Held slices' member records are shared (one record, ``held``, for the slices held
    within half a second). A worker that stops writes its held slices as outputs of their
    own, each with a record of its own saying so. The next worker, completing the series
    by its count, takes a slice's own record over the shared one: it writes the volume
    at once, from its memory and the stopped worker's outputs."""
    slices = synthetic_ct_series(4, 16, 16, seed=67)
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    await harness.upload(stack, names.source_bucket, slices)
    prefix = series_prefix(slices[0][1])
    settings = harness.make_settings(
        stack, names, series="volume", series_slices="hold", series_quiet_s="600"
    )

    async def shared() -> list[dict[str, Any]]:
        """The held members of the shared records there now."""
        keys = await output_keys(stack, names.output_bucket)
        records = [await get_json(stack, names.output_bucket, k) for k in keys if "/held-" in k]
        return [m for r in records for m in (r or {})["members"]]

    await publish(stack, names, [k for k, _ in slices[:2]])
    seen: list[Outcome] = []
    first = Worker(settings, seen.append)
    async with anyio.create_task_group() as group:
        group.start_soon(first.run)
        with anyio.fail_after(60):
            while len(seen) < 2 or len(await shared()) < 2:  # noqa: ASYNC110 (S3 is polled)
                await anyio.sleep(0.1)
        first.stop()  # its held slices are spilled

    held = await shared()
    assert [m["held"] for m in held] == [True, True]
    keys = await output_keys(stack, names.output_bucket)
    own = [k for k in keys if "/members/" in k and "/held-" not in k]  # SOP.json each
    spilled = [await get_json(stack, names.output_bucket, k) or {} for k in own]
    assert [r["held"] for r in spilled] == [False, False]
    assert {r["sop_instance_uid"] for r in spilled} == {m["sop_instance_uid"] for m in held}

    await publish(stack, names, [k for k, _ in slices[2:]])
    await run_until(settings, 2, stack, names.output_bucket, [prefix + "latest.json"])

    latest, array = await volume_of(stack, names.output_bucket, prefix)
    assert array.tobytes() == expected_volume(slices).tobytes()
    assert sorted(s["npy"] is None for s in latest["slices"]) == [False, False, True, True]


async def test_a_shared_record_that_fails_is_written_again(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first PUT of a shared record of held slices fails for good: its slices stay
    pending and go up with the next record (the next one in the background, or the one
    written before the volume is planned; where that one failed, the volume is written
    after the quiet period). The volume holds every slice, and every slice is recorded."""
    put_json = OutputSink.put_json
    failed: list[str] = []

    async def failing_once(self: OutputSink, key: str, document: Mapping[str, Any]) -> None:
        if "/members/held-" in key and not failed:
            failed.append(key)
            raise SinkError("put_object: a failure for good")
        await put_json(self, key, document)

    monkeypatch.setattr(OutputSink, "put_json", failing_once)
    slices = synthetic_ct_series(6, 16, 16, seed=69)
    names = await _series_sent(stack, slices, shuffle=5)
    prefix = series_prefix(slices[0][1])
    settings = harness.make_settings(
        stack, names, series="volume", series_slices="hold", series_quiet_s="2"
    )

    await run_until(
        settings, len(slices), stack, names.output_bucket, [prefix + "latest.json"], len(slices)
    )

    assert failed
    latest, array = await volume_of(stack, names.output_bucket, prefix)
    assert array.tobytes() == expected_volume(slices).tobytes()
    keys = await output_keys(stack, names.output_bucket)
    assert failed[0] not in keys
    recorded = [
        m["sop_instance_uid"]
        for k in keys
        if "/members/held-" in k
        for m in (await get_json(stack, names.output_bucket, k) or {})["members"]
    ]
    assert sorted(recorded) == sorted(s["sop_instance_uid"] for s in latest["slices"])


async def test_a_member_recorded_while_the_marker_goes_keeps_the_marker(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another worker's slice of a series whose volume this worker has just written: its
    member record lands after this worker listed the members for the last time, and its
    pending marker's PUT just before this worker deletes the marker. The marker is put
    back, so the series is not left with a member no worker will assemble (the next
    start takes the marker up)."""
    slices = synthetic_ct_series(3, 16, 16, seed=63)
    names = await _series_sent(stack, slices)
    prefix = series_prefix(slices[0][1])
    marker = pending_key(prefix)
    delete = OutputSink.delete
    raced: list[str] = []

    async def racing_delete(self: OutputSink, key: str) -> None:
        if key == marker and not raced:  # the other worker's record, then its marker
            first = (await self.keys(f"{prefix}members/"))[0]
            record = json.loads(await self.get(first) or b"{}")
            record["sop_instance_uid"] = "1.2.3.4.5.6.7.8.9"
            record["position"] = [record["position"][0], record["position"][1], 1000.0]
            raced.append(f"{prefix}members/{record['sop_instance_uid']}.json")
            await self.put_json(raced[0], record)
            await self.put_json(marker, {"raced": True})
        await delete(self, key)

    monkeypatch.setattr(OutputSink, "delete", racing_delete)
    settings = harness.make_settings(stack, names, series="volume", series_quiet_s="600")

    await run_until(settings, len(slices), stack, names.output_bucket, [prefix + "latest.json"])

    assert raced, "the marker was never deleted"
    assert await get_json(stack, names.output_bucket, raced[0]) is not None
    assert await get_json(stack, names.output_bucket, marker) is not None


@pytest.mark.parametrize("slices_mode", ["write", "hold"])
async def test_a_memory_budget_smaller_than_the_series(stack: Stack, slices_mode: str) -> None:
    """Three slices' worth of ``SERIES_MEMORY`` for a series of ten: the rest are written
    (and read back for the volume) as without it; the volume is the same."""
    slices = synthetic_ct_series(10, 16, 16, seed=61)
    names = await _series_sent(stack, slices)
    prefix = series_prefix(slices[0][1])
    settings = harness.make_settings(
        stack,
        names,
        series="volume",
        series_slices=slices_mode,
        series_memory=str(3 * 16 * 16 * 4),
        series_quiet_s="600",
        max_objects_in_flight="2",
    )

    await run_until(settings, len(slices), stack, names.output_bucket, [prefix + "latest.json"])

    latest, array = await volume_of(stack, names.output_bucket, prefix)
    assert array.tobytes() == expected_volume(slices).tobytes()
    written = [s["npy"] for s in latest["slices"] if s["npy"] is not None]
    if slices_mode == "hold":
        assert 0 < len(written) < len(slices)  # some held, the rest written
    else:
        assert len(written) == len(slices)
    assert await harness.settled_committed_offset(stack, names.group, names.source_topic) == len(
        slices
    )


async def test_a_manifest_completes_a_series_without_a_count(stack: Stack) -> None:
    """No Images in Acquisition and a long quiet period: the series manifest names four
    of the five instances, so the fourth of them to arrive writes their volume; the
    fifth is named as not in the manifest."""
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    slices = []
    uids = []
    for key, data in synthetic_ct_series(5, 16, 16, seed=71):
        ds = pydicom.dcmread(io.BytesIO(data))
        del ds.ImagesInAcquisition
        uids.append(str(ds.SOPInstanceUID))
        buffer = io.BytesIO()
        ds.save_as(buffer)
        slices.append((key, buffer.getvalue()))
    series_uid = str(pydicom.dcmread(io.BytesIO(slices[0][1])).SeriesInstanceUID)
    manifest = {"sop_instance_uids": uids[:4]}
    await harness.upload(
        stack,
        names.output_bucket,
        [(f"out/series-manifests/{series_uid}.json", json.dumps(manifest).encode())],
    )
    await harness.upload(stack, names.source_bucket, slices)
    await publish(stack, names, [k for k, _ in slices])
    prefix = series_prefix(slices[0][1])
    settings = harness.make_settings(stack, names, series="volume", series_quiet_s="600")

    await run_until(settings, len(slices), stack, names.output_bucket, [prefix + "latest.json"])

    latest, array = await volume_of(stack, names.output_bucket, prefix)
    assert latest["complete_by"] == "manifest"
    assert {s["sop_instance_uid"] for s in latest["slices"]} == set(uids[:4])
    assert array.tobytes() == expected_volume(slices[:4]).tobytes()
    # the fifth came after (one notification at a time, in order) or before the volume
    assert latest["not_in_manifest"] in ([], [uids[4]])


async def test_a_bad_manifest_fails_the_volume_not_the_slices(stack: Stack) -> None:
    """A manifest that names no instance: every slice is still processed and committed
    (nothing dead-lettered) and no volume is written, also not when the count completes
    the series; once the manifest is put right, the next quiet period writes it."""
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    slices = synthetic_ct_series(3, 16, 16, seed=91)
    series_uid = str(pydicom.dcmread(io.BytesIO(slices[0][1])).SeriesInstanceUID)
    manifest_key = f"out/series-manifests/{series_uid}.json"
    await harness.upload(stack, names.output_bucket, [(manifest_key, b'{"sop_instance_uids": []}')])
    await harness.upload(stack, names.source_bucket, slices)
    await publish(stack, names, [k for k, _ in slices])
    prefix = series_prefix(slices[0][1])
    settings = harness.make_settings(stack, names, series="volume", series_quiet_s="1")
    seen: list[Outcome] = []
    worker = Worker(settings, seen.append)

    async with anyio.create_task_group() as group:
        group.start_soon(worker.run)
        with anyio.fail_after(60):
            while await harness.committed_offset(stack, names.group, names.source_topic) < 3:  # noqa: ASYNC110 (polled)
                await anyio.sleep(0.1)
            await anyio.sleep(1.5)  # a quiet period: the volume fails again
            assert await get_json(stack, names.output_bucket, prefix + "latest.json") is None
            uids = [str(pydicom.dcmread(io.BytesIO(d)).SOPInstanceUID) for _, d in slices]
            fixed = json.dumps({"sop_instance_uids": uids}).encode()
            await harness.upload(stack, names.output_bucket, [(manifest_key, fixed)])
            while await get_json(stack, names.output_bucket, prefix + "latest.json") is None:  # noqa: ASYNC110 (S3 is polled)
                await anyio.sleep(0.1)
        worker.stop()

    assert [o.error for o in seen] == [None] * len(slices)
    assert await harness.read_json_topic(stack, names.dlq_topic) == []
    latest, array = await volume_of(stack, names.output_bucket, prefix)
    assert latest["complete_by"] == "manifest"
    assert array.tobytes() == expected_volume(slices).tobytes()


# Streamed volumes: 512 x 512 float32 slices (1 MiB), five a part of 5 MiB.
STREAMED_SLICES = 24


async def multipart_uploads(stack: Stack, bucket: str, prefix: str) -> dict[str, list[int]]:
    """The incomplete multipart uploads under ``prefix``, with the numbers of their parts."""
    found: dict[str, list[int]] = {}
    async with harness.s3_client(stack) as s3:
        answer = await s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix)
        for upload in answer.get("Uploads", []):
            try:
                parts = await s3.list_parts(
                    Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )
            except s3.exceptions.NoSuchUpload:  # aborted or completed since the listing
                continue
            found[upload["Key"]] = sorted(p["PartNumber"] for p in parts.get("Parts", []))
    return found


async def run_in_phases(
    settings: Settings,
    stack: Stack,
    names: harness.Names,
    phases: Sequence[tuple[Sequence[str], Callable[[list[Outcome]], Awaitable[bool]]]],
) -> Worker:
    """One worker; for each phase, publish its keys then wait until its condition holds."""
    seen: list[Outcome] = []
    worker = Worker(settings, seen.append)
    async with anyio.create_task_group() as group:
        group.start_soon(worker.run)
        for keys, ready in phases:
            if keys:
                await publish(stack, names, keys)
            with anyio.fail_after(90):
                while not await ready(seen):  # noqa: ASYNC110 (S3 is polled)
                    await anyio.sleep(0.1)
        worker.stop()
    return worker


async def _no_volume_but_the_versions(
    stack: Stack, bucket: str, prefix: str, latest: dict[str, Any]
) -> None:
    """No multipart upload left under the series, and no ``.npy`` beside its versions but
    the one its sidecars name (nothing half written, nothing streamed left over)."""
    assert await multipart_uploads(stack, bucket, prefix) == {}
    keys = await output_keys(stack, bucket)
    arrays = [k for k in keys if k.startswith(prefix) and k.count("/") == prefix.count("/")]
    assert [k for k in arrays if k.endswith(".npy")] == [latest["npy"]]


@pytest.mark.parametrize(
    ("direction", "slices_mode", "nifti_and_hook"),
    [
        ("ascending", "write", False),
        ("descending", "hold", False),
        # a .nii.gz and a series hook beside the stream: with `make chaos`, for time
        pytest.param("descending", "write", True, marks=pytest.mark.slow),
    ],
)
async def test_slices_in_order_stream_the_volume_as_they_come(
    stack: Stack, tmp_path: Path, direction: str, slices_mode: str, nifti_and_hook: bool
) -> None:
    """A series sent in order along its normal, either way: parts of its volume are up
    before its last slice is sent, and the volume, completed after it, is the sorted
    slices bit for bit. Held slices' offsets are committed once it is durable. The
    ``.nii.gz`` and the series hook, which are not streamed, get the same voxels."""
    hook_probe.SLABS.clear()
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    slices = synthetic_ct_series(STREAMED_SLICES, 512, 512, seed=101)  # z descending
    arrivals = slices if direction == "descending" else slices[::-1]
    await harness.upload(stack, names.source_bucket, slices)
    prefix = series_prefix(slices[0][1])
    bucket = names.output_bucket
    extras = (
        {"series_format": "both", "series_hook": "tests.hook_probe:collect_slabs"}
        if nifti_and_hook
        else {}
    )
    settings = harness.make_settings(
        stack,
        names,
        series="volume",
        series_slices=slices_mode,
        series_quiet_s="600",
        **extras,
    )
    before_last: dict[str, list[int]] = {}

    async def parts_up(seen: list[Outcome]) -> bool:
        before_last.update(await multipart_uploads(stack, bucket, prefix))
        return any(before_last.values())

    async def written(seen: list[Outcome]) -> bool:
        return (
            len(seen) == len(slices)
            and await get_json(stack, bucket, prefix + "latest.json") is not None
        )

    worker = await run_in_phases(
        settings,
        stack,
        names,
        [([k for k, _ in arrivals[:-1]], parts_up), ([arrivals[-1][0]], written)],
    )

    latest, array = await volume_of(stack, bucket, prefix)
    assert array.tobytes() == expected_volume(slices).tobytes()
    [(key, numbers)] = before_last.items()  # one upload, its parts up before the last slice
    assert key == latest["npy"]
    assert key.startswith(prefix + "stream-")
    # parts up before the last slice: the block starts at 5,000 and grows either way as
    # the slices come (on a busy machine they finish far out of order; every part is placed
    # by its position, as the volume's bytes above show); three parts' worth of slices, at
    # most, are there before the last one (a part may still be uploading when looked at)
    assert numbers
    assert set(numbers) <= set(range(4998, 5003))
    assert worker.series is not None
    assert worker.series.volumes_streamed == 1
    await _no_volume_but_the_versions(stack, bucket, prefix, latest)
    if slices_mode == "hold":
        assert [s["npy"] for s in latest["slices"]] == [None] * len(slices)
    assert await harness.settled_committed_offset(stack, names.group, names.source_topic) == len(
        slices
    )
    if nifti_and_hook:  # named as the .npy, the same voxels; the hook's slabs in order
        assert latest["nifti"] == key.removesuffix(".npy") + ".nii.gz"
        path = tmp_path / "volume.nii.gz"
        path.write_bytes(await harness.get_object(stack, bucket, latest["nifti"]))
        image = nibabel.load(path)
        assert isinstance(image, nibabel.Nifti1Image)
        np.testing.assert_array_equal(np.asarray(image.dataobj), array.transpose(2, 1, 0))
        slabs = [s for s in hook_probe.SLABS if s[0].version == latest["version"]]
        assert [s.first_slice for s, _, _ in slabs] == list(range(0, len(slices), 8))
        assert np.concatenate([host for _, host, _ in slabs]).tobytes() == array.tobytes()
    else:
        assert latest["nifti"] is None


def _copy_of(data: bytes, **changes: Any) -> bytes:
    ds = pydicom.dcmread(io.BytesIO(data))
    for keyword, value in changes.items():
        setattr(ds, keyword, value)
    buffer = io.BytesIO()
    ds.save_as(buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("case", "slices_mode"),
    [
        ("interleaved", "write"),
        pytest.param("duplicate", "hold", marks=pytest.mark.slow),  # for time: `make chaos`
        ("missing", "write"),
    ],
)
async def test_a_stream_broken_writes_the_volume_whole(
    stack: Stack, case: str, slices_mode: str
) -> None:
    """The order breaks once parts are up: the even slices first, then the odd ones; a
    second slice at a position already streamed; a slice missing until the quiet period
    has refused the volume, then coming late (parts up before it or not, as the direction
    guessed from the first slices done allows). The upload is aborted and the volume
    written whole, as without streaming: the sorted slices, under its version's key;
    no multipart upload is left and no other ``.npy`` beside the versions. Written
    slices whose parts were up are read back; held ones stay in memory until then."""
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    count = 36 if case == "interleaved" else STREAMED_SLICES  # 18 even slices: two parts
    slices = synthetic_ct_series(count, 512, 512, seed=111)  # z descending
    prefix = series_prefix(slices[0][1])
    bucket = names.output_bucket
    keys = [k for k, _ in slices]
    quiet = "2" if case == "missing" else "600"
    settings = harness.make_settings(
        stack, names, series="volume", series_slices=slices_mode, series_quiet_s=quiet
    )
    extra: list[tuple[str, bytes]] = []
    if case == "duplicate":  # slice 3's position, another instance (kept: the first)
        uid = pydicom.uid.generate_uid()
        extra = [("dup.dcm", _copy_of(slices[3][1], SOPInstanceUID=uid, InstanceNumber=100))]
    await harness.upload(stack, names.source_bucket, [*slices, *extra])
    seen_uploads: dict[str, list[int]] = {}

    async def parts_up(seen: list[Outcome]) -> bool:
        seen_uploads.update(await multipart_uploads(stack, bucket, prefix))
        return any(seen_uploads.values())

    async def aborted(seen: list[Outcome]) -> bool:
        return await multipart_uploads(stack, bucket, prefix) == {}

    def latest_of(total: int) -> Callable[[list[Outcome]], Awaitable[bool]]:
        async def ready(seen: list[Outcome]) -> bool:
            latest = await get_json(stack, bucket, prefix + "latest.json")
            return latest is not None and len(latest["slices"]) == total

        return ready

    phases: list[tuple[Sequence[str], Callable[[list[Outcome]], Awaitable[bool]]]]
    if case == "interleaved":
        phases = [(keys[0::2], parts_up), (keys[1::2], latest_of(count))]
    elif case == "duplicate":
        phases = [
            (keys[:20], parts_up),
            (["dup.dcm"], aborted),
            (keys[20:], latest_of(count)),
        ]
    else:  # slice 12 missing: the quiet period refuses the volume; then it comes late
        # (whether a part goes up first depends on the direction guessed from the slices
        # first done, which a busy machine reorders: with the lower half first, the parts
        # below the gap wait for it; so this case waits for the refused version instead)
        phases = [
            (keys[:12] + keys[13:], latest_of(count - 1)),
            ([keys[12]], latest_of(count)),
        ]
    await run_in_phases(settings, stack, names, phases)

    latest, array = await volume_of(stack, bucket, prefix)
    if case != "missing":
        assert any(seen_uploads.values())  # parts were up before the stream broke
    assert array.tobytes() == expected_volume(slices).tobytes()
    assert latest["npy"] == f"{prefix}{latest['version']}.npy"  # written whole
    if case == "duplicate":
        assert latest["duplicates"] == [uid]
    await _no_volume_but_the_versions(stack, bucket, prefix, latest)
    if case == "missing":  # the refused version stays as it was, beside the new one
        versions = [
            await get_json(stack, bucket, k)
            for k in await output_keys(stack, bucket)
            if k.startswith(prefix) and k.count("/") == prefix.count("/") and k.endswith(".json")
        ]
        refused = [v for v in versions if v is not None and v["refused"]]
        assert len(refused) == 1
        assert "1 missing slice(s)" in refused[0]["refused"][0]
    records = len(slices) + len(extra)
    assert await harness.settled_committed_offset(stack, names.group, names.source_topic) == records
