"""The bench's configuration (``dicom-ingest bench`` flags) and what a worker of ours
runs with for one run: its S3 target and its ``DICOM_INGEST_*`` environment."""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from pathlib import Path

from ingest.bench.ours import HOOK_SPEC
from ingest.bench.workloads import CORPUS, DECODE_WORKLOADS, FETCH_WORKLOADS, S3Target
from ingest.embedded.stack import Stack
from ingest.settings import Settings, load_settings

WORKLOADS = FETCH_WORKLOADS  # the default; the decode workloads run when named
ALL_WORKLOADS = (*FETCH_WORKLOADS, CORPUS, *DECODE_WORKLOADS)
READERS = (
    "curl",
    "threads",
    "kvikio-raw",
    "naive",
    "kvikio",
    "pydicom-loop",
    "cpu-pool",
    "nvimgcodec",
    "nvimgcodec-plugin",
    "put-raw",
    "ours",
    "ours-hook",
)
OURS_MODES = {"ours": {"SINK": "s3"}, "ours-hook": {"SINK": "none", "HOOK": HOOK_SPEC}}
SCALED_MODES = ("ours-hook", "ours")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    out: Path = Path("bench-results")
    endpoint: str | None = None
    bootstrap: str | None = None
    workloads: tuple[str, ...] = WORKLOADS
    readers: tuple[str, ...] = READERS
    ct_count: int = 300
    large_mb: int = 1024
    large_syntax: str = "native"  # or "encapsulated": Encapsulated Uncompressed, past 4 GiB
    slide_mb: int = 200  # MiB of JPEG tiles in the slide workload
    decode_corpus: Path | None = None  # the decode workloads' objects, written beforehand
    repeats: int = 3
    part_mb: int = 8
    concurrency: int = 16
    sweep: bool = False
    sweep_parts_mb: tuple[int, ...] = (1, 4, 8, 16, 32)
    sweep_concurrency: tuple[int, ...] = (4, 8, 16, 32)
    sweep_mode: str = "ours-hook"  # or "ours" (sink on)
    device: str = "auto"
    plots: bool = True
    worker_settings: tuple[tuple[str, str], ...] = ()  # extra DICOM_INGEST_* for ours
    processes: tuple[int, ...] = ()  # scaled mode: N worker processes per run; () = not run
    gpus: str = ""  # scaled mode: --gpus of the workers, e.g. "0,1"
    scaled_modes: tuple[str, ...] = SCALED_MODES
    paced_rate: float = 0.0  # objects/s of the CT latency pass; 0: half the median burst rate


def s3_target(config: BenchConfig, stack: Stack | None, token: str) -> S3Target:
    if stack is not None:
        c = stack.endpoints.credentials
        endpoint, region, key, secret = stack.s3.endpoint_url, c.region, c.access_key, c.secret_key
    else:
        import botocore.session

        session = botocore.session.get_session()
        creds = session.get_credentials()
        if creds is None or config.endpoint is None:
            raise SystemExit("bench --endpoint needs AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
        frozen = creds.get_frozen_credentials()
        endpoint, key, secret = config.endpoint, frozen.access_key, frozen.secret_key
        region = session.get_config_variable("region") or "us-east-1"
    return S3Target(endpoint, region, key, secret, f"bench-{token}-src", f"bench-{token}-out")


def worker_environment(
    config: BenchConfig,
    target: S3Target,
    bootstrap: str,
    token: str,
    label: str,
    mode: str,
    **tune: int,
) -> dict[str, str]:
    """The ``DICOM_INGEST_*`` of a worker of ours for one run (topic and group of its own)."""
    env = {
        "DICOM_INGEST_KAFKA_BOOTSTRAP": bootstrap,
        "DICOM_INGEST_S3_ENDPOINT_URL": target.endpoint_url,
        "DICOM_INGEST_OUTPUT_URL": f"s3://{target.output_bucket}/out/",
        "DICOM_INGEST_AUDIT_KEY": base64.b64encode(os.urandom(32)).decode(),
        "DICOM_INGEST_SOURCE_TOPIC": f"bench-{token}-{label}-events",
        "DICOM_INGEST_RESULTS_TOPIC": f"bench-{token}-results",
        "DICOM_INGEST_DLQ_TOPIC": f"bench-{token}-dlq",
        "DICOM_INGEST_AUDIT_TOPIC": f"bench-{token}-audit",
        "DICOM_INGEST_GROUP_ID": f"bench-{token}-{label}",
        "DICOM_INGEST_WORKER_ID": f"bench-{label}",
        "DICOM_INGEST_DEVICE": config.device,
        # Tansu holds each JoinGroup for about half the session timeout (docs/operations.md,
        # "Start-up"), so the bench's groups form in a second; Kafka would refuse these values.
        "DICOM_INGEST_SESSION_TIMEOUT_MS": "2000",
        "DICOM_INGEST_HEARTBEAT_INTERVAL_MS": "200",
        "DICOM_INGEST_SHUTDOWN_DEADLINE_S": "30",
        "DICOM_INGEST_FETCH_CONCURRENCY": str(tune.get("concurrency", config.concurrency)),
    }
    if "part" in tune:  # the sweep; otherwise ours runs at the worker's default part size
        env["DICOM_INGEST_PART_SIZE"] = str(tune["part"])
    env.update({f"DICOM_INGEST_{k}": v for k, v in OURS_MODES[mode].items()})
    env.update({f"DICOM_INGEST_{k.upper()}": v for k, v in config.worker_settings})
    return env


def worker_settings(
    config: BenchConfig,
    target: S3Target,
    bootstrap: str,
    token: str,
    label: str,
    mode: str,
    **tune: int,
) -> Settings:
    return load_settings(worker_environment(config, target, bootstrap, token, label, mode, **tune))
