"""Fixtures of the fetch tests: the tiny local HTTP server (``http_server.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.ingest.fetch.http_server import Handler, IdleClosingHandler, serve


@pytest.fixture
def server() -> Iterator[str]:
    with serve(Handler) as url:
        yield url


@pytest.fixture
def idle_closing_server() -> Iterator[str]:
    with serve(IdleClosingHandler) as url:
        yield url
