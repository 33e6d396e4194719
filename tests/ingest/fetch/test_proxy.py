"""Proxies: every S3 connection goes through ``HTTP(S)_PROXY`` unless ``NO_PROXY`` exempts it.

The proxy is a real one, pproxy, started by a fixture on a loopback port; it
prints a line per connection it forwards (``http <client> -> <target>``), which
is how the tests see that the aiobotocore client's requests and the data
path's own GETs and PUTs (``threaded_http.py``) went through it.
"""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import pytest

from ingest.embedded.server_process import free_ports
from ingest.embedded.stack import Stack
from ingest.errors import ConfigError
from ingest.fetch.proxy import Proxy, proxy_for
from ingest.fetch.s3 import S3Source
from ingest.fetch.threaded_http import ConnectionPool, put_from
from tests import harness

# pproxy installs uvloop when it finds it, and uvloop's loop cannot be made the way it asks
PPROXY = (
    "import asyncio, sys; sys.modules['uvloop'] = None; "
    "asyncio.set_event_loop(asyncio.new_event_loop()); "
    "from pproxy.server import main; main(['-l', sys.argv[1], '-v'])"
)


class HttpProxy:
    """A running pproxy: its URL and the connections it forwarded so far."""

    def __init__(self, url: str, log: Path) -> None:
        self.url = url
        self._log = log

    def forwarded_to(self, port: int) -> int:
        return sum(1 for line in self._log.read_text().splitlines() if line.endswith(f":{port}"))


@pytest.fixture(scope="module")
def http_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpProxy]:
    (port,) = free_ports(1)
    log = tmp_path_factory.mktemp("proxy") / "pproxy.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-u", "-c", PPROXY, f"http://127.0.0.1:{port}"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 20
        while "Serving on" not in log.read_text():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield HttpProxy(f"http://127.0.0.1:{port}", log)
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_the_environment_names_the_proxy_and_no_proxy_exempts() -> None:
    env = {
        "HTTPS_PROXY": "http://alice:s%40fe@proxy.example:3128",
        "http_proxy": "proxy.example:8080",
        "NO_PROXY": "internal.example,10.0.0.7:9000",
    }
    tunnel = proxy_for("https", "s3.eu-west-1.amazonaws.com", env)
    assert tunnel == Proxy("proxy.example", 3128, "Basic YWxpY2U6c0BmZQ==")  # alice:s@fe
    assert tunnel is not None
    assert tunnel.headers() == {"Proxy-Authorization": "Basic YWxpY2U6c0BmZQ=="}
    assert proxy_for("http", "minio:9000", env) == Proxy("proxy.example", 8080)
    assert proxy_for("https", "s3.internal.example", env) is None  # a domain suffix
    assert proxy_for("http", "10.0.0.7:9000", env) is None
    assert proxy_for("https", "s3.amazonaws.com", {}) is None
    assert proxy_for("https", "x", {**env, "NO_PROXY": "*"}) is None
    with pytest.raises(ConfigError, match="HTTPS_PROXY"):
        proxy_for("https", "x", {"HTTPS_PROXY": "http://proxy:notaport"})


@pytest.mark.anyio
@pytest.mark.integration
async def test_client_and_data_connections_go_through_the_proxy_unless_exempt(
    stack: Stack, http_proxy: HttpProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in stack.endpoints.environment().items():
        monkeypatch.setenv(name, value)
    names = harness.make_names("proxy")
    stack.s3.create_bucket(names.source_bucket)
    stack.s3.create_bucket(names.output_bucket)
    data = bytes(range(256)) * 64
    await harness.upload(stack, names.source_bucket, [("a/b.dcm", data)])
    s3_port = urlsplit(stack.s3.endpoint_url).port
    assert s3_port is not None
    settings = harness.make_settings(stack, names)
    for name in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", http_proxy.url)  # the stack's endpoint is http://

    async with S3Source(settings) as source:
        before = http_proxy.forwarded_to(s3_port)
        await source.client.head_bucket(Bucket=names.source_bucket)  # aiobotocore
        after_client = http_proxy.forwarded_to(s3_port)
        where = await source.locate(names.source_bucket, "a/b.dcm", None)
        target = bytearray(len(data))
        head, filled = await source.read_first(where, memoryview(target))  # a GET thread
        after_get = http_proxy.forwarded_to(s3_port)
        url = await source.presign("put_object", Bucket=names.output_bucket, Key="out.npy")
        pool = ConnectionPool(5.0, 5.0, ssl.create_default_context())
        try:  # the sink's PUT, in a thread as the sink does it
            etag = await anyio.to_thread.run_sync(put_from, pool, url, {}, [memoryview(data)])
        finally:
            pool.close()
        after_put = http_proxy.forwarded_to(s3_port)
    assert etag
    assert await harness.get_object(stack, names.output_bucket, "out.npy") == data
    assert after_put > after_get, "the data path's PUT did not use the proxy"
    assert (head.size, bytes(target[:filled])) == (len(data), data)
    assert after_client > before, "the aiobotocore client did not use the proxy"
    assert after_get > after_client, "the data path's GET did not use the proxy"

    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    async with S3Source(settings) as source:
        before = http_proxy.forwarded_to(s3_port)
        where = await source.locate(names.source_bucket, "a/b.dcm", None)
        await source.read_first(where, memoryview(bytearray(len(data))))
        await source.client.head_bucket(Bucket=names.source_bucket)
    assert http_proxy.forwarded_to(s3_port) == before  # exempt: straight to S3


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 that is its own CA, and its key, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert, private = folder / "server.pem", folder / "server.key"
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, private


def test_an_https_endpoint_is_reached_through_a_connect_tunnel(
    http_proxy: HttpProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The data path's https GET goes through the proxy as a CONNECT tunnel, with TLS to
    the server inside it (the certificate is checked against the server's name, not the
    proxy's), and straight to the server when NO_PROXY names it."""
    import http.server
    import threading

    from ingest.fetch.threaded_http import get_into

    body = bytes(range(256)) * 16

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("ETag", '"e1"')
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    cert, key = self_signed(tmp_path)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    serving = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    serving.load_cert_chain(cert, key)
    server.socket = serving.wrap_socket(server.socket, server_side=True)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        for name in ("NO_PROXY", "no_proxy", "HTTP_PROXY", "http_proxy", "https_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTPS_PROXY", http_proxy.url)
        trusting = ssl.create_default_context(cafile=str(cert))
        for exempt, through in ((False, 1), (True, 0)):
            if exempt:
                monkeypatch.setenv("NO_PROXY", "127.0.0.1")
            before = http_proxy.forwarded_to(port)
            pool = ConnectionPool(5.0, 5.0, trusting)
            try:
                target = bytearray(len(body))
                answer = get_into(pool, f"https://127.0.0.1:{port}/obj", {}, memoryview(target))
            finally:
                pool.close()
            assert (answer.status, answer.filled, bytes(target)) == (200, len(body), body)
            assert http_proxy.forwarded_to(port) - before == through
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
