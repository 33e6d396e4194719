"""CPU per object and per GB of four S3 clients reading into ring-slot-sized buffers: ours
(``threaded_http.get_into``), urllib3, awscrt's S3 client and obstore; and whether each one
honours ``HTTPS_PROXY``/``HTTP_PROXY`` and ``NO_PROXY``.

A diagnostic, not a test (pytest does not collect it)::

    .venv/bin/python -m ingest.bench.diagnostics.s3_clients [--objects 600] [--object-kb 500]
        [--large-mib 256] [--range-mib 8] [--concurrency 16] [--rounds 5] [--clients ...]

It starts the embedded stack's S3 server (SeaweedFS alone, on loopback), uploads
``--objects`` small objects (CT slices) and one multipart object of ``--large-mib``, and
reads them with each client in turn, the order rotated round after round:

- small: each object with one ranged GET into a 1 MiB buffer (the worker's small slot);
- large: the object in ``--range-mib`` ranges, each into a buffer of that size (a ring slot).

Every client has ``--concurrency`` GETs in flight on preallocated buffers, one a GET (a
``bytearray`` standing in for pinned memory):

- ``ours``: ``get_into`` on a ``ConnectionPool`` in a thread pool, a URL presigned by
  ``sigv4.presigned_url`` (as ``S3Source.locate`` signs it) per object, the body received
  by the kernel straight into the buffer;
- ``urllib3``: a ``PoolManager`` in the same thread pool, the same presigned URLs,
  ``preload_content=False`` and ``HTTPResponse.readinto`` (which reads ``bytes`` and copies
  them into the buffer: one copy); ``urllib3-fp`` reads the body through the response's
  ``http.client`` object instead (``_fp.readinto``, private: no copy), which tells
  urllib3's cost per request from its copy;
- ``awscrt``: one ``S3Client`` (SigV4 headers, its own event-loop threads, at most
  ``--concurrency`` connections and requests), the GET's ``on_body`` chunks copied into
  the buffer at their offsets (one copy);
- ``obstore``: ``obstore.get_range`` in the thread pool (the Rust runtime does the IO),
  its ``Bytes`` copied into the buffer (one copy). obstore is not a dependency: without
  it (``pip install obstore``) its lines say it was skipped.

Each pass reports the process's CPU (``time.process_time``: the client's own threads
included, the server excluded) per object and per GB, the part of it in the GET threads
(``RUSAGE_THREAD``; the rest is the client's native threads and the waiting main thread;
``-`` for awscrt, whose callbacks run on its own threads),
the server's CPU (``/proc/PID/stat``) and the wall rate; then the median and the range of
the rounds. Each client reads everything once unmeasured first, and that read is checked
against the uploaded bytes. Last, ``--proxy-check`` (on by default) sends one GET with each
client through ``HTTPS_PROXY`` (an ``https`` endpoint) and ``HTTP_PROXY`` (an ``http`` one)
to a loopback listener, with and without ``NO_PROXY=127.0.0.1``, and says where the
connection went; the proxy variables are otherwise removed for the whole run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import importlib
import math
import os
import resource
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from importlib.metadata import version
from types import ModuleType
from typing import Any, cast

import botocore.config
import botocore.session
import urllib3

from ingest.embedded.stack import S3Credentials, start_seaweedfs
from ingest.fetch.sigv4 import Address, Keys, presigned_url
from ingest.fetch.threaded_http import ConnectionPool, get_into

BUCKET = "s3-clients"
MiB = 1 << 20
SMALL_SLOT = MiB  # the worker's small slot for an object's first GET
CLOCK_TICK = os.sysconf("SC_CLK_TCK")
PROXY_VARIABLES = ("https_proxy", "http_proxy", "no_proxy", "all_proxy")
CLIENTS = ("ours", "urllib3", "urllib3-fp", "awscrt", "obstore")


@dataclass(frozen=True, slots=True)
class Get:
    """One ranged GET: ``length`` bytes of ``key`` from ``start``."""

    key: str
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class Endpoint:
    url: str  # scheme://host:port
    credentials: S3Credentials

    def presign(self, key: str) -> str:
        """The GET URL ``S3Source.locate`` would give (SigV4 query, 15 minutes)."""
        c = self.credentials
        return presigned_url(
            "GET",
            Address.of(f"{self.url}/{BUCKET}/{key}"),
            [],
            {},
            Keys(c.access_key, c.secret_key),
            c.region,
            "s3",
            900,
            datetime.now(UTC),
        )


def optional(name: str) -> ModuleType | None:
    """The module, or None when it is not installed (the diagnostic then skips its client)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def thread_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime + usage.ru_stime


class Client:
    """A client reading ``Get``s into caller buffers, ``concurrency`` at a time."""

    name = ""
    copies = ""  # what lies between the socket and the buffer

    def __init__(self, endpoint: Endpoint, concurrency: int) -> None:
        self.endpoint = endpoint
        self.concurrency = concurrency
        self.thread_seconds = 0.0  # CPU of the GET threads over the last ``read_all``
        self._lock = threading.Lock()

    def read_all(
        self, gets: Sequence[Get], slot_size: int, check: Callable[[Get, memoryview], None] | None
    ) -> None:
        """Read every GET into a buffer of ``slot_size``; ``check`` each one if given.

        Raises:
            RuntimeError: a GET failed or answered the wrong length.
        """
        raise NotImplementedError

    def close(self) -> None:
        pass


class Threaded(Client):
    """GETs on a thread pool, each thread with its own slot buffer."""

    def __init__(self, endpoint: Endpoint, concurrency: int) -> None:
        super().__init__(endpoint, concurrency)
        self._threads = ThreadPoolExecutor(concurrency, f"get-{self.name}")
        self._local = threading.local()

    def read_all(
        self, gets: Sequence[Get], slot_size: int, check: Callable[[Get, memoryview], None] | None
    ) -> None:
        self.thread_seconds = 0.0
        urls: dict[str, str] = {}  # one URL an object, as the worker signs one per object

        def one(get: Get) -> None:
            began = thread_cpu()
            slot = getattr(self._local, "slot", None)
            if slot is None or len(slot) != slot_size:
                slot = self._local.slot = memoryview(bytearray(slot_size))
            url = urls.get(get.key)
            if url is None:
                url = urls[get.key] = self.endpoint.presign(get.key)
            target = slot[: get.length]
            got = self.get(url, get, target)
            if got != get.length:
                raise RuntimeError(f"{self.name}: {got} bytes for {get.length}")
            if check is not None:
                check(get, target)
            spent = thread_cpu() - began
            with self._lock:
                self.thread_seconds += spent

        for _ in self._threads.map(one, gets):
            pass

    def get(self, url: str, get: Get, target: memoryview) -> int:
        raise NotImplementedError

    def close(self) -> None:
        self._threads.shutdown()


def range_header(get: Get) -> dict[str, str]:
    return {"Range": f"bytes={get.start}-{get.start + get.length - 1}"}


class Ours(Threaded):
    name = "ours"
    copies = "none: recv(MSG_WAITALL) into the buffer"

    def __init__(self, endpoint: Endpoint, concurrency: int) -> None:
        super().__init__(endpoint, concurrency)
        import ssl

        self._pool = ConnectionPool(10.0, 30.0, ssl.create_default_context())

    def get(self, url: str, get: Get, target: memoryview) -> int:
        return get_into(self._pool, url, range_header(get), target).filled

    def close(self) -> None:
        super().close()
        self._pool.close()


class Urllib3(Threaded):
    name = "urllib3"
    copies = "one: readinto reads bytes, then copies them"

    def __init__(self, endpoint: Endpoint, concurrency: int) -> None:
        super().__init__(endpoint, concurrency)
        self._pools = urllib3.PoolManager(
            maxsize=concurrency, block=True, retries=False, timeout=urllib3.Timeout(10.0, 30.0)
        )

    def get(self, url: str, get: Get, target: memoryview) -> int:
        response = self._pools.request("GET", url, headers=range_header(get), preload_content=False)
        try:
            if response.status != 206:
                raise RuntimeError(f"urllib3: S3 answered {response.status}")
            filled = 0
            while filled < len(target) and (n := response.readinto(target[filled:])):
                filled += n
            return filled
        finally:
            response.release_conn()


class Urllib3Fp(Urllib3):
    """urllib3 reading through its response's ``http.client`` object (``_fp``, private):
    what urllib3 costs without the copy of its ``readinto``."""

    name = "urllib3-fp"
    copies = "none: http.client's readinto into the buffer"

    def get(self, url: str, get: Get, target: memoryview) -> int:
        response = self._pools.request("GET", url, headers=range_header(get), preload_content=False)
        try:
            if response.status != 206:
                raise RuntimeError(f"urllib3: S3 answered {response.status}")
            raw = cast(urllib3.HTTPResponse, response)._fp
            assert raw is not None
            filled = 0
            while filled < len(target) and (n := raw.readinto(target[filled:])):
                filled += n
            return filled
        finally:
            response.release_conn()

    def close(self) -> None:
        super().close()
        self._pools.clear()


class Obstore(Threaded):
    name = "obstore"
    copies = "one here: the Bytes it returns copied into the buffer"

    def __init__(self, endpoint: Endpoint, concurrency: int) -> None:
        super().__init__(endpoint, concurrency)
        self._obstore: Any = importlib.import_module("obstore")
        store: Any = importlib.import_module("obstore.store")
        c = endpoint.credentials
        self._store = store.S3Store(
            BUCKET,
            endpoint=endpoint.url,
            access_key_id=c.access_key,
            secret_access_key=c.secret_key,
            region=c.region,
            virtual_hosted_style_request=False,
            client_options={"allow_http": True, "pool_max_idle_per_host": str(concurrency)},
            retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=30)},
        )

    def get(self, url: str, get: Get, target: memoryview) -> int:
        data = self._obstore.get_range(self._store, get.key, start=get.start, length=get.length)
        view = memoryview(data)
        target[: len(view)] = view
        return len(view)


class Crt(Client):
    """awscrt's S3 client: up to ``concurrency`` meta requests in flight, ``on_body`` copying
    each chunk into the request's buffer."""

    name = "awscrt"
    copies = "two: the binding hands each chunk over as new bytes, copied into the buffer"

    def __init__(self, endpoint: Endpoint, concurrency: int) -> None:
        super().__init__(endpoint, concurrency)
        from awscrt.auth import AwsCredentialsProvider
        from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
        from awscrt.s3 import S3Client, S3RequestTlsMode, create_default_s3_signing_config

        c = endpoint.credentials
        self._https = endpoint.url.startswith("https://")
        self._host = endpoint.url.split("://", 1)[1]
        loops = EventLoopGroup()
        bootstrap = ClientBootstrap(loops, DefaultHostResolver(loops))
        provider = AwsCredentialsProvider.new_static(c.access_key, c.secret_key)
        self._client = S3Client(
            bootstrap=bootstrap,
            region=c.region,
            signing_config=create_default_s3_signing_config(
                region=c.region, credential_provider=provider
            ),
            tls_mode=S3RequestTlsMode.ENABLED if self._https else S3RequestTlsMode.DISABLED,
            part_size=8 * MiB,
            throughput_target_gbps=10.0,
            max_active_connections_override=concurrency,
        )
        self.chunk_type = ""

    def read_all(
        self, gets: Sequence[Get], slot_size: int, check: Callable[[Get, memoryview], None] | None
    ) -> None:
        from awscrt.http import HttpHeaders, HttpRequest
        from awscrt.s3 import S3RequestType

        self.thread_seconds = math.nan  # the work is on its own threads, the copies too
        free = [memoryview(bytearray(slot_size)) for _ in range(self.concurrency)]
        permits = threading.Semaphore(self.concurrency)
        failures: list[str] = []
        in_flight: list[Future[None]] = []
        for get in gets:
            permits.acquire()
            with self._lock:
                slot = free.pop()
            target = slot[: get.length]
            filled = [0]

            def on_body(
                chunk: Any,
                offset: int,
                target: memoryview = target,
                filled: list[int] = filled,
                start: int = get.start,
                **_: Any,
            ) -> None:
                if not self.chunk_type:
                    self.chunk_type = type(chunk).__name__
                view = memoryview(chunk)
                at = offset - start  # the offset is in the object, not in the range
                target[at : at + len(view)] = view
                filled[0] += len(view)

            def on_done(
                error: BaseException | None = None,
                status_code: int | None = None,
                get: Get = get,
                slot: memoryview = slot,
                target: memoryview = target,
                filled: list[int] = filled,
                **_: Any,
            ) -> None:
                try:
                    if error is not None or filled[0] != get.length:
                        failures.append(f"{status_code} {error!r} {filled[0]}/{get.length}")
                    elif check is not None:
                        check(get, target)
                finally:
                    with self._lock:
                        free.append(slot)
                    permits.release()

            headers = HttpHeaders(
                [("Host", self._host), *range_header(get).items()]  # the port, if any
            )
            request = HttpRequest("GET", f"/{BUCKET}/{get.key}", headers)
            meta = self._client.make_request(
                type=S3RequestType.GET_OBJECT, request=request, on_body=on_body, on_done=on_done
            )
            in_flight.append(meta.finished_future)
        for future in in_flight:
            future.result()
        if failures:
            raise RuntimeError(f"awscrt: {len(failures)} GETs failed, first: {failures[0]}")


MAKERS: dict[str, Callable[[Endpoint, int], Client]] = {
    "ours": Ours,
    "urllib3": Urllib3,
    "urllib3-fp": Urllib3Fp,
    "awscrt": Crt,
    "obstore": Obstore,
}
NEEDS = {
    "ours": "ingest",
    "urllib3": "urllib3",
    "urllib3-fp": "urllib3",
    "awscrt": "awscrt.s3",
    "obstore": "obstore",
}


def process_cpu(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


@dataclass(frozen=True, slots=True)
class Pass:
    client: str
    shape: str
    objects: int
    nbytes: int
    wall_s: float
    cpu_s: float
    thread_cpu_s: float
    server_cpu_s: float

    def line(self) -> str:
        gb = self.nbytes / 1e9
        threads = "-" if math.isnan(self.thread_cpu_s) else f"{self.thread_cpu_s / gb:.3f}"
        return (
            f"{self.client:10} {self.shape:5}: "
            f"{self.cpu_s * 1e3 / self.objects:7.3f} ms CPU/object "
            f"{self.cpu_s / gb:6.3f} core-s/GB (GET threads {threads:>6}), "
            f"server {self.server_cpu_s / (self.nbytes / 1e9):6.3f} core-s/GB, "
            f"{self.objects / self.wall_s:7.1f} GETs/s {self.nbytes / self.wall_s / 1e9:5.2f} GB/s"
        )


def measure(
    client: Client, shape: str, gets: Sequence[Get], slot_size: int, server_pid: int
) -> Pass:
    gc.collect()
    server0 = process_cpu(server_pid)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    client.read_all(gets, slot_size, None)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    server = process_cpu(server_pid) - server0
    nbytes = sum(g.length for g in gets)
    return Pass(client.name, shape, len(gets), nbytes, wall, cpu, client.thread_seconds, server)


def summary(passes: Sequence[Pass]) -> str:
    def spread(values: list[float], fmt: str) -> str:
        return (
            f"{format(statistics.median(values), fmt)} "
            f"[{format(min(values), fmt)}-{format(max(values), fmt)}]"
        )

    first = passes[0]
    gb = first.nbytes / 1e9
    in_threads = [p.thread_cpu_s / gb for p in passes]
    threads = "-" if math.isnan(in_threads[0]) else spread(in_threads, ".3f")
    return (
        f"{first.client:10} {first.shape:5}: "
        f"CPU/object {spread([p.cpu_s * 1e3 / p.objects for p in passes], '.3f')} ms, "
        f"{spread([p.cpu_s / gb for p in passes], '.3f')} core-s/GB "
        f"(GET threads {threads}), "
        f"server {spread([p.server_cpu_s / gb for p in passes], '.2f')} core-s/GB, "
        f"{spread([p.objects / p.wall_s for p in passes], '.0f')} GETs/s, "
        f"{spread([p.nbytes / p.wall_s / 1e9 for p in passes], '.2f')} GB/s"
    )


def upload(
    endpoint: Endpoint, objects: int, object_size: int, large_size: int
) -> tuple[dict[str, bytes], bytes]:
    """Put the small objects and the large one (multipart, 64 MiB parts); the small ones'
    digests and the large one's bytes."""
    c = endpoint.credentials
    s3: Any = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint.url,
        region_name=c.region,
        aws_access_key_id=c.access_key,
        aws_secret_access_key=c.secret_key,
        config=botocore.config.Config(
            signature_version="s3v4", s3={"addressing_style": "path"}, max_pool_connections=8
        ),
    )
    s3.create_bucket(Bucket=BUCKET)
    digests: dict[str, bytes] = {}

    def put(index: int) -> None:
        body = os.urandom(object_size)
        key = f"series/slice-{index:05}.dcm"
        s3.put_object(Bucket=BUCKET, Key=key, Body=body)
        digests[key] = hashlib.blake2b(body).digest()

    with ThreadPoolExecutor(8) as threads:
        for _ in threads.map(put, range(objects)):
            pass
    part = 64 * MiB
    large = os.urandom(large_size)
    upload_id = s3.create_multipart_upload(Bucket=BUCKET, Key="large")["UploadId"]
    parts = []
    for number, start in enumerate(range(0, large_size, part), 1):
        answer = s3.upload_part(
            Bucket=BUCKET,
            Key="large",
            UploadId=upload_id,
            PartNumber=number,
            Body=large[start : start + part],
        )
        parts.append({"PartNumber": number, "ETag": answer["ETag"]})
    s3.complete_multipart_upload(
        Bucket=BUCKET, Key="large", UploadId=upload_id, MultipartUpload={"Parts": parts}
    )
    return digests, large


def checker(digests: dict[str, bytes], large: bytes) -> Callable[[Get, memoryview], None]:
    """What checks a GET's bytes against the uploaded ones (small: digests, large: bytes)."""

    def check(get: Get, data: memoryview) -> None:
        if get.key == "large":
            ok = data == memoryview(large)[get.start : get.start + get.length]
        else:
            ok = hashlib.blake2b(data).digest() == digests[get.key]
        if not ok:
            raise RuntimeError(f"wrong bytes for {get}")

    return check


# --- the proxy check -------------------------------------------------------------------------


class Listener:
    """A loopback listener that notes the first line of what each connection sends."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self.seen: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.settimeout(2.0)
            try:
                data = conn.recv(4096)
            except OSError:
                data = b""
            line = data.split(b"\r\n", 1)[0]
            self.seen.append(line.decode("latin-1") if line.isascii() else "(TLS handshake)")
            conn.close()

    def close(self) -> None:
        self._sock.close()


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in (*values, *(v.upper() for v in values))}
    for name, value in values.items():
        os.environ[name] = os.environ[name.upper()] = value
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def proxy_check(names: Sequence[str], credentials: S3Credentials) -> list[str]:
    """Where each client's one GET went, for each scheme, with and without ``NO_PROXY``."""
    lines = []
    for scheme in ("https", "http"):
        for no_proxy in ("", "127.0.0.1"):
            for name in names:
                proxy, server = Listener(), Listener()
                settings = {f"{scheme}_proxy": f"http://127.0.0.1:{proxy.port}"}
                if no_proxy:
                    settings["no_proxy"] = no_proxy
                endpoint = Endpoint(f"{scheme}://127.0.0.1:{server.port}", credentials)
                with environment(settings):
                    client = MAKERS[name](endpoint, 1)  # clients read the variables when made
                    with contextlib.suppress(Exception):  # the listeners answer nothing
                        client.read_all([Get("probe", 0, 16)], 16, None)
                    client.close()
                time.sleep(0.3)
                if proxy.seen:
                    went = f"proxy ({proxy.seen[0].split('?')[0]})"
                else:
                    went = "direct" if server.seen else "nowhere"
                lines.append(
                    f"{name:10} {scheme:5} {scheme.upper()}_PROXY"
                    f"{' NO_PROXY=' + no_proxy if no_proxy else '':22}: {went}"
                )
                proxy.close()
                server.close()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=600)
    parser.add_argument("--object-kb", type=int, default=500, help="small object size, KB")
    parser.add_argument("--large-mib", type=int, default=256)
    parser.add_argument("--range-mib", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--no-proxy-check", dest="proxy_check", action="store_false")
    args = parser.parse_args()
    for name in [*PROXY_VARIABLES, *(v.upper() for v in PROXY_VARIABLES)]:
        os.environ.pop(name, None)  # every connection here goes straight to loopback

    names = []
    for name in args.clients.split(","):
        if name not in MAKERS:
            parser.error(f"--clients: {name!r} is not one of {', '.join(CLIENTS)}")
        if optional(NEEDS[name]) is None:
            print(f"{name}: skipped, {NEEDS[name]} is not installed", flush=True)
        else:
            names.append(name)
    versions = [f"{n} {version(n)}" for n in ("urllib3", "awscrt", "obstore") if n in names]
    print(
        f"versions: {', '.join(versions) or '-'}; {os.cpu_count()} CPUs; "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        flush=True,
    )
    object_size = args.object_kb * 1000
    large_size = args.large_mib * MiB
    range_size = args.range_mib * MiB
    small = [Get(f"series/slice-{i:05}.dcm", 0, object_size) for i in range(args.objects)]
    large = [
        Get("large", s, min(range_size, large_size - s)) for s in range(0, large_size, range_size)
    ]
    credentials = S3Credentials()
    with start_seaweedfs(credentials=credentials) as s3:
        endpoint = Endpoint(s3.endpoint_url, credentials)
        began = time.perf_counter()
        digests, large_bytes = upload(endpoint, args.objects, object_size, large_size)
        print(f"uploaded in {time.perf_counter() - began:.1f} s", flush=True)
        check = checker(digests, large_bytes)
        clients = {name: MAKERS[name](endpoint, args.concurrency) for name in names}
        for client in clients.values():
            client.read_all(small, SMALL_SLOT, check)  # warm, and checked
            client.read_all(large, range_size, check)
            print(f"{client.name:10}: read and checked; copies: {client.copies}", flush=True)
        crt = clients.get("awscrt")
        if isinstance(crt, Crt):
            print(f"awscrt on_body chunks are {crt.chunk_type}", flush=True)
        time.sleep(2.0)  # what the warm-ups left behind (closing, collecting) is done
        passes: dict[tuple[str, str], list[Pass]] = {}
        for round_ in range(args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]  # rotated
            for name in order:
                for shape, gets, slot in (
                    ("small", small, SMALL_SLOT),
                    ("large", large, range_size),
                ):
                    result = measure(clients[name], shape, gets, slot, s3.pid)
                    passes.setdefault((name, shape), []).append(result)
                    print(f"round {round_ + 1} {result.line()}", flush=True)
        for client in clients.values():
            client.close()
    print(
        f"\nmedian [min-max] of {args.rounds} rounds, {args.concurrency} GETs in flight; "
        f"small: {args.objects} x {object_size} B into 1 MiB; "
        f"large: {args.large_mib} MiB in {args.range_mib} MiB ranges"
    )
    for shape in ("small", "large"):
        for name in names:
            print(summary(passes[(name, shape)]))
    if args.proxy_check:
        print(
            "\nwhere one GET went (a loopback proxy and a loopback endpoint that answer nothing):"
        )
        for line in proxy_check(names, credentials):
            print(line, flush=True)


if __name__ == "__main__":
    main()
