"""Health: what the worker knows of itself and its servers, as ``/healthz`` and ``/readyz``.

``/healthz`` answers 200 while the process runs its event loop and its device
thread is not stuck: a work item (a batch, an allocation) that has run on the
device thread for ``DEVICE_STALL_S`` makes it 503, so Kubernetes restarts a
worker whose GPU call hung, which the event loop alone would never show.
``/readyz`` answers 200 only when the consumer is in its group and polling,
the broker answered recently and S3 answered recently; otherwise 503 with the
reasons, as JSON either way. A probe task checks the broker (metadata request)
and S3 (``HeadBucket`` on the output bucket) every few seconds, so an outage
shows while it lasts even when no object is in flight. The same state feeds
the worker's log and the ``health()`` snapshot tests read.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
from aiohttp import web

from ingest.errors import IngestError
from ingest.ops.metrics import metrics_endpoint

log = structlog.get_logger("dicom_ingest.health")

PROBE_INTERVAL_S = 2.0
STALE_AFTER_S = 10.0


@dataclass(slots=True)
class Health:
    """Timestamps (``time.monotonic``) of the last good and bad contact with each dependency."""

    started: float = field(default_factory=time.monotonic)
    last_poll: float | None = None
    assigned: int = 0
    in_group: bool = False
    broker_ok: float | None = None
    broker_error: str | None = None
    s3_ok: float | None = None
    s3_error: str | None = None
    stopping: bool = False
    device_busy_s: Callable[[], float] | None = None  # DeviceThread.busy_s, once it runs
    device_stall_s: float = 300.0

    def liveness_problems(self) -> list[str]:
        """Why the worker should be restarted (empty while it is alive and moving)."""
        busy = self.device_busy_s() if self.device_busy_s is not None else 0.0
        if busy >= self.device_stall_s:
            return [f"device thread stuck in one work item for {busy:.0f} s"]
        return []

    def polled(self, assigned: int) -> None:
        """The consumer polled. This says nothing about the broker: aiokafka's
        ``getmany`` returns empty, without an error, while the broker is down.
        Only the probe's metadata round trip decides ``broker_ok``/``broker_error``.
        """
        self.last_poll = time.monotonic()
        self.assigned = assigned
        self.in_group = True

    def problems(self, now: float | None = None) -> list[str]:
        """Why the worker is not ready (empty when it is)."""
        now = time.monotonic() if now is None else now
        found = []
        if self.stopping:
            found.append("stopping")
        if not self.in_group:
            found.append("not in the consumer group yet")
        if self.last_poll is None or now - self.last_poll > STALE_AFTER_S:
            found.append("not polling")
        if self.broker_error is not None:
            found.append(f"broker unreachable: {self.broker_error}")
        elif self.broker_ok is None or now - self.broker_ok > STALE_AFTER_S:
            found.append("no recent answer from the broker")
        if self.s3_error is not None:
            found.append(f"S3 unreachable: {self.s3_error}")
        elif self.s3_ok is None or now - self.s3_ok > STALE_AFTER_S:
            found.append("no recent answer from S3")
        return found

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        problems = self.problems(now)
        return {
            "ready": not problems,
            "problems": problems,
            "assigned_partitions": self.assigned,
            "uptime_s": round(now - self.started, 3),
        }


async def probe(
    health: Health,
    check_broker: Callable[[], Awaitable[None]],
    check_s3: Callable[[], Awaitable[None]],
) -> None:
    """Check both dependencies every ``PROBE_INTERVAL_S`` until cancelled; a check that
    hangs (a broker that accepts and never answers) times out and counts as a failure."""
    while True:
        for name, check in (("broker", check_broker), ("s3", check_s3)):
            try:
                with anyio.fail_after(PROBE_INTERVAL_S * 2):
                    await check()
            except Exception as exc:
                error = describe(exc)
                if getattr(health, f"{name}_error") is None:
                    log.warning("dependency unreachable", dependency=name, error=error)
                setattr(health, f"{name}_error", error)
            else:
                if getattr(health, f"{name}_error") is not None:
                    log.info("dependency reachable again", dependency=name)
                setattr(health, f"{name}_error", None)
                setattr(health, f"{name}_ok", time.monotonic())
        await anyio.sleep(PROBE_INTERVAL_S)


def describe(exc: BaseException) -> str:
    """A failed check in words: our errors' messages name the server, the resource and
    the code (``HeadBucket 'out' at https://s3...: access denied (403)``); a check that
    hung says so; anything else is its type and message."""
    if isinstance(exc, IngestError):
        return str(exc)
    if isinstance(exc, TimeoutError):
        return f"no answer within {PROBE_INTERVAL_S * 2:g} s"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@asynccontextmanager
async def serving(health: Health, host: str, port: int) -> AsyncIterator[int]:
    """Serve ``/healthz``, ``/readyz`` and ``/metrics`` inside the block; yields the bound port.

    The server lives on the event loop, not in a task of its own, so nothing
    but leaving the block stops it: a probe must see a worker in trouble, not
    a closed port.
    """

    async def healthz(_: web.Request) -> web.Response:
        problems = health.liveness_problems()
        return web.json_response(
            {"alive": not problems, "problems": problems}, status=503 if problems else 200
        )

    async def readyz(_: web.Request) -> web.Response:
        snapshot = health.snapshot()
        return web.Response(
            text=json.dumps(snapshot),
            status=200 if snapshot["ready"] else 503,
            content_type="application/json",
        )

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_endpoint)  # Prometheus (ingest/ops/metrics.py)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        log.info("health endpoints up", host=host, port=bound)
        yield bound
    finally:
        with anyio.CancelScope(shield=True):
            await runner.cleanup()
