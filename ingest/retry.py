"""The one retry policy: capped exponential backoff with full jitter, on retriable errors.

Everything that talks to S3 or Kafka runs its calls through ``with_retries``,
but a Kafka client's first bootstrap, which is tried again against the connect
timeout instead (``ingest.source.kafka.start_client``). The policy reads
``IngestError.retriable`` and nothing else, so what is worth retrying is decided
where foreign exceptions are translated, once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    stop_never,
    wait_random_exponential,
)

from ingest import metrics
from ingest.errors import IngestError
from ingest.settings import Settings

T = TypeVar("T")


def retry_policy(settings: Settings, *, forever: bool = False) -> AsyncRetrying:
    """At most ``max_attempts`` tries (or until cancelled with ``forever``).

    Waits grow from ~50 ms with full jitter, capped at ``retry_max_wait_s``.
    """
    return AsyncRetrying(
        retry=retry_if_exception(lambda e: isinstance(e, IngestError) and e.retriable),
        wait=wait_random_exponential(multiplier=0.05, max=settings.retry_max_wait_s),
        stop=stop_never if forever else stop_after_attempt(settings.max_attempts),
        reraise=True,
        before_sleep=metrics.count_retry,  # retries by reason, in /metrics
    )


async def with_retries(
    settings: Settings, call: Callable[[], Awaitable[T]], *, forever: bool = False
) -> T:
    """Run ``call`` under the policy; the error that ends it records the attempts made.

    ``forever`` is for the broker: an outage is nobody's fault but the broker's,
    so publishing waits it out (shutdown cancels the wait) instead of giving up.

    The first try runs before the policy is built: nearly every call succeeds at
    once, and tenacity's set-up and bookkeeping would cost the event loop of a
    worker ingesting CT slices on every call. A failure the policy retries is
    handed to it as its first attempt's outcome, so the waits and the count of
    attempts are the policy's own.
    """
    try:
        return await call()
    except IngestError as exc:
        if not exc.retriable:
            exc.attempts = 1
            raise
        first: IngestError | None = exc
    attempts = 0

    async def replay_then_call() -> T:
        nonlocal first
        if first is not None:
            failed, first = first, None
            raise failed
        return await call()

    try:
        async for attempt in retry_policy(settings, forever=forever):
            with attempt:
                attempts += 1
                return await replay_then_call()
    except IngestError as exc:
        exc.attempts = attempts
        raise
    raise AssertionError("unreachable: reraise=True re-raises the last error")
