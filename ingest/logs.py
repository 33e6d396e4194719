"""structlog set-up: JSON lines for the worker (machines read them), console for people.

Logs never carry patient data: object keys appear only as ``worker.key_digest``
and DICOM header values not at all; the results topic and the encrypted audit
trail are where keys and UIDs live.
"""

from __future__ import annotations

import logging
import sys

import structlog


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
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(level, logging.WARNING), stream=sys.stderr)
