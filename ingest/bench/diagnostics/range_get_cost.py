"""What one ranged GET costs SeaweedFS, with and without ``If-Match``.

A diagnostic, not a test (pytest does not collect it)::

    .venv/bin/python -m ingest.bench.diagnostics.range_get_cost [ROUNDS]

It starts the embedded stack, uploads a 256 MiB object in four 64 MiB parts
(a multipart object, as the bench's large object is), and times ROUNDS
(default 40) GETs of 64 KiB and of 8 MiB at scattered offsets on one
keep-alive ``http.client`` connection, once plainly and once with the
``If-Match`` the worker sends, twice each: what a GET costs the server, apart
from what it costs us.
"""

from __future__ import annotations

import http.client
import os
import statistics
import sys
import time
from typing import Any
from urllib.parse import urlsplit

import botocore.config
import botocore.session

from ingest.embedded.stack import embedded_stack

BUCKET, KEY = "range-cost", "object"
PART = 64 << 20
PARTS = 4
SIZES = (64 << 10, 8 << 20)


def client(endpoint: str, region: str, key: str, secret: str) -> Any:
    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint,
        region_name=region,
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        config=botocore.config.Config(signature_version="s3v4", s3={"addressing_style": "path"}),
    )


def upload(s3: Any) -> str:
    s3.create_bucket(Bucket=BUCKET)
    upload_id = s3.create_multipart_upload(Bucket=BUCKET, Key=KEY)["UploadId"]
    parts = []
    for number in range(1, PARTS + 1):
        answer = s3.upload_part(
            Bucket=BUCKET, Key=KEY, UploadId=upload_id, PartNumber=number, Body=os.urandom(PART)
        )
        parts.append({"PartNumber": number, "ETag": answer["ETag"]})
    s3.complete_multipart_upload(
        Bucket=BUCKET, Key=KEY, UploadId=upload_id, MultipartUpload={"Parts": parts}
    )
    return str(s3.head_object(Bucket=BUCKET, Key=KEY)["ETag"])


def time_gets(url: str, size: int, extra: dict[str, str], rounds: int) -> list[float]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.netloc)
    buffer = memoryview(bytearray(size))
    total = PART * PARTS
    seconds = []
    for index in range(rounds):
        start = (index * 7919 * 65536) % (total - size)
        headers = {"Range": f"bytes={start}-{start + size - 1}", **extra}
        began = time.perf_counter()
        conn.request("GET", f"{parts.path}?{parts.query}", headers=headers)
        answer = conn.getresponse()
        got = answer.readinto(buffer)
        seconds.append(time.perf_counter() - began)
        if answer.status != 206 or got != size:
            raise SystemExit(f"GET answered {answer.status} with {got} bytes")
    conn.close()
    return seconds


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    with embedded_stack() as stack:
        c = stack.s3.credentials
        s3 = client(stack.s3.endpoint_url, c.region, c.access_key, c.secret_key)
        etag = upload(s3)
        url = s3.generate_presigned_url(
            "get_object", Params={"Bucket": BUCKET, "Key": KEY}, ExpiresIn=3600
        )
        for size in SIZES:
            for _ in range(2):
                for label, extra in (("plain", {}), ("If-Match", {"If-Match": etag})):
                    ms = [s * 1000.0 for s in time_gets(url, size, extra, rounds)]
                    print(
                        f"{size >> 10:6} KiB {label:8}: median {statistics.median(ms):6.2f} ms, "
                        f"min {min(ms):6.2f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
