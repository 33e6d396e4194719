"""CPU time per ranged GET: ours (``threaded_http.get_into``) against ``http.client``'s objects;
and per presigned URL: ours (SigV4) against botocore's default (SigV2).

A diagnostic, not a test (pytest does not collect it)::

    .venv/bin/python -m ingest.bench.diagnostics.request_cost

A loopback server answers every request with the same S3-like 206 head and a
1 KiB body, so what is measured is the client's Python per request (plus the
tiny server thread, the same for both). The presigning is ``S3Source.locate``
with a loopback endpoint (no request is sent). docs/benchmarks.md quotes it.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session

from ingest.fetch.s3 import S3Source
from ingest.fetch.threaded_http import ConnectionPool, get_into
from ingest.settings import load_settings

BODY = b"x" * 1024
ANSWER = (
    b"HTTP/1.1 206 Partial Content\r\nAccept-Ranges: bytes\r\nContent-Length: 1024\r\n"
    b"Content-Range: bytes 0-1023/1048576\r\nContent-Type: application/octet-stream\r\n"
    b'Etag: "0123456789abcdef0123456789abcdef"\r\n'
    b"Last-Modified: Sat, 21 Nov 2026 10:00:00 GMT\r\nServer: SeaweedFS\r\n"
    b"X-Amz-Request-Id: 1234567890\r\nDate: Sat, 21 Nov 2026 10:00:00 GMT\r\n\r\n" + BODY
)
HEADERS = {"Range": "bytes=0-1023", "If-Match": '"0123456789abcdef0123456789abcdef"'}
PATH = "/bucket/key.dcm?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature=abc"


def serve(listener: socket.socket) -> None:
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=answer, args=(conn,), daemon=True).start()


def answer(conn: socket.socket) -> None:
    pending = b""
    while data := conn.recv(65536):
        pending += data
        while b"\r\n\r\n" in pending:
            pending = pending.partition(b"\r\n\r\n")[2]
            conn.sendall(ANSWER)


def cpu_us(request: Callable[[], None], count: int = 3000) -> float:
    for _ in range(100):
        request()
    started = time.process_time()
    for _ in range(count):
        request()
    return (time.process_time() - started) / count * 1e6


def main() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=serve, args=(listener,), daemon=True).start()
    port = listener.getsockname()[1]
    target = memoryview(bytearray(len(BODY)))
    pool = ConnectionPool(5.0, 5.0, ssl.create_default_context())
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5.0)

    def ours() -> None:
        get_into(pool, f"http://127.0.0.1:{port}{PATH}", HEADERS, target)

    def stdlib() -> None:
        conn.request("GET", PATH, headers=HEADERS)
        response = conn.getresponse()
        response.readinto(target)
        response.read()

    print(f"http.client objects: {cpu_us(stdlib):.0f} us CPU per request")
    print(f"get_into (ours):     {cpu_us(ours):.0f} us CPU per request")
    sigv4, sigv2 = asyncio.run(presign_us())
    print(f"presign, SigV4 (ours):             {sigv4:.0f} us CPU per URL")
    print(f"presign, SigV2 (botocore default): {sigv2:.0f} us CPU per URL")


async def presign_us(count: int = 2000) -> tuple[float, float]:
    """CPU microseconds per ``S3Source.locate``, and per URL with the SigV2 default."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "dicom-ingest")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "dicom-ingest-secret")
    settings = load_settings(
        {
            "DICOM_INGEST_KAFKA_BOOTSTRAP": "127.0.0.1:9092",
            "DICOM_INGEST_OUTPUT_URL": "s3://out/",
            "DICOM_INGEST_AUDIT_KEY": base64.b64encode(bytes(32)).decode(),
            "DICOM_INGEST_S3_ENDPOINT_URL": "http://127.0.0.1:9000",
        }
    )
    async with S3Source(settings) as source:
        await source.locate("bucket", "warm.dcm", None)
        started = time.process_time()
        for n in range(count):
            await source.locate("bucket", f"series/slice-{n}.dcm", None)
        sigv4 = (time.process_time() - started) / count * 1e6
    config = AioConfig(s3={"addressing_style": "path", "payload_signing_enabled": False})
    session = get_session()
    async with session.create_client(
        "s3", endpoint_url="http://127.0.0.1:9000", config=config
    ) as client:
        started = time.process_time()
        for n in range(count):
            await client.generate_presigned_url(
                "get_object", Params={"Bucket": "bucket", "Key": f"series/slice-{n}.dcm"}
            )
        sigv2 = (time.process_time() - started) / count * 1e6
    return sigv4, sigv2


if __name__ == "__main__":
    main()
