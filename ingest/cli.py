"""The ``dicom-ingest`` command line: worker, demo, stack, backfill, bench, audit.

Bad configuration ends with one line naming the variable and exit status 2;
any other ``IngestError`` that stops a command ends with one line and status 1.
``worker`` checks what its settings point at (``ingest/ops/preflight.py``)
before it joins the group, so a hook that does not import or a keyring anyone
may read fails there, and a supervisor does not restart it. A worker that logs
JSON writes that last line as JSON too; an error that is no ``IngestError``
(a bug) is logged with its traceback as a field, and the status is 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import sys
from collections.abc import MutableMapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from ingest.errors import ConfigError, IngestError
from ingest.logs import configure_logging, identity, package_version, set_identity
from ingest.redact import set_log_hash_key
from ingest.settings import SETTINGS, Settings, load_settings, plaintext, setting_names

if TYPE_CHECKING:
    from ingest.worker import Worker

log = structlog.get_logger("dicom_ingest.cli")
BENCH_FROM_A_CHECKOUT = (
    "dicom-ingest: the bench and its diagnostics run from a checkout of the repository"
    " (make bench); an installed wheel holds the worker without them"
)


def make_parser() -> argparse.ArgumentParser:
    """The command line: every command and its options, as ``main`` parses them."""
    parser = argparse.ArgumentParser(
        prog="dicom-ingest",
        description="Stream DICOM objects from S3 onto the GPU, preprocessed, stored, audited.",
        epilog="Settings: " + ", ".join(setting_names()),
    )
    parser.add_argument("--version", action="version", version=f"dicom-ingest {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    worker = commands.add_parser(
        "worker", help="the long-running worker (SIGTERM/SIGINT: drain, commit, leave, exit 0)"
    )
    worker.add_argument("--config", type=Path, help="TOML file with settings (env wins)")
    worker.add_argument(
        "--processes",
        type=_processes,
        default=1,
        help="worker processes in one consumer group (1: this process, no supervisor; N: a "
        "supervisor starting N children, worker id + '-i', health port + i; auto: N for this "
        "host's cores, GPUs and memory)",
    )
    worker.add_argument(
        "--gpus",
        default="",
        metavar="LIST",
        help="GPU ids, e.g. 0,1: CUDA_VISIBLE_DEVICES of child i is LIST[i mod len(LIST)]",
    )
    # Set by whoever started this worker (the supervisor for its children, the bench for
    # its workers): stop when that process dies; tag log lines with the worker id.
    worker.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)

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

    _bench_parser(commands)

    from ingest.audit.cli import add_audit_parser

    add_audit_parser(commands)  # verify | decrypt | export | keygen
    from ingest.ops.commands import add_parsers as add_ops_parsers

    add_ops_parsers(commands)  # dlq replay, top, backfill
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _processes(text: str) -> int | str:
    return "auto" if text.strip() == "auto" else _positive_int(text)


def host_processes(device: str, ring_bytes: int, gpus: Sequence[str]) -> int:
    """``--processes auto`` on this host for workers of ``device`` and ``ring_bytes`` of
    pinned ring: its usable cores, the GPUs the workers would use (``--gpus``, else every
    visible one; none on the CPU backend) and its memory."""
    from ingest.ops.supervisor import auto_processes

    if device == "cpu":
        count = 0
    elif gpus:
        count = len(gpus)
    else:
        from ingest_gpu.driver import device_count

        try:
            count = device_count()
        except Exception:  # no driver, no device: the CPU backend
            count = 0
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return auto_processes(len(os.sched_getaffinity(0)), count, memory, ring_bytes)


def _bench_processes(item: str, args: argparse.Namespace) -> int:
    """One item of ``bench --processes``: N, or ``auto`` resolved as the worker would.

    Raises:
        ConfigError: neither a positive integer nor ``auto``.
    """
    if item != "auto":
        if not item.isdigit() or int(item) < 1:
            raise ConfigError("bench --processes: every N must be at least 1, or auto")
        return int(item)
    from dataclasses import fields

    from ingest.ops.supervisor import parse_gpus

    sizes: dict[str, int] = {
        f.name: int(f.default)  # type: ignore[arg-type]
        for f in fields(Settings)
        if f.name in ("part_size", "ring_slots")
    }
    for name, _, value in (item.partition("=") for item in args.set):
        if name.strip().lower() in sizes:
            sizes[name.strip().lower()] = int(value)
    ring = sizes["part_size"] * sizes["ring_slots"]
    return host_processes(args.device, ring, parse_gpus(args.gpus))


def _csv_ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _csv_names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _bench_parser(commands: Any) -> None:
    bench = commands.add_parser(
        "bench", help="benchmark: ours vs curl, threads, KvikIO and the naive path (JSON, PNG)"
    )
    add = bench.add_argument
    add("--out", type=Path, default=Path("bench-results"), help="output folder")
    add("--endpoint", help="S3 endpoint URL (default: the embedded stack; AWS_* credentials)")
    add("--bootstrap", help="Kafka bootstrap servers (needed with --endpoint)")
    add(
        "--workloads",
        type=_csv_names,
        default=("ct", "large", "mix"),
        help="ct,large,mix (default); corpus (the mix and samples of many kinds); the decode "
        "workloads slide,slide-512,ct-j2k,ct-htj2k,ct-rle,ct-jpeg,ct-htj2k-volume,ct-j2k-volume",
    )
    add(
        "--readers",
        type=_csv_names,
        default=None,  # every reader of ingest.bench.config.READERS
        help="curl,threads,kvikio-raw,naive,kvikio,put-raw (ct, large, mix, corpus), plain (the "
        "plain sequential worker, when named), pydicom-loop,"
        "cpu-pool,nvimgcodec,nvimgcodec-plugin (decode workloads), ours,ours-hook (all)",
    )
    add(
        "--ct",
        type=int,
        default=300,
        help="CT slices (512x512 16-bit, ~0.5 MB each), also "
        "of the ct-j2k, ct-htj2k, ct-rle and ct-jpeg series and frames of the volumes",
    )
    add("--slide-mb", type=int, default=200, help="MiB of 256x256 JPEG tiles in the slide")
    add(
        "--decode-corpus",
        type=Path,
        default=None,
        metavar="DIR",
        help="read the decode workloads' CT series (and a slide, if there) from DIR/<workload>/"
        "*.dcm, written by `python -m ingest.bench.workloads_compressed --write DIR`",
    )
    add("--large-mb", type=int, default=1024, help="MiB of pixels in the large object")
    add(
        "--large-syntax",
        choices=("native", "encapsulated"),
        default="native",
        help="the large object's transfer syntax: native (4 GiB at most) or Encapsulated "
        "Uncompressed (a frame a fragment, no limit: a whole-slide image's size)",
    )
    add("--repeats", type=int, default=3, help="measured runs after the discarded warm-up")
    add(
        "--part-mb",
        type=int,
        default=8,
        help="range size of the raw and KvikIO readers in MiB (ours: its part_size setting)",
    )
    add("--concurrency", type=int, default=16, help="parallel ranges (and objects)")
    add("--sweep", action="store_true", help="ours vs part size and vs fetch concurrency")
    add("--sweep-parts", type=_csv_ints, default=(1, 4, 8, 16, 32), help="MiB, for --sweep")
    add("--sweep-concurrency", type=_csv_ints, default=(4, 8, 16, 32), help="for --sweep")
    add("--sweep-mode", choices=("ours-hook", "ours"), default="ours-hook", help="for --sweep")
    add("--device", choices=("auto", "cuda", "cpu"), default="auto")
    add(
        "--processes",
        type=_csv_names,
        default=(),
        metavar="LIST",
        help="scaled mode: for each N, `worker --processes N` in one group, e.g. 1,4,8,auto "
        "(auto: what `worker --processes auto` chooses here)",
    )
    add("--gpus", default="", metavar="LIST", help="scaled mode: the workers' --gpus, e.g. 0,1")
    add(
        "--scaled-modes",
        type=_csv_names,
        default=("ours-hook", "ours"),
        help="scaled mode: ours-hook (sink off), ours (sink on)",
    )
    add(
        "--paced-rate",
        type=float,
        default=0.0,
        metavar="OBJ_PER_S",
        help="objects/s of the CT latency pass (default 0: half the median burst rate)",
    )
    add("--no-plots", action="store_true", help="skip the PNG plots")
    add(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a worker setting for ours, e.g. max_objects_in_flight=32 (repeatable)",
    )


def bench_config(args: argparse.Namespace) -> Any:
    """The bench's ``BenchConfig`` from its parsed command line.

    Raises:
        ConfigError: an option, or a combination of them, the bench cannot run with.
    """
    from ingest.bench.config import READERS, BenchConfig

    if args.endpoint and not args.bootstrap:
        raise ConfigError("bench --endpoint needs --bootstrap")
    pairs = [item.partition("=") for item in args.set]
    for name, sep, _ in pairs:
        if not sep or name.strip().lower() not in SETTINGS:
            raise ConfigError(f"bench --set {name}: expected NAME=VALUE with a known setting")
    processes = tuple(_bench_processes(n, args) for n in args.processes)
    if any(m not in ("ours-hook", "ours") for m in args.scaled_modes):
        raise ConfigError("bench --scaled-modes: ours-hook, ours")
    if not 0.0 <= args.paced_rate < float("inf"):
        raise ConfigError("bench --paced-rate: objects/s, 0 or more")
    if args.decode_corpus is not None and not args.decode_corpus.is_dir():
        raise ConfigError(f"bench --decode-corpus {args.decode_corpus}: not a folder")
    from ingest.ops.supervisor import parse_gpus

    parse_gpus(args.gpus)  # a bad list fails here, not in the first scaled run
    return BenchConfig(
        out=args.out,
        endpoint=args.endpoint,
        bootstrap=args.bootstrap,
        workloads=args.workloads,
        readers=READERS if args.readers is None else args.readers,
        ct_count=args.ct,
        large_mb=args.large_mb,
        large_syntax=args.large_syntax,
        slide_mb=args.slide_mb,
        decode_corpus=args.decode_corpus,
        repeats=args.repeats,
        part_mb=args.part_mb,
        concurrency=args.concurrency,
        sweep=args.sweep,
        sweep_parts_mb=args.sweep_parts,
        sweep_concurrency=args.sweep_concurrency,
        sweep_mode=args.sweep_mode,
        device=args.device,
        plots=not args.no_plots,
        worker_settings=tuple((name.strip(), value) for name, _, value in pairs),
        processes=processes,
        gpus=args.gpus.strip(),
        scaled_modes=args.scaled_modes,
        paced_rate=args.paced_rate,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.command == "worker":
        return _worker_main(args)
    try:
        # demo and bench own an embedded stack: SIGTERM stops them as Ctrl-C does, so
        # their context managers stop the servers instead of leaving them behind
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        if args.command == "demo":
            from ingest.embedded.demo import run_demo

            configure_logging(json=False, level=logging.ERROR)  # the table says the rest
            return _run(run_demo, args.device, args.multiframe_mb, args.series)
        if args.command == "stack":
            from ingest.embedded.stack_cli import run_stack

            configure_logging(json=False)
            return run_stack(durable=args.durable)
        if args.command == "bench":
            if importlib.util.find_spec("ingest.bench") is None:  # a wheel ships without it
                print(BENCH_FROM_A_CHECKOUT, file=sys.stderr)
                return 2
            from ingest.bench.main import bench_command

            configure_logging(json=False, level=logging.ERROR)  # the tables say the rest
            return _run(bench_command, bench_config(args))
        if args.command == "audit":
            from ingest.audit.cli import run_audit_command

            configure_logging(json=False, level=logging.WARNING)
            return _run(run_audit_command, args)
        if args.command in ("dlq", "top", "backfill"):
            from ingest.ops.commands import run as run_ops_command

            configure_logging(json=False, level=logging.WARNING)
            return _run(run_ops_command, args)
    except ConfigError as exc:
        print(f"dicom-ingest: configuration error: {exc}", file=sys.stderr)
        return 2
    except IngestError as exc:
        print(f"dicom-ingest: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    raise AssertionError(f"unhandled command {args.command}")


def _worker_main(args: argparse.Namespace) -> int:
    """``worker``, with its failures reported as the worker logs: JSON lines unless a
    person reads the terminal (``LOG_FORMAT``, read raw: the settings may be what failed)."""
    raw_format = os.environ.get("DICOM_INGEST_LOG_FORMAT", "auto").strip().lower()
    lines = raw_format == "json" or (raw_format != "console" and not sys.stderr.isatty())
    configure_logging(json=lines)
    try:
        return _worker_command(args)
    except KeyboardInterrupt:
        return 130
    except BaseException as raised:
        error = first_error(raised)
        if isinstance(error, ConfigError):
            return _last_line(lines, "configuration error", error, 2)
        if isinstance(error, IngestError):
            return _last_line(lines, "worker failed", error, 1)
        if isinstance(error, SystemExit | KeyboardInterrupt | GeneratorExit):
            raise
        log.critical("worker crashed", exc_info=raised)  # a bug: the traceback as a field
        return 1


def first_error(raised: BaseException) -> BaseException:
    """What ended a run: a task group raises its tasks' errors as an ``ExceptionGroup``;
    the first ``ConfigError`` in it, else the first ``IngestError``, else ``raised``."""
    if not isinstance(raised, BaseExceptionGroup):
        return raised
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(raised)
    for kind in (ConfigError, IngestError):
        for leaf in leaves:
            if isinstance(leaf, kind):
                return leaf
    return raised


def _last_line(lines: bool, what: str, error: BaseException, status: int) -> int:
    """The one line a worker ends with on an error it knows: JSON, or text for a person."""
    if lines:
        record = {
            "event": what,
            "error": str(error),
            "error_type": type(error).__name__,
            "exit_status": status,
            "level": "error",
            "logger": "dicom_ingest.cli",
            "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
            **identity(),
        }
        print(json.dumps(record), file=sys.stderr)
    else:
        text = "configuration error" if isinstance(error, ConfigError) else type(error).__name__
        print(f"dicom-ingest: {text}: {error}", file=sys.stderr)
    return status


def _run(func: object, *args: object) -> int:
    """Run an async entry point on asyncio (aiokafka needs it), with uvloop when installed."""
    options = {"use_uvloop": importlib.util.find_spec("uvloop") is not None}
    result: int = anyio.run(func, *args, backend="asyncio", backend_options=options)  # type: ignore[arg-type]
    return result


def _worker_command(args: argparse.Namespace) -> int:
    """``worker``: this process (``--processes 1``), or a supervisor of N children.

    Raises:
        ConfigError: bad settings or flags (checked here, once, before any child starts).
    """
    from ingest.ops.preflight import check_startup
    from ingest.ops.supervisor import child_specs, die_with_parent, parse_gpus, run_supervisor

    gpus = parse_gpus(args.gpus)
    settings = load_settings(config_file=args.config)
    set_log_hash_key(settings.log_hash_key or None)
    tty = settings.log_format == "auto" and sys.stderr.isatty()  # a person reads a terminal
    configure_logging(json=not (tty or settings.log_format == "console"))
    set_identity(worker=settings.worker_id)  # siblings share stderr: each line says whose
    if args.parent_pid is not None and not die_with_parent(args.parent_pid):
        log.warning("parent gone before start; exiting", worker=settings.worker_id)
        return 0
    check_startup(settings)  # before the group join; the supervisor checks once for all
    for connection in plaintext(settings):  # REQUIRE_TLS refuses these; say so at least
        log.warning("plaintext connection", setting=connection)
    processes = args.processes
    if processes == "auto":
        processes = host_processes(settings.device, settings.part_size * settings.ring_slots, gpus)
        log.info("processes chosen for this host", processes=processes)
    if processes > 1:
        specs = child_specs(settings, processes, gpus, dict(os.environ), args.config, os.getpid())
        return _run(run_supervisor, specs, settings.shutdown_deadline_s)
    device_environment(gpus, os.environ, device_decodes(settings))
    return _run(_worker, settings)


def device_environment(
    gpus: Sequence[str], environ: MutableMapping[str, str], decodes: bool
) -> None:
    """The CUDA variables of a worker process, set before anything initialises CUDA
    (the device thread does, later).

    - ``CUDA_VISIBLE_DEVICES``: the first of ``--gpus``, where given.
    - ``CUDA_DEVICE_MAX_CONNECTIONS=1`` unless set, when the device does not decode
      (``decodes``): the worker then queues all its device work on one stream, so one
      hardware queue to the GPU is all it uses, and the driver's default of 8 holds more
      host memory. nvImageCodec's decoders run on streams of their own: on one queue
      they wait for each other (JPEG 2000 and HTJ2K decode several times slower:
      docs/benchmarks.md), so a worker that decodes keeps the default. A hook that runs
      work on streams of its own may want them back too: set the variable and it is left
      alone.
    """
    if gpus:
        environ["CUDA_VISIBLE_DEVICES"] = gpus[0]
    if not decodes:
        environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def device_decodes(settings: Settings) -> bool:
    """The worker may decode frames on the device: not the CPU backend, ``gpu_decode=auto``
    and nvImageCodec installed (``ingest_gpu.decode.nvimgcodec_unavailable_reason``, looked up
    here without importing ``ingest_gpu``: NumPy's import would delay the group's join)."""
    if settings.device == "cpu" or settings.gpu_decode == "off":
        return False
    try:
        return importlib.util.find_spec("nvidia.nvimgcodec") is not None
    except (ImportError, ValueError):
        return False


async def _worker(settings: Settings) -> int:
    # The receiver goes in before the heavy imports, so an early SIGTERM also drains cleanly.
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        from ingest.source.group import GroupMember

        # The group join first: the broker holds it (a second on the embedded stack) while
        # the worker's modules import, in a thread so the join's round trips go on.
        member = GroupMember(settings)
        try:
            await member.start()
            worker = (await anyio.to_thread.run_sync(_import_worker))(settings, member=member)
            async with anyio.create_task_group() as group:

                async def on_signals() -> None:
                    async for signum in signals:
                        log.info("signal received; draining", signal=signal.Signals(signum).name)
                        worker.stop()

                group.start_soon(on_signals)
                await worker.run()
                group.cancel_scope.cancel()
        finally:
            await member.aclose()  # idempotent: the worker leaves the group itself
    return 0


def _import_worker() -> type[Worker]:
    """The worker's modules (pydicom, botocore, the stages): the slow part of start-up."""
    from ingest.worker import Worker

    return Worker


if __name__ == "__main__":
    sys.exit(main())
