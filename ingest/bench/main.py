"""``dicom-ingest bench``: every reader on the same objects, side by side, in one run.

Against the embedded stack (SeaweedFS + Tansu started here) or an S3 endpoint and
broker given on the command line (credentials from the standard AWS variables). For
each workload (``ct``, ``large``, ``mix``) it runs, in order: the ceilings
(``curl``, ``threads``, ``kvikio-raw``), the ``naive`` path, ``kvikio`` (GPU only),
``put-raw`` (the outputs' ceiling: what ours' sink writes, PUT raw), ``ours`` (the
real worker through the broker, S3 sink on) and ``ours-hook`` (sink off, arrays
handed to a no-op user hook on the device), each with one warm-up pass that is
discarded and ``repeats`` measured passes; for each decode workload (``slide``,
``ct-j2k``, ``ct-htj2k``, ``ct-rle``, and ``ct-htj2k-volume``, ``ct-j2k-volume`` (a
series as one multi-frame object): compressed frames; ``--decode-corpus DIR``:
written beforehand) ``pydicom-loop``, ``cpu-pool``, ``nvimgcodec``,
``nvimgcodec-plugin`` (GPU only), ``ours`` and ``ours-hook`` the same way, with
frames/s (``decode``); with ``--processes LIST``, for each N, ``ours-hook-pN`` and
``ours-pN``: N real worker processes in one consumer group (``scaled``); then, with
``--sweep``, ours on the large object across part sizes and fetch concurrencies. It
writes a JSON file with every figure, prints the tables of ratios and targets, and
draws PNG plots when matplotlib is installed.

Modules: ``config`` (the flags, a worker's environment), ``workloads`` and
``workloads_compressed`` (objects), ``reader_runs`` (which reader runs where,
measured how), ``readers`` (CPU references), ``put_raw`` (the outputs' ceiling),
``decode`` (decode references, frames/s, their ratios), ``decode_gpu`` (nvImageCodec
and its pydicom plugin), ``gpu`` (KvikIO, pinned-copy reference), ``ours`` (the
worker), ``scaled`` and ``scaled_pass`` (N worker processes, measured from outside),
``measure`` (time, CPU, RSS), ``report`` (ratios, targets, table, JSON), ``plots``
(PNGs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ingest.bench import gpu as bench_gpu
from ingest.bench.config import (
    OURS_MODES,
    BenchConfig,
    s3_target,
    worker_environment,
    worker_settings,
)
from ingest.bench.decode import add_decode_rates, decode_ratios
from ingest.bench.decode import pass_limit_s as decode_pass_limit_s
from ingest.bench.measure import MiB, load_watch, machine_info
from ingest.bench.ours import HOOK_SPEC, OursRunner
from ingest.bench.reader_runs import (
    failed_run,
    make_reader,
    measure_reader,
    readers_for,
    skipped,
)
from ingest.bench.report import (
    method,
    notes,
    plots,
    print_tables,
    ratios,
    scaling,
    targets,
    write_json,
)
from ingest.bench.scaled import ScaledRunner, ScaledSpec, scaled_label
from ingest.bench.workloads import (
    DECODE_WORKLOADS,
    BenchObject,
    S3Target,
    Workload,
    ensure_buckets,
    prepare_workloads,
    warmup_object,
)
from ingest.embedded.stack import Stack, create_topics, embedded_stack, weed_bin
from ingest.pipeline.jobs import device_plan


class _Steps:
    """A rich progress bar over the (workload, reader) steps and sweep points."""

    def __init__(self, progress: Progress, total: int) -> None:
        self._progress = progress
        self._task = progress.add_task("starting", total=total)

    def label(self, text: str) -> None:
        self._progress.update(self._task, description=text)

    def done(self) -> None:
        self._progress.advance(self._task)


async def _run_ours(
    config: BenchConfig,
    target: S3Target,
    bootstrap: str,
    token: str,
    label: str,
    mode: str,
    objects: tuple[BenchObject, ...],
    warmup: tuple[BenchObject, ...],
    repeats: int,
    paced: float | None,
    pids: list[int],
    limit_s: float | None = None,
    **tune: int,
) -> dict[str, Any]:
    settings = worker_settings(config, target, bootstrap, token, f"{label}-{mode}", mode, **tune)
    await anyio.to_thread.run_sync(create_topics, bootstrap, [settings.source_topic])
    runner = OursRunner(settings, target.source_bucket, pids)
    result = await runner.measure(objects, warmup, repeats, paced, limit_s)
    result["settings"] = {
        "part_size": settings.part_size,
        "ring_slots": settings.ring_slots,
        "fetch_concurrency": settings.fetch_concurrency,
        "max_objects_in_flight": settings.max_objects_in_flight,
        "output_dtype": settings.output_dtype,
        "device": settings.device,
        "backend": runner.worker.backend,
        "sink": settings.sink,
        "hook": settings.hook,
        "decode_processes": settings.decode_processes,
    }
    return result


async def _run_scaled(
    config: BenchConfig,
    target: S3Target,
    bootstrap: str,
    token: str,
    workload: Workload,
    mode: str,
    processes: int,
    pids: list[int],
    logs: Path,
) -> dict[str, Any]:
    """``mode`` with ``processes`` worker processes in one group (``scaled``)."""
    label = scaled_label(mode, processes)
    if len(workload.objects) < 2 and processes > 1:  # p1 still runs: the worker's own RSS
        return skipped("skipped", "one object cannot be spread over processes", "one object")
    env = worker_environment(config, target, bootstrap, token, f"{workload.name}-{label}", mode)
    spec = ScaledSpec(
        processes,
        config.gpus,
        env,
        target.source_bucket,
        logs / f"{workload.name}-{label}.log",
        tuple(pids),
    )
    runner = ScaledRunner(spec)
    result = await runner.measure(
        workload.objects, workload.objects, config.repeats, _paced(config, workload.name)
    )
    result["mode"] = mode
    return result


def _paced(config: BenchConfig, workload: str) -> float | None:
    """The paced pass's rate for ``workload`` (0: half the median burst rate), or None:
    only the CT workload gets one."""
    return config.paced_rate if workload == "ct" else None


@contextlib.contextmanager
def _maybe_stack(config: BenchConfig, stack: Stack | None) -> Iterator[Stack | None]:
    if stack is not None or config.endpoint:
        yield stack
        return
    with embedded_stack() as started:
        yield started


async def run_bench(
    config: BenchConfig, stack: Stack | None = None, console: Console | None = None
) -> dict[str, Any]:
    """Run the whole benchmark; returns the report (also written under ``config.out``).

    Raises:
        ConfigError, StackError: the embedded stack could not start.
        RuntimeError: a reader failed (a wrong byte count, an HTTP error).
    """
    console = console or (Console() if sys.stdout.isatty() else Console(width=150))
    config.out.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex[:8]
    started = datetime.now(UTC)
    report: dict[str, Any] = {"version": 1, "command": sys.argv, "started": started.isoformat()}
    report["config"] = {
        k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(config).items()
    }
    with _maybe_stack(config, stack) as running:
        if running is not None:
            # The worker takes S3 credentials from the standard AWS variables, as botocore does.
            os.environ.update(running.endpoints.environment())
        target = s3_target(config, running, token)
        bootstrap = running.kafka.bootstrap if running else str(config.bootstrap)
        pids = [running.s3.pid, running.kafka.pid] if running else []
        gpu = bench_gpu.gpu_name()
        report["machine"] = machine_info(gpu, weed_bin() if running else None)
        report["method"] = method(config.repeats, config.concurrency, config.part_mb, HOOK_SPEC)
        with (
            load_watch(report.setdefault("load", {})),
            tempfile.TemporaryDirectory(prefix="dicom-ingest-bench-") as tmp,
            Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                console=console,
            ) as progress,
        ):
            steps = _Steps(progress, _count_steps(config))
            await anyio.to_thread.run_sync(ensure_buckets, target)
            topics = [f"bench-{token}-{t}" for t in ("results", "dlq", "audit")]
            await anyio.to_thread.run_sync(create_topics, bootstrap, topics)
            workloads = await anyio.to_thread.run_sync(
                prepare_workloads,
                target,
                list(config.workloads),
                config.ct_count,
                config.large_mb,
                Path(tmp),
                steps.label,
                config.large_syntax,
                config.slide_mb,
                config.decode_corpus,
            )
            report["workloads"] = {n: w.describe() for n, w in workloads.items()}
            warm = (await anyio.to_thread.run_sync(warmup_object, target),)
            report["results"] = {}
            for name, workload in workloads.items():
                results: dict[str, Any] = report["results"].setdefault(name, {})
                limit = decode_pass_limit_s(workload) if name in DECODE_WORKLOADS else None
                for reader_name in readers_for(name, config.readers):
                    steps.label(f"{name}: {reader_name}")
                    if reader_name in OURS_MODES:
                        results[reader_name] = await _run_ours(
                            config,
                            target,
                            bootstrap,
                            token,
                            name,
                            reader_name,
                            workload.objects,
                            workload.objects,
                            config.repeats,
                            _paced(config, name),
                            pids,
                            limit,
                        )
                    else:
                        reader = make_reader(reader_name, config, target)
                        if isinstance(reader, dict):
                            results[reader_name] = reader
                        else:
                            results[reader_name] = await anyio.to_thread.run_sync(
                                measure_reader, reader, workload, config.repeats, pids
                            )
                    steps.done()
                for processes in config.processes:
                    for mode in config.scaled_modes:
                        label = scaled_label(mode, processes)
                        steps.label(f"{name}: {label}")
                        try:
                            results[label] = await _run_scaled(
                                config,
                                target,
                                bootstrap,
                                token,
                                workload,
                                mode,
                                processes,
                                pids,
                                Path(tmp),
                            )
                        except Exception as exc:  # reported; the other runs still go on
                            log_file = Path(tmp) / f"{name}-{label}.log"
                            results[label] = failed_run(exc, log_file, config.out)
                            console.print(f"[red]{name}: {label} failed: {exc!r}[/red]")
                        steps.done()
                for entry in results.values():
                    add_decode_rates(entry, workload)  # decode workloads: frames/s
            if config.sweep and "large" in workloads:
                report["sweeps"] = await _sweeps(
                    config, target, bootstrap, token, workloads["large"], warm, pids, steps
                )
            # The large object's chunk size in each mode (the sink's are smaller).
            chunks = {
                mode: device_plan(
                    worker_settings(config, target, bootstrap, token, "h2d", mode), "cuda"
                ).chunk_bytes
                for mode in ("ours-hook", "ours")
            }
            report["h2d_reference"] = _h2d_reference(config, gpu is not None, chunks)
    report["finished"] = datetime.now(UTC).isoformat()
    report["ratios"] = ratios(report)
    report["decode_ratios"] = decode_ratios(report)
    report["scaling"] = scaling(report)
    report["targets"] = targets(report)
    report["notes"] = notes(report)
    _write(report, config, started, console)
    return report


async def _sweeps(
    config: BenchConfig,
    target: S3Target,
    bootstrap: str,
    token: str,
    large: Workload,
    warm: tuple[BenchObject, ...],
    pids: list[int],
    steps: _Steps,
) -> dict[str, Any]:
    """Ours on the large object: one measured pass per point, after a one-slice warm-up."""
    out: dict[str, Any] = {
        "method": f"{config.sweep_mode} on the large object; warm-up: one CT slice; 1 pass",
        "mode": config.sweep_mode,
    }
    axes: list[tuple[str, tuple[int, ...], Callable[[int], dict[str, int]]]] = [
        ("part_size", config.sweep_parts_mb, lambda v: {"part": v * MiB}),
        ("concurrency", config.sweep_concurrency, lambda v: {"concurrency": v}),
    ]
    for axis, values, tune in axes:
        points = []
        for value in values:
            steps.label(f"sweep {axis} = {value}")
            result = await _run_ours(
                config,
                target,
                bootstrap,
                token,
                f"sweep-{axis}-{value}",
                config.sweep_mode,
                large.objects,
                warm,
                1,
                None,
                pids,
                None,
                **tune(value),
            )
            run = result["runs"][0]
            keep = ("gb_per_s", "cpu_s_per_gb", "peak_rss_bytes", "other_cpu_share")
            point = {"value": value, "ring_bytes": result["ring_bytes"]}
            points.append(point | {k: run[k] for k in keep})
            steps.done()
        out[axis] = points
    return out


def _h2d_reference(config: BenchConfig, has_gpu: bool, chunks: dict[str, int]) -> dict[str, Any]:
    """Plain pinned copies of the size of each mode's chunks of the large object (``part``:
    the hook's, a whole part; ``by_mode``: each mode's) and of one CT slice."""
    if not has_gpu or config.device == "cpu":
        return {"status": "skipped", "note": "GPU only: no CUDA device"}
    rates = {size: bench_gpu.pinned_copy_rate(size) for size in sorted(set(chunks.values()))}
    return {
        "status": "ok",
        "part": rates[chunks["ours-hook"]],
        "by_mode": {mode: rates[size] for mode, size in chunks.items()},
        "ct_slice": bench_gpu.pinned_copy_rate(512 * 512 * 2),
    }


def _count_steps(config: BenchConfig) -> int:
    sweep = len(config.sweep_parts_mb) + len(config.sweep_concurrency) if config.sweep else 0
    scaled = len(config.processes) * len(config.scaled_modes)
    readers = sum(len(readers_for(w, config.readers)) for w in config.workloads)
    return readers + len(config.workloads) * scaled + sweep


def _write(
    report: dict[str, Any], config: BenchConfig, started: datetime, console: Console
) -> None:
    stamp = started.strftime("%Y%m%d-%H%M%S")
    path = config.out / f"bench-{stamp}.json"
    if config.plots:
        try:
            report["plots"] = plots(report, config.out)
        except ImportError:
            report["notes"].append(
                "no PNG plots: matplotlib is not installed (pip install 'dicom-ingest[bench]')"
            )
    write_json(path, report)
    print_tables(console, report)
    console.print(f"JSON: {path}")
    for png in report.get("plots", []):
        console.print(f"plot: {png}")


async def bench_command(config: BenchConfig) -> int:
    """The CLI entry: run, print, exit 0 (a failed reader raises)."""
    started = time.perf_counter()
    await run_bench(config)
    Console().print(f"bench finished in {time.perf_counter() - started:.0f} s")
    return 0
