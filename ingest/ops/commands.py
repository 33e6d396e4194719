"""The operator's commands: ``dicom-ingest dlq replay``, ``top`` and ``backfill``.

``ingest/cli.py`` adds their parsers (``add_parsers``) and hands a parsed
command here (``run``); they read the same settings as the worker (the
environment, then ``--config``), of which they need only the broker and
topics (``dlq``), nothing at all (``top``), or the broker, the source topic, S3
and the file roots (``backfill``: ``ingest/source/backfill.py``).
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from ingest.errors import ConfigError

COMMANDS = ("dlq", "top", "backfill")


def _time(text: str) -> datetime:
    from ingest.ops.dlq import parse_time

    when = parse_time(text)
    if when is None:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r}")
    return when


def add_parsers(commands: Any) -> None:
    dlq = commands.add_parser("dlq", help="dead letters: replay them to the source topic")
    actions = dlq.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")
    replay = actions.add_parser(
        "replay",
        help="re-publish dead letters (all, or by reason, key prefix, time) once each",
        description="Re-publish the selected dead letters to the source topic; a dead letter "
        "replayed before (a marker in <DLQ topic>.replayed) is skipped.",
    )
    replay.add_argument("--config", type=Path, help="TOML file with settings (env wins)")
    replay.add_argument(
        "--reason",
        action="append",
        default=[],
        help="only this reason (repeatable), e.g. "
        "not_found, source_unavailable, unsupported_dicom, missing_decoder, processing",
    )
    replay.add_argument("--key-prefix", help="only objects whose key starts with this")
    replay.add_argument("--since", type=_time, help="dead-lettered at or after (ISO 8601, UTC)")
    replay.add_argument("--until", type=_time, help="dead-lettered before (ISO 8601, UTC)")
    replay.add_argument("--dry-run", action="store_true", help="count, publish nothing")

    top = commands.add_parser(
        "top", help="live view of a running worker's /metrics: throughput, latency, ring, lag"
    )
    top.add_argument(
        "url",
        nargs="*",
        default=["http://127.0.0.1:8080/metrics"],
        help="metrics URLs of one or more workers (default: http://127.0.0.1:8080/metrics)",
    )
    top.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes")
    top.add_argument("--once", action="store_true", help="two scrapes, one table, exit")
    _backfill_parser(commands)


async def run(args: argparse.Namespace) -> int:
    """Run ``dlq replay``, ``top`` or ``backfill``.

    Raises:
        ConfigError: bad settings or arguments.
        BrokerError: the broker could not be read or written (``dlq``, ``backfill``).
        SourceError: the bucket or folder could not be listed (``backfill``).
    """
    if args.command == "backfill":
        return await _backfill(args)
    if args.command == "top":
        from ingest.ops.top import run_top

        if args.interval <= 0:
            raise ConfigError("top --interval: seconds, more than 0")
        return await run_top(args.url, args.interval, once=args.once)
    from ingest.ops.dlq import Selection, replay
    from ingest.settings import load_settings

    settings = load_settings(config_file=args.config, required=("kafka_bootstrap",))
    if args.since and args.until and args.since >= args.until:
        raise ConfigError("dlq replay: --since must be before --until")
    selection = Selection(frozenset(args.reason), args.key_prefix, args.since, args.until)
    report = await replay(settings, selection, dry_run=args.dry_run)
    verb = "would replay" if args.dry_run else "replayed"
    by_reason = ", ".join(f"{r} {n}" for r, n in sorted(report.replayed.items())) or "none"
    print(f"{verb} {report.replayed.total()} to {settings.source_topic} ({by_reason})")
    print(
        f"skipped: {report.already} replayed before, {report.unselected} not selected, "
        f"{report.unreplayable} not replayable (cut or unreadable)"
    )
    return 0


def _rate(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"objects a second, 0 or more, got {text}")
    return value


def _backfill_parser(commands: Any) -> None:
    backfill = commands.add_parser(
        "backfill",
        help="publish notifications for objects already stored (a bucket prefix or a folder)",
        description="List s3://bucket/prefix (or file:///path under DICOM_INGEST_FILE_ROOTS) "
        "and publish a notification per object to the source topic, at --rate, resumable "
        "from its checkpoint after a kill (docs/operations.md).",
    )
    add = backfill.add_argument
    add("url", help="s3://bucket/prefix, or file:///path of a folder under a file root")
    add("--since", type=_time, help="only objects last modified at or after (ISO 8601, UTC)")
    add("--until", type=_time, help="only objects last modified before (ISO 8601, UTC)")
    add("--rate", type=_rate, default=0.0, help="objects a second (default 0: unpaced)")
    add("--dry-run", action="store_true", help="list and count; publish nothing")
    add("--topic", help="publish here instead of DICOM_INGEST_SOURCE_TOPIC")
    add(
        "--checkpoint",
        type=Path,
        help="progress file (default: ./dicom-ingest-backfill-<id>.json, named by the URL, "
        "topic and times); a rerun resumes after its last key",
    )
    add("--restart", action="store_true", help="ignore the checkpoint: publish everything again")
    add("--config", type=Path, help="TOML file with settings (env wins)")


async def _backfill(args: argparse.Namespace) -> int:
    """``backfill``: list, publish, print progress (stderr) and a summary (stdout).

    Raises:
        ConfigError, SourceError, BrokerError: see ``ingest.source.backfill``.
    """
    from ingest.settings import load_settings
    from ingest.source.backfill import Progress, Spec, backfill, summary

    needed = () if args.dry_run else ("kafka_bootstrap",)
    settings = load_settings(config_file=args.config, required=needed)
    if args.since and args.until and args.since >= args.until:
        raise ConfigError("backfill: --since must be before --until")
    spec = Spec(args.url, args.topic or settings.source_topic, args.since, args.until)
    shown, tty = 0.0, sys.stderr.isatty()

    def progress(done: Progress) -> None:  # a line a second on a terminal, else every 10 s
        nonlocal shown
        if done.seconds - shown >= (1.0 if tty else 10.0):
            shown = done.seconds
            line = f"listed {done.listed}, published {done.published}, skipped {done.skipped}"
            print(f"\r{line}" if tty else line, end="" if tty else "\n", file=sys.stderr)

    result = await backfill(
        settings,
        spec,
        rate=args.rate,
        dry_run=args.dry_run,
        checkpoint=args.checkpoint,
        restart=args.restart,
        on_progress=progress,
    )
    if shown and tty:
        print(file=sys.stderr)
    for line in summary(result, spec, dry_run=args.dry_run):
        print(line)
    return 0
