"""What series volumes cost: a CT series end to end with ``SERIES=volume`` against ``off``.

A diagnostic, not a test (pytest does not collect it)::

    .venv/bin/python -m ingest.bench.diagnostics.series_cost [--slices N] [--passes P]
        [--device auto|cuda|cpu] [--set NAME=VALUE ...]

It starts the embedded stack and, for each pass, uploads a new CT series of
``N`` 512 x 512 slices (default 300; a new seed a pass, so every pass is a new
series: a volume already written is never written again, which would cost
nothing), publishes its notifications and runs one worker until every slice is
done, once with ``SERIES=off`` and once with ``SERIES=volume`` (in alternating
order), the S3 sink on. The series says it is complete (Images in Acquisition),
so with ``volume`` its last slice completes the volume (most of it uploaded as
its slices came) before its own outcome: the time from the notifications to the
last outcome covers the assembly. It prints each pass's seconds and the worker's
CPU a slice, the median ratio ``volume / off`` (the goal: at most 1.05) and that of
the worker's CPU, and the JSON of the figures on the last line. ``--only off`` or
``--only volume`` runs that mode's passes alone, for a profiler::

    py-spy record --nonblocking -r 200 -f raw -o volume.raw -- \
        python3 -m ingest.bench.diagnostics.series_cost --device cuda --passes 2 \
        --set series_slices=hold --only volume
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import time

import anyio
import botocore.session

from ingest.embedded.demo import aws_record
from ingest.embedded.samples import synthetic_ct_series
from ingest.embedded.stack import create_topics, embedded_stack
from ingest.settings import Settings, load_settings
from ingest.source.kafka import make_producer
from ingest.worker import Outcome, Worker


async def one_pass(
    environment: dict[str, str], keys: list[str], bucket: str, token: str, series: str
) -> tuple[float, float]:
    """Seconds from the first notification to the last slice's outcome, and the process's
    CPU seconds meanwhile (the worker's: the servers run in processes of their own)."""
    env = {
        **environment,
        "DICOM_INGEST_SOURCE_TOPIC": f"series-{token}-events",
        "DICOM_INGEST_GROUP_ID": f"series-{token}",
        "DICOM_INGEST_SERIES": series,
    }
    settings: Settings = load_settings(env)
    await anyio.to_thread.run_sync(create_topics, settings.kafka_bootstrap, [settings.source_topic])
    done = anyio.Event()
    outcomes: list[Outcome] = []

    def on_outcome(outcome: Outcome) -> None:
        outcomes.append(outcome)
        if len(outcomes) >= len(keys):
            done.set()

    worker = Worker(settings, on_outcome)
    async with anyio.create_task_group() as group:
        await group.start(worker.run)
        producer = make_producer(settings)
        await producer.start()
        started, cpu = time.perf_counter(), time.process_time()
        try:
            for index, key in enumerate(keys):
                record = {"Records": [aws_record(bucket, key, 0, index)]}
                await producer.send(settings.source_topic, json.dumps(record).encode())
            await producer.flush()
        finally:
            await producer.stop()
        await done.wait()
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        worker.stop()
    failed = [o for o in outcomes if o.processed is None]
    if failed:
        raise SystemExit(f"{len(failed)} slices failed: {failed[0].error}")
    return seconds, cpu


async def main(args: argparse.Namespace) -> None:
    with embedded_stack() as stack:
        source, output = "series-source", "series-output"
        stack.s3.create_bucket(source)
        stack.s3.create_bucket(output)
        topics = ("results", "dlq", "audit")
        create_topics(stack.kafka.bootstrap, [f"series-{t}" for t in topics])
        environment = {
            **stack.endpoints.environment(),
            "DICOM_INGEST_OUTPUT_URL": f"s3://{output}/out/",
            "DICOM_INGEST_AUDIT_KEY": base64.b64encode(os.urandom(32)).decode(),
            "DICOM_INGEST_RESULTS_TOPIC": "series-results",
            "DICOM_INGEST_DLQ_TOPIC": "series-dlq",
            "DICOM_INGEST_AUDIT_TOPIC": "series-audit",
            "DICOM_INGEST_DEVICE": args.device,
            "DICOM_INGEST_SERIES_QUIET_S": "600",
            **{f"DICOM_INGEST_{k.upper()}": v for k, v in (s.split("=", 1) for s in args.set)},
        }
        os.environ.update(stack.endpoints.environment())  # AWS_* credentials, region
        s3 = botocore.session.get_session().create_client("s3", endpoint_url=stack.s3.endpoint_url)
        times: dict[str, list[float]] = {"off": [], "volume": []}
        cpus: dict[str, list[float]] = {"off": [], "volume": []}
        for index in range(args.passes):
            order = ("off", "volume") if index % 2 == 0 else ("volume", "off")
            for mode in [m for m in order if args.only in (None, m)]:
                seed = 1000 + 2 * index + (mode == "volume")
                keys = []
                for key, data in synthetic_ct_series(args.slices, seed=seed):
                    name = f"{seed}/{key}"
                    s3.put_object(Bucket=source, Key=name, Body=data)
                    keys.append(name)
                token = f"{index}-{mode}"
                seconds, cpu = await one_pass(environment, keys, source, token, mode)
                times[mode].append(seconds)
                cpus[mode].append(cpu)
                rate, per = args.slices / seconds, cpu / args.slices * 1000
                print(
                    f"pass {index} {mode:>6}: {seconds:.3f} s, {rate:.1f} slices/s, "
                    f"{per:.2f} CPU ms a slice"
                )
        if args.only is not None:  # one mode's passes alone: a profiler's run
            return
        ratios = [v / o for v, o in zip(times["volume"], times["off"], strict=True)]
        ratio = statistics.median(ratios)
        print(f"median volume / off: {ratio:.3f} (goal <= 1.05)")
        cpu_ratios = [v / o for v, o in zip(cpus["volume"], cpus["off"], strict=True)]
        print(f"median CPU volume / off: {statistics.median(cpu_ratios):.3f}")
        print(json.dumps({"slices": args.slices, "seconds": times, "cpu_s": cpus, "ratio": ratio}))


def arguments() -> argparse.ArgumentParser:
    """The command line (``series_trace`` takes the same)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--slices", type=int, default=300)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument(
        "--only", choices=("off", "volume"), help="run this mode's passes alone (to profile it)"
    )
    return parser


if __name__ == "__main__":
    anyio.run(main, arguments().parse_args())
