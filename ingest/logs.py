"""structlog set-up: JSON lines for the worker (machines read them), console for people.

One stream: structlog's own lines and the standard library's (aiokafka, botocore,
asyncio, warnings, uncaught exceptions in any thread) go through the same
processors and renderer, so with JSON every line on stderr is one JSON object.
Each carries ``timestamp``, ``level``, ``event``, ``logger`` (the logger's name:
``dicom_ingest.worker``, ``aiokafka.conn``), ``service``, ``version`` and, once
the settings are read, ``worker`` (``set_identity``); a traceback is the field
``exception``, never lines of its own.

A library that logs the same line over and over (aiokafka logs each failed
reconnect, over a thousand lines a second while a broker is down) is thinned:
a standard library line repeated within ``REPEAT_WINDOW_S`` is dropped, and the
next one let through says how many were (``repeated``). Our own lines are never
dropped.

Each line goes out in one ``write`` (structlog's ``WriteLogger``, and the
standard library's ``StreamHandler``, which writes message and newline
together): supervised children share the parent's stderr, and two lines
written at the same instant must not interleave, or a log reader sees
``{...}{...}`` and loses both records. A line up to ``PIPE_BUF`` (4 KiB) is
atomic on a pipe.

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
import threading
import types
from collections.abc import MutableMapping
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _package_version
from typing import Any, TextIO

import structlog

from ingest.redact import RedactFilter, key_hash, redact_event

SERVICE = "dicom-ingest"


def package_version() -> str:
    """The installed distribution's version (``0+unknown`` when run from a bare tree)."""
    try:
        return _package_version(SERVICE)
    except PackageNotFoundError:
        return "0+unknown"


class _CurrentStderr:
    """A file whose writes go to ``sys.stderr`` as it is at that moment."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class _NamedWriteLogger(structlog.WriteLogger):
    """structlog's ``WriteLogger`` that knows the name it was asked for (``logger``)."""

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
        self.name = name


class _NamedWriteLoggerFactory:
    def __init__(self, file: TextIO) -> None:
        self._file = file

    def __call__(self, *args: Any) -> _NamedWriteLogger:
        return _NamedWriteLogger(self._file, str(args[0]) if args else "dicom_ingest")


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The root handler ``configure_logging`` installs (replaced, never stacked)."""


REPEAT_WINDOW_S = 10.0
_REPEAT_KEYS = 4096  # distinct lines remembered; past it the memory starts again


class RepeatFilter(logging.Filter):
    """Drop a library's line (same logger, level and call site) that came less
    than ``REPEAT_WINDOW_S`` after the last one let through; the next one let through
    carries the count dropped as ``record.repeated``."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, int, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("dicom_ingest"):
            return True
        # The call site stands for the template: another handler's RedactFilter may have
        # formatted ``msg`` in place already.
        key = (record.name, record.levelno, f"{record.pathname}:{record.lineno}")
        with self._lock:
            shown, dropped = self._seen.get(key, (-REPEAT_WINDOW_S, 0))
            if record.created - shown < REPEAT_WINDOW_S:
                self._seen[key] = (shown, dropped + 1)
                return False
            if len(self._seen) >= _REPEAT_KEYS:
                self._seen.clear()
            self._seen[key] = (record.created, 0)
        if dropped:
            record.repeated = dropped
        return True


_STDERR = _CurrentStderr()
_IDENTITY: dict[str, str] = {"service": SERVICE, "version": package_version()}


def set_identity(*, worker: str) -> None:
    """Add the worker id to every later line of this process (structlog's and stdlib's)."""
    _IDENTITY["worker"] = worker


def identity() -> dict[str, str]:
    """The fields every line of this process carries: ``service``, ``version``, ``worker``."""
    return dict(_IDENTITY)


def _add_identity(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    for name, value in _IDENTITY.items():
        event.setdefault(name, value)
    return event


def _add_logger_name(
    logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    record = event.get("_record")
    name = record.name if record is not None else getattr(logger, "name", None)
    if name:
        event.setdefault("logger", name)
    return event


def _foreign_fields(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """A standard library record's traceback, already scrubbed by ``RedactFilter`` into
    ``exc_text``, as the ``exception`` field; the lines ``RepeatFilter`` dropped before
    it as ``repeated``."""
    record = event.get("_record")
    if record is not None and record.exc_text:
        event["exception"] = record.exc_text
    repeated = None if record is None else getattr(record, "repeated", None)
    if repeated:
        event["repeated"] = repeated
    return event


def configure_logging(*, json: bool, level: int = logging.INFO) -> None:
    """Route structlog and the standard library's loggers to stderr, through one renderer.

    Our loggers (``dicom_ingest.*``) log from ``level``; the libraries' from
    ``max(level, WARNING)`` (aiokafka's INFO lines are its every reconnect).
    Uncaught exceptions (main thread or any other) become one ``error`` line.
    """
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_identity,
    ]
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.format_exc_info,
            redact_event,  # no patient data or secret in any line (ingest/redact.py)
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=_NamedWriteLoggerFactory(_STDERR),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
    handler = _Handler(_STDERR)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, _foreign_fields],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                redact_event,
                renderer,
            ],
        )
    )
    handler.addFilter(RepeatFilter())
    handler.addFilter(RedactFilter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(max(level, logging.WARNING))
    logging.getLogger("dicom_ingest").setLevel(level)
    for each in root.handlers:  # pytest's, where it runs us, as well as ours
        if not any(isinstance(f, RedactFilter) for f in each.filters):
            each.addFilter(RedactFilter())
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread


_UNCAUGHT = structlog.get_logger("dicom_ingest.uncaught")


def _log_uncaught(
    kind: type[BaseException], value: BaseException, tb: types.TracebackType | None
) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)
        return
    _UNCAUGHT.error("uncaught exception", exc_info=(kind, value, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is None or issubclass(args.exc_type, SystemExit):
        return
    thread = args.thread.name if args.thread is not None else None
    _UNCAUGHT.error(
        "uncaught exception in a thread",
        thread=thread,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )


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
