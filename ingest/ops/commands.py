"""The operator's commands: ``dicom-ingest dlq replay`` and ``dicom-ingest top``.

``ingest/cli.py`` adds their parsers (``add_parsers``) and hands a parsed
command here (``run``); both read the same settings as the worker (the
environment, then ``--config``), of which they need only the broker and
topics (``dlq``) or nothing at all (``top``).
"""

from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path
from typing import Any

from ingest.errors import ConfigError

COMMANDS = ("dlq", "top")


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


async def run(args: argparse.Namespace) -> int:
    """Run ``dlq replay`` or ``top``.

    Raises:
        ConfigError: bad settings or arguments.
        BrokerError: the broker could not be read or written (``dlq``).
    """
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
