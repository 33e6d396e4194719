"""``dicom-ingest audit``: decrypt every record of the audit topic and verify the hash chains."""

from __future__ import annotations

import json

from ingest.audit.records import AuditVerificationError, open_envelope, verify_chain
from ingest.settings import Settings
from ingest.source.kafka import read_topic


async def run_audit(settings: Settings, show: bool) -> int:
    """Print a summary (and each record with ``show``); exit status 1 when anything fails.

    Raises:
        BrokerError: the topic could not be read.
    """
    keys = {settings.audit_key_id: settings.audit_key}
    records = []
    failures = 0
    for message in await read_topic(settings.kafka_bootstrap, settings.audit_topic):
        try:
            records.append(open_envelope(message, keys))
        except AuditVerificationError as exc:
            failures += 1
            print(f"undecryptable record: {exc}")
    if show:
        for record in records:
            print(json.dumps(record, sort_keys=True))
    report = verify_chain(records)
    outcomes: dict[str, int] = {}
    for record in records:
        outcomes[record["outcome"]] = outcomes.get(record["outcome"], 0) + 1
    print(
        f"{len(records)} records decrypted ({failures} failed), {report.trails} trails, "
        f"outcomes {outcomes}; chain: {'ok' if report.ok else 'PROBLEMS'}"
    )
    for problem in report.problems:
        print(f"  {problem.kind}: worker {problem.worker} seq {problem.seq}: {problem.detail}")
    return 0 if report.ok and not failures else 1
