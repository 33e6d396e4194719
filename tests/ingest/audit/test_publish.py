"""The worker's audit trail on a real broker: keyring envelopes and signed digests that
`audit verify | export` check on the topic; and the spool that keeps the worker going,
in order and committed only once audited, while the audit broker is down."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

from ingest.audit.keys import LocalKeyring, write_keyring
from ingest.audit.store import read_audit_topic
from ingest.audit.verify import object_records, unwrap_all, verify_trail
from ingest.embedded.samples import synthetic_ct_series
from ingest.embedded.stack import Stack, create_topics, start_tansu
from ingest.settings import load_settings
from ingest.worker import Outcome, Worker
from tests import harness
from tests.trails import cli

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("aws_environment"),
]


async def prepared(stack: Stack, names: harness.Names, count: int) -> None:
    harness.prepare(stack, names)
    objects = [(f"ct/{k}", v) for k, v in synthetic_ct_series(count, rows=32, columns=32)]
    await harness.upload(stack, names.source_bucket, objects)
    notes = [harness.aws_notification(names.source_bucket, [k]) for k, _ in objects]
    await harness.publish(stack, names.source_topic, notes)


def test_worker_trail_verifies_and_exports_from_the_topic(
    stack: Stack,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    names = harness.make_names(uuid.uuid4().hex[:10])
    keyring, signing = tmp_path / "keyring.json", tmp_path / "signing.pem"
    assert (
        cli(
            monkeypatch,
            ["audit", "keygen", "--keyring", str(keyring), "--signing-key", str(signing)],
        )
        == 0
    )
    env = harness.worker_environment(
        stack,
        names,
        audit_digest_records="4",
        audit_keyring_file=str(keyring),
        audit_signing_key_file=str(signing),
    )
    del env["DICOM_INGEST_AUDIT_KEY"]
    settings = load_settings(env)
    anyio.run(prepared, stack, names, 9)
    run = anyio.run(harness.run_worker, settings, 9)
    assert len(run.outcomes) == 9
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert cli(monkeypatch, ["audit", "verify", "--public-key", f"{signing}.pub"]) == 0
    out = capsys.readouterr().out
    assert "11 records decrypted" in out  # start, 9 objects, stop
    assert "verified: no break" in out
    export = tmp_path / "trail.jsonl"
    assert cli(monkeypatch, ["audit", "export", "--out", str(export)]) == 0
    # the export recorded itself first (110101 Audit Log Used): a trail of its own, signed
    # with the site key, that verifies with the workers'
    capsys.readouterr()
    assert cli(monkeypatch, ["audit", "decrypt"]) == 0
    used = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    uses = [r for r in used if r["event"] == "audit_log.used"]
    (record,) = [r for r in uses if r["worker"].startswith("audit-export.")]
    assert record["key"] == f"kafka://{env['DICOM_INGEST_KAFKA_BOOTSTRAP']}/{names.audit_topic}"
    ident = record["dicom_audit"]["EventIdentification"]
    assert (ident["EventID"]["code"], ident["EventActionCode"]) == ("110101", "R")
    assert len(uses) == 2  # and the decrypt's own
    assert cli(monkeypatch, ["audit", "verify", "--public-key", f"{signing}.pub"]) == 0
    assert "3 trails (3 signed)" in capsys.readouterr().out
    monkeypatch.delenv("DICOM_INGEST_AUDIT_KEYRING_FILE")
    monkeypatch.delenv("DICOM_INGEST_KAFKA_BOOTSTRAP")
    capsys.readouterr()
    argv = ["audit", "verify", "--no-decrypt", "--file", str(export)]
    assert cli(monkeypatch, [*argv, "--public-key", f"{signing}.pub"]) == 0
    # after the start, records 4 and 8, and the final one at the stop
    assert "4 digests, closed" in capsys.readouterr().out
    assert cli(monkeypatch, argv) == 2  # no key pinned: verify does not guess one


@pytest.mark.anyio
async def test_spool_carries_the_trail_while_the_audit_broker_is_down(
    stack: Stack, tmp_path: Path
) -> None:
    names = harness.make_names(uuid.uuid4().hex[:10])
    keyring = tmp_path / "keyring.json"
    write_keyring(keyring)
    total = 60
    await prepared(stack, names, total)
    with start_tansu(f"s3://{names.output_bucket}-tansu/", stack.s3, tmp_path) as audit_broker:
        create_topics(audit_broker.bootstrap, [names.audit_topic])
        env = harness.worker_environment(
            stack,
            names,
            audit_keyring_file=str(keyring),
            audit_spool_dir=str(tmp_path / "spool"),
            audit_spool_max_bytes=str(64 * 1024),
            audit_ack_timeout_s="0.5",
            audit_kafka_bootstrap=audit_broker.bootstrap,
            max_objects_in_flight="4",
        )
        del env["DICOM_INGEST_AUDIT_KEY"]
        settings = load_settings(env)
        outcomes: list[Outcome] = []
        reached = {5: anyio.Event(), total: anyio.Event()}

        def on_outcome(outcome: Outcome) -> None:
            outcomes.append(outcome)
            if len(outcomes) in reached:
                reached[len(outcomes)].set()

        worker = Worker(settings, on_outcome)
        async with anyio.create_task_group() as group:
            await group.start(worker.run)
            with anyio.fail_after(30):
                await reached[5].wait()
            await anyio.to_thread.run_sync(audit_broker.kill)  # the audit path goes away
            audit: Any = worker._audit
            with anyio.fail_after(40):
                while not audit.paused:  # noqa: ASYNC110 - a flag nothing signals; polled
                    await anyio.sleep(0.1)
            held = len(outcomes)
            await anyio.sleep(2.0)
            assert len(outcomes) <= held + 4  # at most those in flight finished meanwhile
            assert len(outcomes) < total
            committed = await harness.committed_offset(stack, names.group, names.source_topic)
            assert 0 < committed <= len(outcomes)  # every committed offset's record is spooled
            await anyio.to_thread.run_sync(audit_broker.restart)
            with anyio.fail_after(60):
                await reached[total].wait()
            worker.stop()
        messages = [
            m.value for m in await read_audit_topic(audit_broker.bootstrap, names.audit_topic)
        ]
    assert not any((tmp_path / "spool").rglob("*.msg"))  # all forwarded
    data_keys = await unwrap_all(messages, LocalKeyring(keyring))
    report = verify_trail(messages, data_keys=data_keys, trust_on_first_use=True)
    assert report.ok, report.findings
    assert sorted(r["key"] for r in object_records(report.records)) == sorted(
        o.ref.key for o in outcomes if o.ref
    )
    assert [r["seq"] for r in report.records if r] == sorted(r["seq"] for r in report.records)
    digests = [json.loads(m) for m in messages if b'"digest"' in m]
    assert digests[-1]["last_seq"] == total + 1  # start, 60 objects, stop: all signed
