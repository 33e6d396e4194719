"""The ``dicom-ingest`` command line: worker, demo, stack, audit.

Bad configuration ends with one line naming the variable and exit status 2;
any other ``IngestError`` that stops a command ends with one line and status 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio
import structlog

from ingest.errors import ConfigError, IngestError
from ingest.logs import configure_logging
from ingest.settings import Settings, load_settings, setting_names

log = structlog.get_logger("dicom_ingest.cli")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dicom-ingest",
        description="Stream DICOM objects from S3 onto the GPU, preprocessed, stored, audited.",
        epilog="Settings: " + ", ".join(setting_names()),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    worker = commands.add_parser(
        "worker", help="the long-running worker (SIGTERM/SIGINT: drain, commit, leave, exit 0)"
    )
    worker.add_argument("--config", type=Path, help="TOML file with settings (env wins)")

    demo = commands.add_parser(
        "demo", help="embedded broker + S3, sample DICOM objects, run the worker, print a table"
    )
    demo.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    demo.add_argument(
        "--multiframe-mb", type=int, default=128, help="size of the large multi-frame object"
    )
    demo.add_argument("--series", type=int, default=24, help="CT slices in the synthetic series")

    stack = commands.add_parser(
        "stack", help="run the embedded broker and S3 server in the foreground; print the env"
    )
    stack.add_argument("--durable", action="store_true", help="broker stores its log in S3")

    audit = commands.add_parser("audit", help="decrypt and verify the audit topic")
    audit.add_argument("--config", type=Path, help="TOML file with settings (env wins)")
    audit.add_argument("--print", action="store_true", help="print each decrypted record")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "worker":
            configure_logging(json=True)
            return _run(_worker, load_settings(config_file=args.config))
        if args.command == "demo":
            from ingest.demo import run_demo

            configure_logging(json=False, level=logging.ERROR)  # the table says the rest
            return _run(run_demo, args.device, args.multiframe_mb, args.series)
        if args.command == "stack":
            from ingest.stack_cli import run_stack

            configure_logging(json=False)
            return run_stack(durable=args.durable)
        if args.command == "audit":
            from ingest.audit_cli import run_audit

            configure_logging(json=False, level=logging.WARNING)
            return _run(run_audit, load_settings(config_file=args.config), args.print)
    except ConfigError as exc:
        print(f"dicom-ingest: configuration error: {exc}", file=sys.stderr)
        return 2
    except IngestError as exc:
        print(f"dicom-ingest: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    raise AssertionError(f"unhandled command {args.command}")


def _run(func: object, *args: object) -> int:
    """Run an async entry point on asyncio (aiokafka needs it), with uvloop when installed."""
    options = {"use_uvloop": importlib.util.find_spec("uvloop") is not None}
    result: int = anyio.run(func, *args, backend="asyncio", backend_options=options)  # type: ignore[arg-type]
    return result


async def _worker(settings: Settings) -> int:
    from ingest.worker import Worker

    worker = Worker(settings)
    async with anyio.create_task_group() as group:

        async def on_signals() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("signal received; draining", signal=signal.Signals(signum).name)
                    worker.stop()

        group.start_soon(on_signals)
        await worker.run()
        group.cancel_scope.cancel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
