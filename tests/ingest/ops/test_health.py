"""Readiness logic (pure): what makes the worker not ready, and the HTTP answers."""

from __future__ import annotations

import anyio
import pytest
from aiohttp import ClientSession

from ingest.embedded.stack import Stack
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


@pytest.mark.anyio
@pytest.mark.integration
async def test_s3_failures_are_named_by_code_bucket_and_endpoint(stack: Stack) -> None:
    """The readiness probe's S3 check against the real server: a missing bucket and a
    wrong secret read differently, each with the bucket and the endpoint."""
    from aiobotocore.session import get_session

    from ingest.fetch.s3 import translate_s3_error
    from ingest.ops.health import describe

    creds = stack.endpoints.credentials
    where = f"HeadBucket 'nowhere' at {stack.s3.endpoint_url}"

    async def failure(secret: str, bucket: str, operation: str = "head_bucket") -> str:
        client = get_session().create_client(
            "s3",
            endpoint_url=stack.s3.endpoint_url,
            aws_access_key_id=creds.access_key,
            aws_secret_access_key=secret,
            region_name=creds.region,
        )
        async with client as s3:
            try:
                if operation == "head_bucket":
                    await s3.head_bucket(Bucket=bucket)
                else:
                    await s3.get_object(Bucket=bucket, Key="k")
            except Exception as exc:
                return describe(translate_s3_error(exc, where))
        raise AssertionError("the call succeeded")

    assert await failure(creds.secret_key, "nowhere") == f"{where}: not found (404)"
    assert await failure("wrong" + creds.secret_key, "nowhere") == f"{where}: access denied (403)"
    assert await failure("wrong" + creds.secret_key, "nowhere", "get_object") == (
        f"{where}: access denied (SignatureDoesNotMatch: the secret key does not match the "
        "access key)"
    )


def test_a_check_that_hangs_or_fails_is_described() -> None:
    from ingest.errors import ObjectNotFound
    from ingest.ops.health import describe

    assert describe(TimeoutError()) == "no answer within 4 s"
    assert describe(ObjectNotFound("HeadBucket 'b' at x: not found (404)")).startswith("HeadB")
    assert (
        describe(ConnectionRefusedError(111, "refused"))
        == "ConnectionRefusedError: [Errno 111] refused"
    )


@pytest.mark.anyio
async def test_liveness_fails_while_the_device_thread_is_stuck_in_one_batch() -> None:
    """A real device thread (CPU backend) held inside a batch: ``/healthz`` turns 503 once
    the batch has run for the stall limit, names it, and is 200 again when it ends."""
    import threading

    from ingest_gpu.formats import PixelFormat, Transform
    from ingest_gpu.jobs import ChunkJob
    from ingest_gpu.thread import DeviceThread

    fmt = PixelFormat(8, 8, 1, 1, 16, 12, True, False)
    release = threading.Event()

    def held() -> None:  # the job's slot release, on the device thread: it waits
        release.wait()

    job = ChunkJob(memoryview(bytes(fmt.total_bytes)), fmt, Transform(), 0, held)
    with DeviceThread("cpu") as device:
        h = Health(device_busy_s=device.busy_s, device_stall_s=0.3)
        async with serving(h, "127.0.0.1", 0) as port, ClientSession() as http:

            async def alive() -> tuple[int, dict[str, object]]:
                async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
                    return resp.status, await resp.json()

            assert await alive() == (200, {"alive": True, "problems": []})
            done = device.submit([job])
            for _ in range(200):  # polled as a kubelet does, for up to 10 s
                answer = await alive()
                if answer[0] != 200:
                    break
                await anyio.sleep(0.05)
            assert answer[1]["alive"] is False
            assert str(answer[1]["problems"]).startswith("['device thread stuck in one work item")
            assert device.busy_s() >= 0.3
            release.set()
            done.result(timeout=10)
            assert await alive() == (200, {"alive": True, "problems": []})
            assert device.busy_s() == 0.0
