"""SeaweedFS's CPU per PUT of float32 CT output, by the request's shape; and this
process's CPU per PUT (``threaded_http.put_from``, the sink's transport).

A diagnostic, not a test (pytest does not collect it)::

    .venv/bin/python -m ingest.bench.diagnostics.put_shapes [PUTS]

It starts SeaweedFS as the stack does and PUTs, from eight threads, the output
values of synthetic CT slices (the naive path's float32, as the sink writes them)
and random bytes of the same size, as: one PUT of 1 MiB with each Content-Type
the sink might send (or none); and multipart parts of 8 MiB, without a
Content-Type and with the ``.npy``'s (``ingest.sink.output.NPY_TYPE``). For
each it prints the server's CPU per PUT (``/proc/PID/stat``), PUTs/s, and this
process's CPU per PUT (presigning, ``http.client``, the kernel's copies).

Why: SeaweedFS sniffs a request that names no Content-Type and gzips each chunk
whose first 128 bytes compress; CT values do (air is one value), and a part
without a Content-Type cost it ~1.6x the CPU of one with it. docs/benchmarks.md
("Outputs to S3") quotes it.
"""

from __future__ import annotations

import concurrent.futures
import resource
import ssl
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from ingest.bench.measure import process_cpu_s
from ingest.bench.readers import naive_values
from ingest.embedded.samples import synthetic_ct_series
from ingest.embedded.stack import SeaweedFS, _s3_client, start_seaweedfs
from ingest.fetch.sigv4 import Address, Keys, presigned_url
from ingest.fetch.threaded_http import ConnectionPool, put_from
from ingest.sink.output import NPY_TYPE

THREADS = 8
SLICES = 32
Put = Callable[[int], None]


def ct_outputs(count: int) -> list[np.ndarray]:
    """The float32 output bytes of ``count`` synthetic CT slices (1 MiB each)."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "slice.dcm"
        for _, data in synthetic_ct_series(count):
            path.write_bytes(data)
            out.append(naive_values(str(path)).reshape(-1).view(np.uint8))
    return out


class Putter:
    """Presigned PUTs to bucket ``out`` of ``s3`` on one keep-alive pool."""

    def __init__(self, s3: SeaweedFS) -> None:
        self._s3 = s3
        c = s3.credentials
        self._keys, self._region = Keys(c.access_key, c.secret_key), c.region
        self.pool = ConnectionPool(10.0, 120.0, ssl.create_default_context())

    def put(
        self, key: str, body: np.ndarray, ctype: str | None, part: tuple[int, str] | None
    ) -> None:
        """One PUT of ``body``, with ``ctype`` (signed on a single PUT), or one part
        (number, upload id) of a multipart upload, ``ctype`` sent unsigned as the sink does."""
        headers = {"Content-Type": ctype} if ctype else {}
        query = [("partNumber", str(part[0])), ("uploadId", part[1])] if part else []
        address = Address.of(f"{self._s3.endpoint_url}/out/{key}")
        signed = {} if part else headers
        now = datetime.now(UTC)
        url = presigned_url(
            "PUT", address, query, signed, self._keys, self._region, "s3", 3600, now
        )
        put_from(self.pool, url, headers, [body.data])

    def singles(self, prefix: str, bodies: list[np.ndarray], ctype: str | None) -> Put:
        """PUT ``i``: ``bodies[i]`` (round) as its own object."""
        return lambda i: self.put(f"{prefix}/{i}", bodies[i % len(bodies)], ctype, None)

    def parts(self, key: str, upload: str, bodies: list[np.ndarray], ctype: str | None) -> Put:
        """PUT ``i``: ``bodies[i]`` (round) as part ``i + 1`` of ``upload``."""
        return lambda i: self.put(key, bodies[i % len(bodies)], ctype, (i + 1, upload))


def measure(label: str, server_pid: int, count: int, one: Put) -> None:
    server = process_cpu_s([server_pid])
    ours = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(one, range(count)))
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    client = after.ru_utime + after.ru_stime - ours.ru_utime - ours.ru_stime
    server = process_cpu_s([server_pid]) - server
    print(
        f"{label:52s} server {server / count * 1e3:7.2f} ms/PUT  {count / seconds:6.0f} PUT/s  "
        f"this process {client / count * 1e3:5.2f} ms/PUT",
        flush=True,
    )


def main() -> None:
    puts = int(sys.argv[1]) if len(sys.argv) > 1 else 192
    ct = ct_outputs(SLICES)
    rng = np.random.default_rng(0)
    noise = [np.frombuffer(rng.bytes(len(ct[0])), np.uint8) for _ in range(8)]
    parts = [np.concatenate(ct[i : i + 8]) for i in range(0, SLICES, 8)]
    with tempfile.TemporaryDirectory() as work, start_seaweedfs(Path(work)) as s3:
        s3.create_bucket("out")
        putter = Putter(s3)
        client = _s3_client(s3.endpoint_url, s3.credentials)
        for run in range(2):  # the first run warms the server's volumes up
            for n, ctype in enumerate((NPY_TYPE, None, "application/x-npy")):
                for kind, bodies in (("CT values", ct), ("random", noise)):
                    single = putter.singles(f"{run}/{kind[:2]}/{n}", bodies, ctype)
                    measure(f"PUT 1 MiB {kind}, Content-Type {ctype}", s3.pid, puts, single)
            for n, ctype in enumerate((None, NPY_TYPE)):
                key = f"{run}/parts/{n}"
                upload = client.create_multipart_upload(Bucket="out", Key=key, ContentType=NPY_TYPE)
                up = str(upload["UploadId"])
                part = putter.parts(key, up, parts, ctype)
                label = f"upload_part 8 MiB CT values, Content-Type {ctype}"
                measure(label, s3.pid, max(1, puts // 8), part)
                client.abort_multipart_upload(Bucket="out", Key=key, UploadId=up)
        putter.pool.close()
        client.close()


if __name__ == "__main__":
    main()
