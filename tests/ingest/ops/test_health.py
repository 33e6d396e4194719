"""Readiness logic (pure): what makes the worker not ready, and the HTTP answers."""

from __future__ import annotations

import anyio
import pytest
from aiohttp import ClientSession

from ingest.ops.health import STALE_AFTER_S, Health, serving


def test_ready_only_when_polling_and_both_servers_answered() -> None:
    h = Health(started=0.0)
    assert "not in the consumer group yet" in h.problems(now=1.0)
    h.polled(assigned=2)
    assert any("broker" in p for p in h.problems())  # polling proves nothing about the broker
    h.broker_ok = h.s3_ok = h.last_poll
    assert h.problems(now=h.last_poll) == []
    now = (h.last_poll or 0.0) + STALE_AFTER_S + 1
    assert "not polling" in h.problems(now=now)
    h.broker_error = "KafkaConnectionError"
    assert any("broker unreachable" in p for p in h.problems())
    h.broker_error, h.s3_error = None, "EndpointConnectionError"
    assert any("S3 unreachable" in p for p in h.problems())
    h.stopping = True
    assert "stopping" in h.problems()


@pytest.mark.anyio
async def test_endpoints_answer_200_and_503() -> None:
    h = Health()
    async with serving(h, "127.0.0.1", 0) as port, ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
            assert resp.status == 200
        async with http.get(f"http://127.0.0.1:{port}/readyz") as resp:
            assert resp.status == 503
            assert (await resp.json())["ready"] is False
        h.polled(assigned=1)
        h.broker_ok = h.s3_ok = h.last_poll
        async with http.get(f"http://127.0.0.1:{port}/readyz") as resp:
            assert resp.status == 200
    with pytest.raises(OSError, match="connection attempts failed"):  # the port is closed
        await anyio.connect_tcp("127.0.0.1", port)
