"""The worker over files: the same corpus from S3 and from a folder gives the same outputs,
and files outside the roots are dead-lettered, never read."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest

from ingest.audit.records import open_envelope
from ingest.embedded.stack import Stack
from tests import harness

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

# Both read paths (one read; header, then Pixel Data in ranges at 64 KiB parts), native
# and encapsulated, colour, names that need percent-encoding
KEYS = (
    "pydicom/CT_small.dcm",
    "pydicom/rtdose.dcm",
    "dir with space/multi+frame é.dcm",
    "rgb/planar.dcm",
    "slide/tiles.dcm",
    "slide/frames-over-a-part.dcm",
)
# What may differ between a sidecar of an S3 object and one of the same bytes in a file
VARYING = ("timings", "output")


def file_notification(path: Path) -> bytes:
    return json.dumps({"url": "file://" + quote(str(path))}).encode()


async def test_files_and_s3_objects_of_one_corpus_give_identical_outputs(
    stack: Stack, aws_environment: None, tmp_path: Path
) -> None:
    names = harness.make_names(uuid.uuid4().hex[:10])
    harness.prepare(stack, names)
    corpus = {key: data for key, data in harness.corpus().items() if key in KEYS}
    await harness.upload(stack, names.source_bucket, corpus.items())
    root = tmp_path / "archive"
    for key, data in corpus.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    (tmp_path / "secret.dcm").write_bytes(corpus["pydicom/CT_small.dcm"])
    (root / "escape.dcm").symlink_to(tmp_path / "secret.dcm")
    refused = [
        file_notification(tmp_path / "secret.dcm"),  # outside the root: not a notification
        file_notification(root / "escape.dcm"),  # inside by its words, outside by its link
    ]
    messages = [harness.aws_notification(names.source_bucket, corpus)]
    messages += [file_notification(root / key) for key in corpus] + refused
    await harness.publish(stack, names.source_topic, messages)
    settings = harness.make_settings(stack, names, file_roots=f"files={root}", file_reader="auto")

    run = await harness.run_worker(settings, stop_after=2 * len(corpus) + len(refused))

    done = [o for o in run.outcomes if o.processed is not None]
    assert sorted((o.ref.bucket, o.ref.key) for o in done if o.ref) == sorted(
        [(names.source_bucket, k) for k in corpus] + [("files", k) for k in corpus]
    )
    results = await harness.read_json_topic(stack, names.results_topic)
    by_source = {(r["source"]["bucket"], r["source"]["key"]): r for r in results}
    for key in corpus:
        s3_doc, file_doc = by_source[names.source_bucket, key], by_source["files", key]
        s3_npy = await harness.get_object(stack, names.output_bucket, s3_doc["output"]["npy"])
        file_npy = await harness.get_object(stack, names.output_bucket, file_doc["output"]["npy"])
        assert file_doc["output"]["npy"] == f"out/files/{key}.npy"
        assert file_npy == s3_npy, key  # the same bytes, the same array
        for field in ("sha256", "crc64nvme", "size"):
            assert file_doc["source"][field] == s3_doc["source"][field], (key, field)
        same = {k: v for k, v in s3_doc.items() if k not in (*VARYING, "source")}
        assert {k: v for k, v in file_doc.items() if k not in (*VARYING, "source")} == same
        sidecar = await harness.get_object(stack, names.output_bucket, file_doc["output"]["json"])
        assert harness.load_json(sidecar)["source"] == file_doc["source"]
    audit = [
        open_envelope(raw, {settings.audit_key_id: harness.AUDIT_KEY})
        for raw in await harness.read_topic_raw(stack, names.audit_topic)
        if json.loads(raw).get("type") != "digest"
    ]
    audited = {(r["bucket"], r["key"], r["outcome"]) for r in audit}
    assert {("files", key, "success") for key in corpus} <= audited  # as for S3 objects
    assert ("files", "escape.dcm", "failure") in audited
    dead = await harness.read_json_topic(stack, names.dlq_topic)
    assert sorted(d["reason"] for d in dead) == ["access_denied", "bad_notification"]
    assert all("secret" not in json.dumps(d["error"]) for d in dead)
