"""Which readers run on which workload, how each is made, and how one is measured.

The fetch workloads (``ct``, ``large``, ``mix``, ``corpus``) get the raw ceilings
(reads, and ``put-raw`` for the outputs), the naive path, the plain sequential worker
and KvikIO; the decode workloads
(``DECODE_WORKLOADS``) get the decode references (``decode``, ``decode_gpu``); both
get ours. A reader asked for
that does not fit a workload is left out of that workload's results; one that
cannot run here (no curl, no CUDA, no decoder for a workload's syntax) is
reported as skipped, with the reason.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from ingest.bench import gpu as bench_gpu
from ingest.bench.config import OURS_MODES, READERS, BenchConfig, worker_settings
from ingest.bench.decode import DECODE_READERS, CpuPoolReader, PydicomLoopReader
from ingest.bench.decode_gpu import (
    NvImageCodecReader,
    NvPluginReader,
    nvimgcodec_missing,
    plugin_missing,
)
from ingest.bench.measure import Meter, MiB, summarize
from ingest.bench.plain import PlainReader
from ingest.bench.put_raw import PutRawReader
from ingest.bench.readers import (
    CurlReader,
    NaiveReader,
    Reader,
    ReaderSkipped,
    ThreadsReader,
    curl_missing,
)
from ingest.bench.workloads import DECODE_WORKLOADS, S3Target, Workload


def readers_for(workload: str, readers: tuple[str, ...]) -> tuple[str, ...]:
    """``readers`` that run on ``workload``, in their order. ``put-raw`` (the sink's ceiling)
    runs on a decode workload (a slide's tiles, decoded for their values) only when
    ``--readers`` names the readers."""
    decode = workload in DECODE_WORKLOADS
    named = readers != READERS
    return tuple(
        r
        for r in readers
        if r in OURS_MODES or (r == "put-raw" and named) or (r in DECODE_READERS) == decode
    )


def skipped(status: str, note: str, short: str) -> dict[str, Any]:
    return {"status": status, "note": note, "short": short}


def failed_run(exc: BaseException, log_file: Path, keep_in: Path) -> dict[str, Any]:
    """A run that raised: its error and the end of its workers' log, for the report; the
    whole log is kept in ``keep_in`` (the temporary folder goes when the bench ends)."""
    errors = exc.exceptions if isinstance(exc, BaseExceptionGroup) else (exc,)
    note = "; ".join(f"{type(e).__name__}: {e}" for e in errors)
    try:
        tail = log_file.read_text(errors="replace").splitlines()[-40:]
        keep_in.mkdir(parents=True, exist_ok=True)
        kept: str | None = str(shutil.copy(log_file, keep_in / log_file.name))
    except OSError:
        tail, kept = [], None
    return skipped("failed", note, "failed") | {"log_tail": tail, "log": kept}


def measure_reader(
    reader: Reader, workload: Workload, repeats: int, pids: list[int]
) -> dict[str, Any]:
    """One warm-up run (discarded), then ``repeats`` measured runs; skipped where the
    reader's ``prepare`` says it cannot run on ``workload`` (``ReaderSkipped``)."""
    try:
        reader.prepare(workload)
    except ReaderSkipped as exc:
        reader.close()
        return skipped("skipped", str(exc), exc.short)
    except BaseException:
        reader.close()  # a registered plugin, a pool: undone before the error goes up
        raise
    try:
        reader.run(workload)
        runs = []
        for _ in range(repeats):
            with Meter(pids) as meter:
                extra = reader.run(workload)
            run = meter.result(workload.bytes, len(workload.objects))
            run.extra = extra
            runs.append(run.as_dict())
    finally:
        reader.close()
    return {"status": "ok", "runs": runs, **summarize(runs), "warmup": "1 run, discarded"}


def make_reader(name: str, config: BenchConfig, target: S3Target) -> Reader | dict[str, Any]:
    """The reader called ``name``, or why it is skipped here.

    Raises:
        ValueError: no reader of that name.
    """
    part, conc = config.part_mb * MiB, config.concurrency
    cuda = bench_gpu.cuda_missing()
    if name == "curl":
        why = curl_missing()
        return skipped("skipped", why, "no curl") if why else CurlReader(target, part, conc)
    if name == "threads":
        return ThreadsReader(target, part, conc)
    if name == "put-raw":  # at the settings ours runs with (``--set``); no broker needed
        settings = worker_settings(config, target, "127.0.0.1:9092", "put-raw", name, "ours")
        return PutRawReader(target, settings)
    if name == "naive":
        on_gpu = cuda is None and config.device != "cpu"
        return NaiveReader(target, conc, bench_gpu.to_device if on_gpu else None)
    if name == "plain":
        return PlainReader(target)
    if name in ("kvikio-raw", "kvikio"):
        why = bench_gpu.kvikio_missing()
        if why is not None:
            return skipped("skipped", f"GPU only: {why}", "GPU only")
        return bench_gpu.KvikioReader(target, part, conc, preprocess=name == "kvikio")
    if name == "pydicom-loop":
        return PydicomLoopReader()
    if name == "cpu-pool":
        return CpuPoolReader()
    if name in ("nvimgcodec", "nvimgcodec-plugin"):
        why = nvimgcodec_missing() if name == "nvimgcodec" else plugin_missing()
        if why is not None:
            return skipped("skipped", f"GPU only: {why}", "GPU only")
        return NvImageCodecReader() if name == "nvimgcodec" else NvPluginReader()
    raise ValueError(f"unknown reader {name!r}")
