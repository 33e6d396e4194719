"""Decode throughput: the references for the decode workloads, their figures and ratios.

On the same frames (``workloads_compressed``), two ways to decode them on the CPU
(below), two on the GPU (``decode_gpu``: ``nvimgcodec``, nvImageCodec's batched
decode, the ceiling; ``nvimgcodec-plugin``, NVIDIA's pydicom plugin, the peer), and ours:

- ``pydicom-loop`` (the baseline users have): one thread, for each object
  ``pydicom.dcmread`` of its file and ``pixel_array``, with whatever plugin
  pydicom picks first; the frames of a multi-frame object through
  ``pydicom.pixels.iter_pixels`` instead, one at a time (same decoders and
  colour conversion): ``pixel_array`` converts YBR to RGB over the whole array
  in float64, 8 bytes a sample, so a 200 MiB slide peaks at ~20 GB there;
- ``cpu-pool`` (the CPU's decode ceiling for our codec): every frame's
  codestream split out beforehand and held in memory, then
  ``ingest.dicom.codec.decode_encapsulated`` over groups of them in a
  ``ProcessPoolExecutor`` of one (spawned) process a core, the decoded arrays
  sent back as the worker's decoding pool sends them;
- ``ours`` and ``ours-hook``: the worker end to end, notification to result
  (``ours``), with its own decoding pool (``DICOM_INGEST_DECODE_PROCESSES``).

Each run gets frames/s and decoded MB/s (the bytes ``pixel_array`` returns),
and each workload the ratios of ours to every reference (medians of frames/s on
both sides), judged against the goals of ours-hook on the GPU (``DECODE_GOALS``).
"""

from __future__ import annotations

import math
import multiprocessing
import warnings
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from ingest.bench.measure import summarize
from ingest.bench.workloads import DECODE_WORKLOADS, Workload

DECODE_READERS = ("pydicom-loop", "cpu-pool", "nvimgcodec", "nvimgcodec-plugin")
# Goals of ours-hook over each reference, per workload (docs/benchmarks.md, "Decoding
# compressed objects"); RLE has no device decoder and no goal
DECODE_GOALS: dict[str, dict[str, float]] = {
    "slide": {"nvimgcodec": 0.8, "nvimgcodec-plugin": 5.0, "cpu-pool": 10.0},
    "slide-512": {"nvimgcodec": 0.8, "nvimgcodec-plugin": 5.0, "cpu-pool": 10.0},
    "ct-htj2k": {"nvimgcodec": 0.8, "nvimgcodec-plugin": 5.0, "cpu-pool": 10.0},
    "ct-jpeg": {"nvimgcodec": 0.8, "nvimgcodec-plugin": 5.0, "cpu-pool": 10.0},
    "ct-j2k": {"nvimgcodec": 0.8, "nvimgcodec-plugin": 5.0, "cpu-pool": 2.0},
    "ct-htj2k-volume": {"nvimgcodec": 0.8, "nvimgcodec-plugin": 5.0, "cpu-pool": 10.0},
    "ct-j2k-volume": {"nvimgcodec": 0.8, "nvimgcodec-plugin": 5.0, "cpu-pool": 2.0},
}
GOAL_MODE = "ours-hook"
GROUP_BYTES = 8 * 1024 * 1024  # decoded bytes of one task, as the worker's groups
TASKS_PER_PROCESS = 4  # at least this many tasks a process, so none waits on the last


def _check(reader: str, workload: Workload, frames: int, nbytes: int) -> dict[str, Any]:
    if (frames, nbytes) != (workload.frames, workload.decoded_bytes):
        raise RuntimeError(
            f"{reader} on {workload.name}: {frames} frames, {nbytes} bytes decoded; "
            f"expected {workload.frames}, {workload.decoded_bytes}"
        )
    return {"frames": frames, "decoded_bytes": nbytes}


def pydicom_loop(reader: str, workload: Workload, plugin: str | None = None) -> dict[str, Any]:
    """``dcmread`` + ``pixel_array`` over the workload's files in this thread
    (``iter_pixels`` frame by frame for multi-frame objects), with pydicom's first
    available plugin, or ``plugin`` when named; the figures ``_check`` gives."""
    from pydicom import dcmread
    from pydicom.pixels.utils import iter_pixels

    frames = nbytes = 0
    per_frame = workload.frames > len(workload.files)  # multi-frame objects
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # odd-but-readable objects; not the point here
        for path in workload.files:
            if per_frame:
                for arr in iter_pixels(path, decoding_plugin=plugin or ""):
                    frames += 1
                    nbytes += int(arr.nbytes)
                continue
            ds = dcmread(path)
            if plugin:
                ds.pixel_array_options(decoding_plugin=plugin)
            arr = ds.pixel_array
            frames += int(ds.get("NumberOfFrames") or 1)
            nbytes += int(arr.nbytes)
            del arr, ds
    call = "iter_pixels" if per_frame else "pixel_array"
    return _check(reader, workload, frames, nbytes) | {"threads": 1, "pydicom_call": call}


class PydicomLoopReader:
    """The baseline: one thread, ``dcmread`` + ``pixel_array`` per object, from its file;
    ``iter_pixels`` over a multi-frame object's frames."""

    name = "pydicom-loop"

    def prepare(self, workload: Workload) -> None:
        if len(workload.files) != len(workload.objects):
            raise ValueError(f"{workload.name}: no local files to decode")

    def run(self, workload: Workload) -> dict[str, Any]:
        return pydicom_loop(self.name, workload)

    def close(self) -> None:
        pass


def _frames_of(path: Any) -> tuple[Any, list[bytes]]:
    """An object's codec and every frame's codestream (its fragments joined)."""
    from pydicom import dcmread
    from pydicom.encaps import generate_frames

    from ingest.dicom.codec import codec_from_dataset

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = dcmread(path)
        codec = codec_from_dataset(ds, str(ds.file_meta.TransferSyntaxUID))
        extended = None
        if ds.get("ExtendedOffsetTable") is not None:
            extended = (
                [int(v) for v in np.frombuffer(ds.ExtendedOffsetTable, "<u8")],
                [int(v) for v in np.frombuffer(ds.ExtendedOffsetTableLengths, "<u8")],
            )
        frames = list(
            generate_frames(
                ds.PixelData, number_of_frames=codec.number_of_frames, extended_offsets=extended
            )
        )
    return codec, frames


def decode_tasks(workload: Workload, processes: int) -> list[tuple[Any, list[bytes]]]:
    """(codec, frames) groups over the workload's frames in order: consecutive objects with
    equal codecs share groups; a group decodes to at most ``GROUP_BYTES`` (one frame when
    a frame is larger), and there are at least ``TASKS_PER_PROCESS`` a process."""
    per = max(
        1,
        min(
            GROUP_BYTES // max(1, workload.frame_bytes),
            math.ceil(workload.frames / (TASKS_PER_PROCESS * processes)),
        ),
    )
    runs: list[tuple[Any, list[bytes]]] = []
    for path in workload.files:
        codec, frames = _frames_of(path)
        if runs and runs[-1][0] == codec:
            runs[-1][1].extend(frames)
        else:
            runs.append((codec, frames))
    return [
        (codec, frames[i : i + per]) for codec, frames in runs for i in range(0, len(frames), per)
    ]


class CpuPoolReader:
    """The ceiling: our codec over every frame, held in memory, one process a core."""

    name = "cpu-pool"

    def __init__(self, processes: int = 0) -> None:
        from ingest.dicom.decoders import default_processes

        self.processes = processes or default_processes()
        self._tasks: list[tuple[Any, list[bytes]]] = []
        self._pool: ProcessPoolExecutor | None = None

    def prepare(self, workload: Workload) -> None:
        self._tasks = decode_tasks(workload, self.processes)
        context = multiprocessing.get_context("spawn")  # as the worker's pool
        self._pool = ProcessPoolExecutor(self.processes, mp_context=context)

    def run(self, workload: Workload) -> dict[str, Any]:
        from ingest.dicom.codec import decode_encapsulated

        assert self._pool is not None
        frames = nbytes = 0
        codecs, groups = zip(*self._tasks, strict=True)
        for arr in self._pool.map(decode_encapsulated, codecs, groups):
            frames += len(arr)
            nbytes += int(arr.nbytes)
        extra = {"processes": self.processes, "tasks": len(self._tasks)}
        return _check(self.name, workload, frames, nbytes) | extra

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
        self._pool, self._tasks = None, []


def pass_limit_s(workload: Workload) -> float:
    """How long one pass of ours may take over a decode workload: generous (20 frames/s,
    float32 output at 50 MB/s), so a stall fails the run rather than hanging it."""
    return 120.0 + workload.bytes / 20e6 + workload.frames / 20 + workload.decoded_bytes * 4 / 50e6


def add_decode_rates(entry: dict[str, Any], workload: Workload) -> None:
    """Frames/s, decoded MB/s and CPU microseconds a frame (``cpu_us_per_frame``: the run's
    ``cpu_s``, as ``cpu_ms_per_object`` divides it) in each run of ``entry``, and the
    medians."""
    if entry.get("status") != "ok" or not workload.frames:
        return
    for run in entry["runs"]:
        seconds = float(run["seconds"])
        run["frames"], run["decoded_bytes"] = workload.frames, workload.decoded_bytes
        run["frames_per_s"] = workload.frames / seconds if seconds else 0.0
        run["decoded_mb_per_s"] = workload.decoded_bytes / seconds / 1e6 if seconds else 0.0
        run["cpu_us_per_frame"] = float(run["cpu_s"]) * 1e6 / workload.frames
    entry.update(summarize(entry["runs"]))


def _median(readers: dict[str, Any], name: str, key: str) -> float | None:
    entry = readers.get(name, {})
    value = entry.get("median", {}).get(key) if entry.get("status") == "ok" else None
    return float(value) if value is not None else None


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def decode_ratios(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per decode workload and run of ours (``ours``, ``ours-hook``, ``-pN``): frames/s and
    decoded MB/s, over each reference's (medians): ``ours_over_<reader>`` with the
    reader's name in snake case (None where it did not run)."""
    rows = []
    for workload, readers in report["results"].items():
        if workload not in DECODE_WORKLOADS:
            continue
        refs = {name: _median(readers, name, "frames_per_s") for name in DECODE_READERS}
        loop, pool = refs["pydicom-loop"], refs["cpu-pool"]
        for mode in readers:
            ours = _median(readers, mode, "frames_per_s") if mode.startswith("ours") else None
            if ours is None:
                continue
            row: dict[str, Any] = {
                "workload": workload,
                "mode": mode,
                "syntax": report["workloads"][workload].get("transfer_syntax"),
                "frames_per_s": ours,
                "decoded_mb_per_s": _median(readers, mode, "decoded_mb_per_s"),
            }
            for name, value in refs.items():
                row[f"{_key(name)}_frames_per_s"] = value
                row[f"ours_over_{_key(name)}"] = _over(ours, value)
            row["cpu_pool_over_pydicom_loop"] = _over(pool, loop)
            rows.append(row)
    return rows


def _key(reader: str) -> str:
    return reader.replace("-", "_")


def decode_targets(report: dict[str, Any], add: Any) -> None:
    """The decode goals of ours-hook (``DECODE_GOALS``) on each decode workload that ran,
    through ``report.targets``' ``add`` (judged on the GPU machine only)."""
    for row in report.get("decode_ratios", []):
        if row["mode"] != GOAL_MODE:
            continue
        for reader, goal in DECODE_GOALS.get(row["workload"], {}).items():
            v = row.get(f"ours_over_{_key(reader)}")
            add(
                f"decode {row['workload']}: {GOAL_MODE} / {reader}",
                "gpu",
                v,
                f">= {goal:g}",
                v is not None and v >= goal,
                "x",
            )


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_decode_tables(console: Console, report: dict[str, Any]) -> None:
    """A table per decode workload (frames/s, MB/s, CPU an object and a frame, the servers'
    CPU an object apart), then ours over the references."""
    for workload, readers in report["results"].items():
        if workload not in DECODE_WORKLOADS:
            continue
        info = report["workloads"][workload]
        table = Table(
            title=f"{workload}: {info['objects']} objects, {info['frames']} frames, "
            f"{info['bytes'] / 1e6:.1f} MB -> {info['decoded_bytes'] / 1e6:.0f} MB "
            "decoded (medians)"
        )
        columns = (
            "reader",
            "frames/s",
            "decoded MB/s",
            "source MB/s",
            "CPU ms/obj",
            "CPU us/frame",
            "servers ms/obj",
            "peak RSS MB",
            "p50 ms",
            "p99 ms",
            "note",
        )
        for column in columns:
            left = column in ("reader", "note")
            table.add_column(column, justify="left" if left else "right", no_wrap=column != "note")
        for name, entry in readers.items():
            if entry.get("status") != "ok":
                short = entry.get("short") or entry.get("note", "")
                table.add_row(name, *["-"] * (len(columns) - 2), f"{entry['status']}: {short}")
                continue
            m, lat = entry["median"], entry.get("latency_burst") or {}
            table.add_row(
                name,
                _fmt(m.get("frames_per_s"), 1),
                _fmt(m.get("decoded_mb_per_s"), 1),
                _fmt(m["gb_per_s"] * 1000, 1),
                _fmt(m.get("cpu_ms_per_object"), 2),
                _fmt(m.get("cpu_us_per_frame"), 1),
                _fmt(m.get("server_cpu_ms_per_object"), 2),
                _fmt(m["peak_rss_bytes"] / 1e6, 0),
                _fmt(lat.get("p50_ms"), 1),
                _fmt(lat.get("p99_ms"), 1),
                "latency: burst" if lat else "",
            )
        console.print(table)
    rows = report.get("decode_ratios", [])
    if not rows:
        return
    ratio = Table(title="decode: ours / references (frames/s, medians; goals of ours-hook)")
    heads = (
        "workload",
        "mode",
        "frames/s",
        "MB/s",
        *(f"/ {r}" for r in RATIO_ORDER),
        "cpu-pool / pydicom-loop",
    )
    for column in heads:
        ratio.add_column(column, justify="left" if column in ("workload", "mode") else "right")
    judged = bool(report.get("machine", {}).get("gpu"))  # the goals are the GPU machine's
    for r in rows:
        goals = DECODE_GOALS.get(r["workload"], {}) if r["mode"] == GOAL_MODE else {}
        cells = [
            _with_goal(r.get(f"ours_over_{_key(name)}"), goals.get(name), judged)
            for name in RATIO_ORDER
        ]
        ratio.add_row(
            r["workload"],
            r["mode"],
            _fmt(r["frames_per_s"], 1),
            _fmt(r["decoded_mb_per_s"], 1),
            *cells,
            _fmt(r["cpu_pool_over_pydicom_loop"], 3),
        )
    console.print(ratio)


RATIO_ORDER = ("nvimgcodec", "nvimgcodec-plugin", "cpu-pool", "pydicom-loop")


def _with_goal(value: float | None, goal: float | None, judged: bool) -> str:
    """A ratio, with its goal when it has one, judged on the GPU machine: ``0.912 (>= 0.8
    met)``."""
    if goal is None:
        return _fmt(value, 3)
    if value is None or not judged:
        return f"{_fmt(value, 3)} (>= {goal:g})"
    return f"{value:,.3f} (>= {goal:g} {'met' if value >= goal else 'missed'})"


METHOD = (
    "decode workloads (slide, slide-512, ct-j2k, ct-htj2k, ct-rle, ct-jpeg, ct-htj2k-volume, "
    "ct-j2k-volume): "
    "frames/s and decoded MB/s (the bytes pixel_array returns) over each run's seconds; "
    "pydicom-loop: one thread, dcmread of each "
    "object's local file + pixel_array (pydicom's first available plugin), a multi-frame "
    "object's frames one at a time through pydicom.pixels.iter_pixels; cpu-pool: "
    "ingest.dicom.codec.decode_encapsulated over frames split out beforehand and held in "
    f"memory, groups of at most {GROUP_BYTES // 2**20} MiB decoded, in a ProcessPoolExecutor of "
    "one spawned process "
    "a core, arrays sent back; nvimgcodec (GPU): the same frames held in memory, "
    "nvimgcodec.Decoder.decode over batches of 128, output left on the device, one "
    "synchronisation a run; nvimgcodec-plugin (GPU): NVIDIA's pydicom plugin registered and "
    "named as the decoding plugin, then pydicom-loop's loop (one frame a call, to the host); "
    "ours: the worker from notification to result, reading from S3, with its own decoding "
    "pool or the device; CPU includes live child processes (the pools)"
)
