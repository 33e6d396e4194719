"""The S3 sink alone: what writing one CT slice's outputs costs, by thread, and how fast it goes.

A diagnostic, not a test (pytest does not collect it)::

    .venv/bin/python -m ingest.bench.diagnostics.sink_cost [OBJECTS] [--no-network]

It starts SeaweedFS as the stack does and writes, as the worker writes them for
each CT slice, a ``(1, 512, 512)`` float32 ``.npy`` through ``OutputSink.array``
and then the slice's sidecar through ``put_json``, for ``OBJECTS`` objects (default
600) with 64 at a time (``max_objects_in_flight``), after a warm-up, three times.
For each pass it prints objects/s, the server's CPU per object, and this process's
CPU per object by thread: the event loop (presigning, the writer, the thread
hand-offs) and the PUT threads (``http.client``, the kernel's copies).
``--no-network`` answers every PUT at once on the event loop, which leaves the
loop's own share of the sink (no thread hand-off, no wake-ups).

Against ``dicom-ingest bench``'s ``ours`` and ``put-raw`` on the same machine it
says where the CT rate with the sink goes: the sink's own Python on the event loop,
its PUT threads, the server, or the object's time in flight.
docs/benchmarks.md ("Outputs to S3") quotes it.
"""

from __future__ import annotations

import base64
import os
import re
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np

from ingest.bench.measure import process_cpu_s
from ingest.embedded.stack import start_seaweedfs
from ingest.fetch.s3 import S3Source
from ingest.settings import load_settings
from ingest.sink.output import OutputSink

IN_FLIGHT = 64
SHAPE = (1, 512, 512)
SIDECAR = {"source": {"bucket": "b", "key": "k" * 60, "size": 525362}, "pad": "x" * 700}


def thread_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of each thread of this process, by native id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # a thread that ended
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def by_group(before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """CPU seconds between two ``thread_cpu`` readings, by thread name without its number."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    loop = threading.main_thread().native_id
    groups: defaultdict[str, float] = defaultdict(float)
    for tid, seconds in after.items():
        name = "event loop" if tid == loop else re.sub(r"[_-]?\d+$", "", names.get(tid, "?"))
        groups[name] += seconds - before.get(tid, 0.0)
    return dict(groups)


async def one_pass(sink: OutputSink, base: int, count: int, values: np.ndarray) -> None:
    limit = anyio.Semaphore(IN_FLIGHT)

    async def write(index: int) -> None:
        async with limit:
            async with sink.array(f"o/{index}.npy", SHAPE, "float32") as out:
                await out.write(values)
            await sink.put_json(f"o/{index}.json", SIDECAR)

    async with anyio.create_task_group() as group:
        for index in range(base, base + count):
            group.start_soon(write, index)


async def main() -> None:
    count = int(next((a for a in sys.argv[1:] if a.isdigit()), "600"))
    values = np.random.default_rng(0).random(SHAPE, dtype=np.float32)
    with tempfile.TemporaryDirectory() as work, start_seaweedfs(Path(work)) as s3:
        s3.create_bucket("out")
        c = s3.credentials
        os.environ.update(
            AWS_ACCESS_KEY_ID=c.access_key,
            AWS_SECRET_ACCESS_KEY=c.secret_key,
            AWS_DEFAULT_REGION=c.region,
        )
        settings = load_settings(
            {
                "DICOM_INGEST_KAFKA_BOOTSTRAP": "127.0.0.1:9",
                "DICOM_INGEST_OUTPUT_URL": "s3://out/",
                "DICOM_INGEST_S3_ENDPOINT_URL": s3.endpoint_url,
                "DICOM_INGEST_AUDIT_KEY": base64.b64encode(os.urandom(32)).decode(),
            }
        )
        async with S3Source(settings) as source:
            if "--no-network" in sys.argv:

                async def answered(url: str, headers: dict[str, str], body: Any) -> str:
                    await anyio.lowlevel.checkpoint()
                    return '"etag"'

                source.put_from = answered  # type: ignore[method-assign]
            sink = OutputSink(source, settings)
            await one_pass(sink, 0, IN_FLIGHT * 2, values)  # connections, volumes
            for run in range(1, 4):
                before, server = thread_cpu(), process_cpu_s([s3.pid])
                started = time.perf_counter()
                await one_pass(sink, run * count, count, values)
                seconds = time.perf_counter() - started
                groups = by_group(before, thread_cpu())
                server = process_cpu_s([s3.pid]) - server
                shares = ", ".join(
                    f"{name} {cpu / count * 1e3:.3f}"
                    for name, cpu in sorted(groups.items(), key=lambda kv: -kv[1])
                    if cpu > 0
                )
                print(
                    f"{count / seconds:7.0f} objects/s; CPU ms/object: server "
                    f"{server / count * 1e3:.2f}; {shares}",
                    flush=True,
                )


if __name__ == "__main__":
    anyio.run(main)
