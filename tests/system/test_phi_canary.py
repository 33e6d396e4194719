"""No patient data in logs, dead letters or results: every sample file, with a canary
planted in every patient attribute and in its object key, through the real worker."""

from __future__ import annotations

import io
import json
import os
import signal
import uuid
from pathlib import Path

import pytest
from pydicom import dcmread
from pydicom.dataset import Dataset

from ingest.embedded.samples import (
    not_dicom,
    pydicom_examples,
    synthetic_ct_series,
    synthetic_multiframe,
    synthetic_rgb,
)
from ingest.embedded.samples_compressed import compressed_samples
from ingest.embedded.stack import Stack
from tests import harness
from tests.chaos import WorkerProcess

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(180)]

CANARIES = {  # keyword: a value found nowhere else, valid for the attribute's VR
    "PatientName": "Canarypn^Zeta",
    "PatientID": "CANARYPID7",
    "PatientBirthDate": "18710305",
    "PatientAddress": "CANARYADDR 9 Elm Row",
    "AccessionNumber": "CANARYACC7",
    "OtherPatientIDs": "CANARYOPID7",
    "PatientTelephoneNumbers": "CANARYTEL7",
    "PatientComments": "CANARYPCOMMENT",
    "ImageComments": "CANARYIMGCOMMENT",
    "StudyDescription": "CANARYSTUDYDESC",
    "InstitutionName": "CANARYINST",
    "ReferringPhysicianName": "Canarydoc^Ref",
}
KEY_CANARY = "CANARYKEY"


def planted(data: bytes) -> bytes | None:
    """The file with every canary set (None if pydicom cannot write it back)."""
    try:
        ds: Dataset = dcmread(io.BytesIO(data), force=True)
        for keyword, value in CANARIES.items():
            setattr(ds, keyword, value)
        out = io.BytesIO()
        ds.save_as(out, enforce_file_format=False)
    except Exception:  # a deliberately broken example pydicom will not write again
        return None
    return out.getvalue()


def corpus() -> dict[str, bytes]:
    files = [(f"pydicom/{n}", d) for n, d in pydicom_examples()]
    files += [(f"ct/{k}", d) for k, d in synthetic_ct_series(2, rows=64, columns=64)]
    files += [
        ("mf/mf.dcm", synthetic_multiframe(3, 32, 32)),
        ("slide/tiles.dcm", synthetic_rgb(4, 32, 32, encapsulated="basic")),
    ]
    files += compressed_samples(ct_size=64, slide_tiles=(2, 2))
    objects: dict[str, bytes] = {}
    for i, (name, data) in enumerate(files):
        body = planted(data)
        if body is not None:
            objects[f"{KEY_CANARY}-{i}/{name}"] = body
    first = next(iter(objects.values()))
    objects[f"{KEY_CANARY}-cut/truncated.dcm"] = first[: len(first) // 2]  # an error path
    key, png = not_dicom()
    objects[f"{KEY_CANARY}-png/{key}"] = png
    return objects


async def test_no_canary_in_logs_dead_letters_or_results(stack: Stack, tmp_path: Path) -> None:
    objects = corpus()
    assert len(objects) >= 30  # every sample written back with its canaries
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    await harness.upload(stack, names.source_bucket, objects.items())
    notes = [harness.aws_notification(names.source_bucket, [k]) for k in objects]
    await harness.publish(stack, names.source_topic, notes)
    # the worker as a user starts it (`python -m ingest.cli worker`), its logs as it writes them
    env = {**os.environ, **harness.worker_environment(stack, names), "DICOM_INGEST_WORKER_ID": "w"}
    with WorkerProcess(env, tmp_path / "worker.log") as worker:
        done = await worker.wait_until(
            lambda w: w.counts["processed"] + w.counts["dead-lettered"] >= len(objects), 120
        )
        assert done is not None, worker.log_path.read_text()[-3000:]
        worker.signal(signal.SIGTERM)
        assert await worker.wait(30) == 0
    logs = worker.log_path.read_text()
    results = await harness.read_topic_raw(stack, names.results_topic)
    dead = await harness.read_topic_raw(stack, names.dlq_topic)
    processed = len(results)
    assert processed >= 20
    assert len(dead) == len(objects) - processed >= 2
    assert logs.count('"event": "processed"') == processed  # the lines were captured
    everything = {
        "logs": logs,
        "results": b"".join(results).decode(),
        "dlq": b"".join(dead).decode(),
    }
    for where, text in everything.items():
        for keyword, canary in CANARIES.items():
            assert canary not in text, (where, keyword)
            assert canary.replace("^", " ") not in text, (where, keyword)
    assert KEY_CANARY not in logs
    # the contract keeps keys in results and dead letters: the canaries are there
    assert all(KEY_CANARY in json.loads(d)["key"] for d in dead)
    assert all(KEY_CANARY in json.loads(r)["source"]["key"] for r in results)
