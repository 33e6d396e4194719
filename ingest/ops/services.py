"""A worker service that a cancellation nobody asked for must not end.

anyio cancels a whole task group, silently, when one of its tasks ends with a
``CancelledError``. aiokafka bounds its own calls with asyncio timeouts
(``task.cancel()`` and ``uncancel()`` on the caller's task); when such a
timeout meets an anyio cancel scope on the same task, the task can be left a
``CancelledError`` that no scope of ours raised. Ending a service with it
would end the worker's services, and with them the worker, with no error
anywhere (the full test suite's broker-outage test sees a worker end that
way; which task takes the cancellation there is not found yet).
``keep_running`` tells the two apart (a real cancellation leaves the task's
effective deadline at ``-inf``) and runs the service again after a stray
one, with an error logged.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

import anyio
import structlog

log = structlog.get_logger("dicom_ingest.services")
RESTART_PAUSE_S = 0.5


def stray_cancellation() -> bool:
    """In an ``except`` of the cancellation class: whether no enclosing scope was cancelled.

    The task's own pending native cancellations are taken back (``uncancel``),
    so that the next timeout on it counts right.
    """
    if anyio.current_effective_deadline() == -math.inf:
        return False
    task = asyncio.current_task()
    while task is not None and task.cancelling():
        task.uncancel()
    return True


def stray_or_raise(what: str) -> None:
    """In an ``except`` of the cancellation class: raise it again unless it is a stray one,
    which is logged as an error."""
    if not stray_cancellation():
        raise  # the cancellation being handled
    log.error("cancelled by no scope; going on", what=what, exc_info=True)


async def keep_running(name: str, service: Callable[[], Awaitable[None]]) -> None:
    """Run ``service`` until it returns or a real cancellation ends it; again after a stray
    one (a service is a loop)."""
    while True:
        try:
            await service()
            return
        except anyio.get_cancelled_exc_class():
            stray_or_raise(name)
        await anyio.sleep(RESTART_PAUSE_S)
