"""Shared fixtures: one real SeaweedFS + Tansu stack per session, and unique names per test.

Tests that use ``stack`` are marked ``@pytest.mark.integration``; async tests use
``@pytest.mark.anyio`` (anyio's own pytest plugin) on the asyncio backend.
Tests share the stack, so each takes its topics, buckets and groups from
``fresh_names`` and never depends on what another test left behind.

``make test`` runs the suite in two pytest-xdist processes (each with its own
stack); a test marked ``alone`` (it bounds a time) runs while the other process
runs nothing (``one_at_a_time``).
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import structlog

from ingest.embedded.stack import Stack, embedded_stack
from tests.moto_kms import MotoServer, start_moto

_counter = itertools.count()


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def logging_as_found(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test leaves structlog, the root logger and SIGTERM's handler as it found them.

    ``main`` sets these up for its process (``ingest/logs.py``): structlog with
    ``cache_logger_on_first_use``, which binds a module's logger for good at its first
    use, a redaction filter on every root handler (pytest's own, which live for the
    session), and SIGTERM as Ctrl-C for the commands that own a stack. A test that
    ran ``audit keygen`` (level WARNING) through ``main`` left the worker's loggers
    silent below WARNING in every later test, whatever the configuration was restored
    to: tests depended on their order. Loggers are not cached while a test runs, and
    the rest is put back after.
    """
    saved = structlog.get_config()
    configure = structlog.configure

    def uncached(**settings: Any) -> None:
        configure(**{**settings, "cache_logger_on_first_use": False})

    monkeypatch.setattr(structlog, "configure", uncached)
    root = logging.getLogger()
    handlers = {handler: list(handler.filters) for handler in root.handlers}
    level = root.level
    sigterm = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, sigterm)
    configure(**saved)
    for handler in root.handlers[:]:
        if handler not in handlers:  # basicConfig's, had the root none (pytest's are there)
            root.removeHandler(handler)
    for handler, filters in handlers.items():
        handler.filters[:] = filters
    root.setLevel(level)


@pytest.fixture(autouse=True)
def one_at_a_time(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Under pytest-xdist, a test marked ``alone`` runs while no other test runs.

    Such a test bounds a time (a worker's first output within 3 s of its spawn, a
    hand-over within 3 s): on two cores, another process's test beside it would
    measure the machine, not the worker. Every test holds a shared lock on a file
    of this run (the workers' base folders share their parent) and an ``alone``
    test an exclusive one; a second file, taken exclusively by each in turn on the
    way in, keeps the shared holders from starving a waiting ``alone`` test. Run
    without xdist, there is nobody to wait for.
    """
    if not hasattr(request.config, "workerinput"):  # xdist's workers have it
        yield
        return
    folder = tmp_path_factory.getbasetemp().parent
    alone = request.node.get_closest_marker("alone") is not None
    with open(folder / "turnstile.lock", "a") as turnstile, open(folder / "run.lock", "a") as run:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(run, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(run, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """SeaweedFS and an in-memory Tansu for the whole session, stopped at the end."""
    with embedded_stack() as running:
        yield running


@pytest.fixture(scope="session")
def moto() -> Iterator[MotoServer]:
    """moto's server (KMS, S3) on a loopback port for the session (tests/moto_kms.py)."""
    with start_moto() as running:
        yield running


@dataclass(frozen=True, slots=True)
class FreshNames:
    """Names unique to one test; valid as Kafka topics/groups and as S3 bucket names."""

    token: str

    def topic(self, role: str = "in") -> str:
        return f"t-{self.token}-{role}"

    def bucket(self, role: str = "data") -> str:
        return f"b-{self.token}-{role}"  # lower case, digits and '-', well under 63 chars

    def group(self, role: str = "workers") -> str:
        return f"g-{self.token}-{role}"


@pytest.fixture
def fresh_names() -> FreshNames:
    return FreshNames(f"{next(_counter)}{uuid.uuid4().hex[:8]}")


@pytest.fixture
def bucket(stack: Stack, fresh_names: FreshNames) -> str:
    """A new, empty bucket on the session's SeaweedFS."""
    name = fresh_names.bucket()
    stack.s3.create_bucket(name)
    return name


@pytest.fixture
def aws_environment(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker takes S3 credentials from the standard AWS variables, as botocore does."""
    for name, value in stack.endpoints.environment().items():
        monkeypatch.setenv(name, value)
