"""structlog set-up: JSON lines for the worker (machines read them), console for people.

Each line goes out in one ``write`` (structlog's ``WriteLogger``; its
``PrintLogger`` writes the newline separately): supervised children share
the parent's stderr, and two lines written at the same instant must not
interleave, or a log reader sees ``{...}{...}`` and loses both records.
A line up to ``PIPE_BUF`` (4 KiB) is atomic on a pipe.

Lines go to ``sys.stderr`` as it is when each is written, not as it was at
set-up: whoever swaps it (a test harness, an embedding program) may close the
old stream, and a logger still holding that one would raise ``ValueError`` in
whichever task logs next, ending the worker's services with it.

Logs never carry patient data: object keys appear only as ``key_digest``
and DICOM header values not at all; the results topic and the encrypted audit
trail are where keys and UIDs live. ``ingest/redact.py`` enforces it on every
line (structlog's and the standard library's): patient attributes, secrets,
URL paths and person names are masked whatever a caller passed.
"""

from __future__ import annotations

import logging
import sys

import structlog

from ingest.redact import RedactFilter, key_hash, redact_event


class _CurrentStderr:
    """A file whose writes go to ``sys.stderr`` as it is at that moment."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_STDERR = _CurrentStderr()


def configure_logging(*, json: bool, level: int = logging.INFO) -> None:
    """Route structlog (and the stdlib loggers of our libraries) to stderr."""
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            redact_event,  # no patient data or secret in any line (ingest/redact.py)
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.WriteLoggerFactory(file=_STDERR),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(level, logging.WARNING), stream=_STDERR)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactFilter) for f in handler.filters):
            handler.addFilter(RedactFilter())


def key_digest(key: str) -> str:
    """A short stable stand-in for an object key in logs (keys may hold patient names)."""
    return key_hash(key)


def bind_object(key: str, partition: tuple[str, int], offset: int) -> None:
    """Tag every later log line of the calling task (and the threads it starts) with the
    object's hashed key and its Kafka record's position (asyncio tasks copy the context,
    so the binding stays with this object's task)."""
    structlog.contextvars.bind_contextvars(
        key=key_digest(key), topic=partition[0], partition=partition[1], offset=offset
    )
