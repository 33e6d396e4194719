"""Shared fixtures: one real SeaweedFS + Tansu stack per session, and unique names per test.

Tests that use ``stack`` are marked ``@pytest.mark.integration``; async tests use
``@pytest.mark.anyio`` (anyio's own pytest plugin) on the asyncio backend.
Tests share the stack, so each takes its topics, buckets and groups from
``fresh_names`` and never depends on what another test left behind.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from ingest.embedded.stack import Stack, embedded_stack
from tests.moto_kms import MotoServer, start_moto

_counter = itertools.count()


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


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
