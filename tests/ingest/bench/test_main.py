"""``dicom-ingest bench`` in a tiny configuration against the session's real stack.

Checks the shape of the report, not speed: every workload has every reader,
the CPU readers have positive figures, the GPU readers are reported as
skipped where CUDA is absent, the JSON file is written and the tables render;
the decode workloads get their own references, frames/s and ratios.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from ingest.bench.config import READERS, BenchConfig
from ingest.bench.decode import decode_ratios
from ingest.bench.decode_gpu import nvimgcodec_missing
from ingest.bench.gpu import kvikio_missing
from ingest.bench.main import run_bench
from ingest.bench.measure import TreeMeter, percentile, process_tree
from ingest.bench.reader_runs import readers_for
from ingest.bench.readers import plan_ranges
from ingest.bench.report import measured_text, scaling, targets
from ingest.bench.scaled_pass import GapWatch
from ingest.bench.workloads import (
    DECODE_WORKLOADS,
    BenchObject,
    S3Target,
    Workload,
    prepare_workloads,
)
from ingest.cli import bench_config, main, make_parser
from ingest.embedded.samples import pydicom_examples
from ingest.embedded.samples_compressed import compressed_samples
from ingest.embedded.stack import Stack
from ingest.settings import Settings

pytestmark = pytest.mark.usefixtures("aws_environment")

CPU_READERS = ("curl", "threads", "naive", "put-raw", "ours", "ours-hook")
GPU_READERS = ("kvikio-raw", "kvikio")
DEFAULTS = {f.name: f.default for f in dataclasses.fields(Settings)}
# the worker's own ring, not the tests' (harness.py shrinks it)
DEFAULT_RING = int(str(DEFAULTS["ring_slots"])) * int(str(DEFAULTS["part_size"]))


@pytest.mark.anyio
@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_tiny_bench_reports_every_reader_and_workload(stack: Stack, tmp_path: Path) -> None:
    config = BenchConfig(out=tmp_path, ct_count=3, large_mb=20, repeats=1, plots=True)
    output = io.StringIO()
    report = await run_bench(config, stack, Console(file=output, width=140))
    _check(report, _written(tmp_path), output.getvalue())


def _written(out: Path) -> dict[str, Any]:
    files = list(out.glob("bench-*.json"))
    assert len(files) == 1
    document: dict[str, Any] = json.loads(files[0].read_text())
    return document


def _check_per_object(entry: dict[str, Any]) -> None:
    """A run's CPU an object is its CPU over its objects; the servers' apart, S3 and broker."""
    for run in entry["runs"]:
        ms = 1000.0 / run["objects"]
        assert run["cpu_ms_per_object"] == pytest.approx(run["cpu_s"] * ms)
        assert run["server_cpu_ms_per_object"] == pytest.approx(run["server_cpu_s"] * ms)
        s3, broker = run["server_cpu_each_s"]  # the embedded stack's two servers
        assert run["s3_cpu_ms_per_object"] == pytest.approx(s3 * ms)
        assert run["broker_cpu_ms_per_object"] == pytest.approx(broker * ms)
        assert run["server_cpu_s"] == pytest.approx(s3 + broker)


def _check(report: dict[str, Any], on_disk: dict[str, Any], text: str) -> None:
    assert on_disk["results"].keys() == {"ct", "large", "mix"}
    assert report["machine"]["cpu_count"] >= 1
    for workload, readers in on_disk["results"].items():
        for name in CPU_READERS:
            entry = readers[name]
            assert entry["status"] == "ok", (workload, name, entry)
            assert len(entry["runs"]) == 1
            for key in (
                "gb_per_s",
                "objects_per_s",
                "cpu_s",
                "cpu_ms_per_object",
                "peak_rss_bytes",
            ):
                assert entry["median"][key] > 0, (workload, name, key)
            _check_per_object(entry)
        for name in GPU_READERS:
            if kvikio_missing() is not None:
                assert readers[name]["status"] == "skipped"
            else:  # the GPU machine with KvikIO carried
                assert readers[name]["status"] == "ok", (workload, name, readers[name])
                assert readers[name]["median"]["gb_per_s"] > 0
        for mode, sink in (("ours", "s3"), ("ours-hook", "none")):
            ours = readers[mode]
            assert ours["settings"]["sink"] == sink
            assert ours["latency_burst"]["p99_ms"] > 0
            assert ours["ring_bytes"] == DEFAULT_RING  # the default ring and part size
            assert set(ours["steady_state_allocations"]) >= {"pinned_allocations"}
        for mode in ("ours", "ours-hook"):  # the outside of process_object, split in two
            b = readers[mode]["latency_burst"]["breakdown_median"]
            assert b["delivery_ms"] > 0, (workload, b)
            assert b["after_process_object_ms"] > 0, (workload, b)
            if workload == "large":  # one object: the medians are its own values
                outside = b["delivery_ms"] + b["after_process_object_ms"]
                assert outside == pytest.approx(b["outside_process_object_ms"]), b
        assert readers["ours"]["hook_chunks"] == 0
        assert readers["ours-hook"]["hook_chunks"] >= len(readers["ours-hook"]["runs"])
    assert on_disk["results"]["ct"]["ours"]["latency_paced"]["count"] == 3
    put_raw = on_disk["results"]["large"]["put-raw"]["runs"][0]  # the output's multipart PUT
    assert (put_raw["multipart_objects"], put_raw["single_puts"]) == (1, 1)
    assert {(r["workload"], r["mode"]) for r in on_disk["ratios"]} == {
        (w, m) for w in ("ct", "large", "mix") for m in ("ours", "ours-hook")
    }
    assert any(t["status"] == "met" or t["status"] == "missed" for t in on_disk["targets"])
    assert "targets" in text
    assert "ours / reference" in text
    assert "CPU ms/obj" in text
    assert "servers ms/obj" in text
    if "plots" in on_disk:
        assert all(Path(p).is_file() for p in on_disk["plots"])
    else:
        assert any("matplotlib" in n for n in on_disk["notes"])


DECODE_RUN = ("pydicom-loop", "cpu-pool", "nvimgcodec", "nvimgcodec-plugin", "ours", "ours-hook")
GPU_DECODE = ("nvimgcodec", "nvimgcodec-plugin")


# One of each shape in the default run (tiles, a slice an object in 16 and 8 bits, a
# volume); every decode workload with the slow tests (about 80 s on two cores).
SOME_DECODE_WORKLOADS = ("slide", "ct-htj2k", "ct-jpeg", "ct-j2k-volume")


@pytest.mark.anyio
@pytest.mark.integration
@pytest.mark.timeout(180)  # eight decode workloads, six readers each, on a 2-core machine
@pytest.mark.parametrize(
    "workloads",
    [
        pytest.param(SOME_DECODE_WORKLOADS, id="some"),
        pytest.param(tuple(DECODE_WORKLOADS), id="every", marks=pytest.mark.slow),
    ],
)
async def test_tiny_bench_decodes_every_decode_workload(
    stack: Stack, tmp_path: Path, workloads: tuple[str, ...]
) -> None:
    config = BenchConfig(
        out=tmp_path,
        workloads=workloads,
        ct_count=2,
        slide_mb=1,
        repeats=1,
        plots=False,
    )
    output = io.StringIO()
    await run_bench(config, stack, Console(file=output, width=160))
    on_disk = _written(tmp_path)
    assert list(on_disk["results"]) == list(workloads)
    for workload, readers in on_disk["results"].items():
        info = on_disk["workloads"][workload]
        assert info["transfer_syntax"] == DECODE_WORKLOADS[workload]
        assert info["decoded_bytes"] == info["frames"] * info["frame_bytes"]
        assert tuple(readers) == DECODE_RUN  # no fetch reader on a decode workload
        for name in GPU_DECODE:
            entry = readers[name]
            if nvimgcodec_missing() is not None:
                assert (entry["status"], entry["short"]) == ("skipped", "GPU only"), entry
            elif workload == "ct-rle":  # no device decoder, no plugin for RLE
                assert entry["status"] == "skipped", entry
            else:  # the GPU machine, nvImageCodec carried
                assert entry["status"] == "ok", (workload, name, entry)
        for name in (n for n in DECODE_RUN if n not in GPU_DECODE):
            entry = readers[name]
            assert entry["status"] == "ok", (workload, name, entry)
            (run,) = entry["runs"]
            assert run["frames"] == info["frames"]
            for key in (
                "frames_per_s",
                "decoded_mb_per_s",
                "cpu_us_per_frame",
                "cpu_ms_per_object",
                "gb_per_s",
            ):
                assert entry["median"][key] > 0, (workload, name, key)
            assert run["cpu_us_per_frame"] == pytest.approx(run["cpu_s"] * 1e6 / run["frames"])
        assert readers["cpu-pool"]["runs"][0]["processes"] >= 1
        multi = workload.startswith("slide") or workload.endswith("-volume")
        call = "iter_pixels" if multi else "pixel_array"  # multi-frame: per frame
        assert readers["pydicom-loop"]["runs"][0]["pydicom_call"] == call
        assert readers["ours"]["settings"]["sink"] == "s3"
        assert readers["ours-hook"]["hook_chunks"] >= 1
        for mode in ("ours", "ours-hook"):
            _check_per_object(readers[mode])
    for name, side in (("slide", 256), ("slide-512", 512)):
        if name not in workloads:
            continue
        slide = on_disk["workloads"][name]
        across, down, tile = slide["tiles"]
        assert (slide["frames"], slide["frame_bytes"], tile) == (
            across * down,
            side * side * 3,
            side,
        )
        assert 0.5e6 < slide["bytes"] < 1.6e6  # about --slide-mb MiB
    series = {w: on_disk["workloads"][w]["frames"] for w in workloads if not w.startswith("slide")}
    assert series == dict.fromkeys(series, 2)
    sizes = {w: on_disk["workloads"][w]["frame_bytes"] for w in series}
    assert sizes == dict.fromkeys(series, 512 * 512 * 2) | {"ct-jpeg": 512 * 512}  # 8 bits
    for volume in (w for w in workloads if w.endswith("-volume")):
        assert on_disk["workloads"][volume]["objects"] == 1  # the series as one object
    assert on_disk["ratios"] == []  # the fetch ratios: no fetch workload ran
    rows = {(r["workload"], r["mode"]): r for r in on_disk["decode_ratios"]}
    assert set(rows) == {(w, m) for w in workloads for m in ("ours", "ours-hook")}
    for row in rows.values():
        assert min(row["ours_over_pydicom_loop"], row["ours_over_cpu_pool"]) > 0, row
    found = {t["target"]: t for t in on_disk["targets"]}
    assert found["decode ct-j2k-volume: ours-hook / cpu-pool"]["goal"] == ">= 2"
    assert found["decode slide: ours-hook / nvimgcodec"]["goal"] == ">= 0.8"
    if "ct-j2k" in workloads:
        assert found["decode ct-j2k: ours-hook / cpu-pool"]["goal"] == ">= 2"
    assert not [t for t in found if t.startswith("decode ct-rle")]  # no device decoder: no goal
    text = output.getvalue()
    assert "decode: ours / references" in text
    assert "CPU us/frame" in text
    assert "servers ms/obj" in text
    assert "ours / reference (GB/s" not in text


def test_readers_fit_their_workloads() -> None:
    assert readers_for("ct", READERS) == (
        "curl",
        "threads",
        "kvikio-raw",
        "naive",
        "kvikio",
        "put-raw",
        "ours",
        "ours-hook",
    )
    assert readers_for("slide", READERS) == DECODE_RUN
    assert readers_for("slide", ("put-raw", "ours")) == ("put-raw", "ours")  # named: the sink's
    assert readers_for("ct-rle", ("threads", "ours-hook", "cpu-pool")) == ("ours-hook", "cpu-pool")


def test_an_unknown_workload_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    target = S3Target("http://127.0.0.1:1", "us-east-1", "k", "s", "src", "out")
    with pytest.raises(ValueError, match="unknown workload ct-jpeg-ls"):
        prepare_workloads(target, ["ct-rle", "ct-jpeg-ls"], 1, 1, tmp_path)


def test_decode_ratios_are_ours_over_each_reference() -> None:
    def entry(frames_per_s: float) -> dict[str, Any]:
        median = {"frames_per_s": frames_per_s, "decoded_mb_per_s": frames_per_s / 2}
        return {"status": "ok", "median": median}

    report: dict[str, Any] = {
        "workloads": {"ct-j2k": {"transfer_syntax": DECODE_WORKLOADS["ct-j2k"]}},
        "results": {
            "ct-j2k": {
                "pydicom-loop": entry(40.0),
                "cpu-pool": entry(80.0),
                "ours-hook": entry(60.0),
                "ours": {"status": "failed"},
            },
            "ct": {"ours": entry(1.0)},  # not a decode workload
        },
    }
    (row,) = decode_ratios(report)
    assert (row["workload"], row["mode"], row["syntax"]) == (
        "ct-j2k",
        "ours-hook",
        "1.2.840.10008.1.2.4.90",
    )
    assert row["ours_over_pydicom_loop"] == pytest.approx(1.5)
    assert row["ours_over_cpu_pool"] == pytest.approx(0.75)
    assert row["cpu_pool_over_pydicom_loop"] == pytest.approx(2.0)
    assert row["decoded_mb_per_s"] == 30.0


def test_cli_bench_takes_the_decode_workloads_and_the_slide_size() -> None:
    args = make_parser().parse_args(["bench", "--workloads", "slide,ct-rle", "--slide-mb", "64"])
    config = bench_config(args)
    assert (config.workloads, config.slide_mb) == (("slide", "ct-rle"), 64)
    assert {"pydicom-loop", "cpu-pool"} <= set(config.readers)


# Enough slices that each of two worker processes spends several clock ticks (10 ms) of
# CPU in a pass: with 4, a process could finish its share inside one tick and read 0 s.
SCALED_SLICES = 24


@pytest.mark.anyio
@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_scaled_mode_runs_two_worker_processes(stack: Stack, tmp_path: Path) -> None:
    config = BenchConfig(
        out=tmp_path,
        workloads=("ct",),
        readers=(),
        ct_count=SCALED_SLICES,
        repeats=1,
        plots=False,
        processes=(2,),
        paced_rate=40.0,
    )
    output = io.StringIO()
    report = await run_bench(config, stack, Console(file=output, width=160))
    on_disk = _written(tmp_path)
    ct = on_disk["results"]["ct"]
    assert set(ct) == {"ours-hook-p2", "ours-p2"}
    for label, sink in (("ours-hook-p2", "none"), ("ours-p2", "s3")):
        entry = ct[label]
        assert entry["status"] == "ok", entry
        assert entry["supervisor_exit"] == 0  # SIGTERM: both children drained, exit 0
        assert (entry["processes"], entry["partitions"], entry["settings"]["sink"]) == (2, 8, sink)
        assert entry["workers"] == [f"bench-ct-{label}-0", f"bench-ct-{label}-1"]
        for key in (
            "gb_per_s",
            "objects_per_s",
            "cpu_s",
            "cpu_s_per_gb",
            "cpu_ms_per_object",
            "peak_rss_bytes",
        ):
            assert entry["median"][key] > 0, (label, key)
        _check_per_object(entry)  # the workers' process tree over the objects
        (run,) = entry["runs"]
        assert len(run["child_peak_rss_each"]) == 2
        assert sum(run["backends"].values()) == SCALED_SLICES  # "cpu" here, "cuda" on a GPU
        assert entry["latency_burst"]["count"] == SCALED_SLICES
        paced = entry["latency_paced"]
        assert paced["count"] == SCALED_SLICES
        assert paced["rate_objects_per_s"] == 40.0  # --paced-rate, not half the burst rate
        # the result records' own timestamps: after the publish, before the arrival (ms)
        assert 0 < paced["to_result_record"]["p50_ms"] <= paced["max_ms"] + 1.0
        assert sum(row[1] for row in paced["over_time"]) == SCALED_SLICES
        assert entry["latency_burst"]["p50_ms"] > 0
        assert entry["result_gaps"]["given_up"] == 0
    assert {(r["label"], r["over_p1"]) for r in on_disk["scaling"]} == {
        ("ours-hook-p2", None),
        ("ours-p2", None),  # no p1 in this run: no ratio
    }
    for row in on_disk["scaling"]:
        median = ct[row["label"]]["median"]
        assert row["cpu_ms_per_object"] == median["cpu_ms_per_object"] > 0
        assert row["server_cpu_ms_per_object"] == median["server_cpu_ms_per_object"]
        assert row["cpu_us_per_frame"] is None  # the ct workload counts no frames
    best = [t for t in report["targets"] if t["target"].startswith("CT objects/s, best scaled")]
    assert len(best) == 1
    assert best[0]["value"] > 0
    assert "scaled: N worker processes" in output.getvalue()
    assert "CPU ms/obj" in output.getvalue()


@pytest.mark.anyio
@pytest.mark.integration
@pytest.mark.slow  # the bench's corpus run; the readers it uses run in the tests above
@pytest.mark.timeout(240)
async def test_the_corpus_against_the_plain_sequential_worker(stack: Stack, tmp_path: Path) -> None:
    """The 2-core comparison: samples of many kinds, CT slices and a large
    object, one worker process with the sink on against the plain worker, which
    reads every sample (pydicom and its plugins) and PUTs every output."""
    config = BenchConfig(
        out=tmp_path,
        workloads=("corpus",),
        readers=("plain",),
        ct_count=3,
        large_mb=20,
        repeats=1,
        plots=False,
        processes=(1,),
        scaled_modes=("ours",),
    )
    output = io.StringIO()
    report = await run_bench(config, stack, Console(file=output, width=160))
    corpus = _written(tmp_path)["results"]["corpus"]
    assert set(corpus) == {"plain", "ours-p1"}
    plain = corpus["plain"]
    assert plain["status"] == "ok", plain
    (run,) = plain["runs"]
    assert run["failed"] == []
    objects = run["objects"]
    assert objects == 1 + 3 + len(pydicom_examples(dead_lettered=False)) + len(compressed_samples())
    assert run["outputs_put"] == objects  # put_object raises on a refused PUT
    ours = corpus["ours-p1"]
    assert ours["status"] == "ok", ours
    assert ours["latency_burst"]["count"] == objects
    assert ours["settings"]["sink"] == "s3"
    (row,) = _written(tmp_path)["scaling"]
    assert row["over_plain"] == pytest.approx(
        ours["median"]["gb_per_s"] / plain["median"]["gb_per_s"]
    )
    found = [t for t in report["targets"] if t["target"] == "corpus: ours-p1 / plain"]
    assert [t["value"] for t in found] == [row["over_plain"]]
    assert "/ plain" in output.getvalue()


def test_gap_watch_seeks_back_over_skipped_offsets() -> None:
    watch = GapWatch(patience=2)
    watch.expected = {"p0": 0, "p1": 0}
    assert [watch.check("p0", n) for n in (0, 1)] == [None, None]
    assert watch.check("p0", 3) == 2  # 2 was skipped: seek back to it
    assert watch.check("p0", 3) == 2  # still not visible: again
    assert [watch.check("p0", n) for n in (2, 3, 4)] == [None, None, None]  # it came
    assert watch.check("p1", 1) == 0  # the very first record of a partition
    assert watch.check("p1", 1) == 0
    assert watch.check("p1", 1) is None  # patience spent: the gap is accepted
    assert watch.check("p1", 2) is None
    assert (watch.refetched, watch.given_up) == (4, 1)


def _scaled_entry(objects_per_s: float, gpus: str | None) -> dict[str, Any]:
    median = {"objects_per_s": objects_per_s, "gb_per_s": objects_per_s / 2000, "cpu_s_per_gb": 1.0}
    return {"status": "ok", "median": median, "gpus": gpus, "latency_burst": {"p99_ms": 9.0}}


def test_scaling_ratios_and_targets() -> None:
    report: dict[str, Any] = {
        "machine": {"gpu": "H200"},
        "ratios": [],
        "results": {
            "ct": {
                "ours-hook-p1": _scaled_entry(500.0, "0,1"),
                "ours-hook-p2": _scaled_entry(950.0, "0,1"),
                "ours-p2": _scaled_entry(300.0, "0,1"),  # no p1 of this mode: no ratio
                "ours-hook": {"status": "ok", "median": {"objects_per_s": 1.0}},  # not scaled
            }
        },
    }
    report["scaling"] = scaling(report)
    rows = {r["label"]: r for r in report["scaling"]}
    assert set(rows) == {"ours-hook-p1", "ours-hook-p2", "ours-p2"}
    assert rows["ours-hook-p2"]["over_p1"] == pytest.approx(1.9)
    assert rows["ours-hook-p2"]["efficiency"] == pytest.approx(0.95)
    assert rows["ours-p2"]["over_p1"] is None
    found = {t["target"]: t for t in targets(report)}
    best = found["CT objects/s, best scaled (ours-hook-p2)"]
    assert (best["value"], best["status"]) == (950.0, "missed")
    out = found["scale-out: CT ours-hook p2 / p1, GPUs 0,1"]
    assert (out["goal"], out["status"]) == (">= 1.8", "met")
    assert not any(name.startswith("scale-out: CT ours p") for name in found)


def test_the_rss_target_of_a_worker_process_leaves_the_bench_process_out() -> None:
    ring = 805_306_368
    worker = _scaled_entry(1.8, None)
    worker.update(ring_bytes_per_process=ring, processes=1)
    worker["median"]["child_peak_rss_bytes"] = ring + 280e6
    in_process = {"status": "ok", "ring_bytes": ring, "median": {"peak_rss_bytes": ring + 730e6}}
    report: dict[str, Any] = {
        "machine": {"gpu": "H200"},
        "ratios": [],
        "results": {"large": {"ours-hook": in_process, "ours-hook-p1": worker}},
    }
    found = {t["target"]: t for t in targets(report)}
    bench = found["large: ours-hook peak RSS - ring (the bench's process)"]
    assert (bench["value"], bench["status"]) == (pytest.approx(730.0), "missed")
    own = found["large: ours-hook-p1 peak RSS - ring (a worker process)"]
    assert (own["value"], own["status"]) == (pytest.approx(280.0), "met")


def test_each_mode_s_copies_are_judged_against_a_pinned_copy_of_its_own_chunk_size() -> None:
    def large(gb_per_s: float) -> dict[str, Any]:
        median = {"peak_rss_bytes": 1e9, "cpu_s_per_gb": 0.3}
        return {"status": "ok", "ring_bytes": 8e8, "median": median, "h2d": {"gb_per_s": gb_per_s}}

    report: dict[str, Any] = {
        "machine": {"gpu": "H200"},
        "ratios": [],
        "results": {"large": {"ours-hook": large(52.0), "ours": large(45.0)}},
        "h2d_reference": {  # 32 MiB copies run faster than the sink's 8 MiB ones
            "part": {"gb_per_s": 55.0},
            "by_mode": {"ours-hook": {"gb_per_s": 55.0}, "ours": {"gb_per_s": 48.0}},
        },
    }
    found = {t["target"]: t for t in targets(report)}
    hook, sink = found["large: ours-hook H2D / pinned copy"], found["large: ours H2D / pinned copy"]
    assert (hook["value"], hook["status"]) == (pytest.approx(52 / 55), "met")
    assert (sink["value"], sink["status"]) == (pytest.approx(45 / 48), "met")  # not 45 / 55
    del report["h2d_reference"]["by_mode"]  # a report from before by_mode: the part's
    assert {t["target"]: t for t in targets(report)}["large: ours H2D / pinned copy"][
        "value"
    ] == pytest.approx(45 / 55)


def test_a_ratio_just_below_its_goal_does_not_print_as_the_goal() -> None:
    assert measured_text({"value": 0.9962, "unit": "x"}) == "0.996 x"
    assert measured_text({"value": 729.061, "unit": "MB"}) == "729.06 MB"
    assert measured_text({"value": None, "unit": "x"}) == "-"


def test_tree_meter_reads_a_worker_process() -> None:
    program = (
        "import time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", program])
    try:
        assert child.pid in process_tree(os.getpid())
        meter = TreeMeter(child.pid, ())
        time.sleep(0.5)
        meter.start()
        run = meter.run(1000, 1, seconds=1.0).as_dict()
    finally:
        child.kill()
        child.wait()
    assert run["child_peak_rss_each"] == [run["peak_rss_bytes"]]  # a lone worker: the root
    assert run["peak_rss_bytes"] > 64 << 20
    assert run["cpu_s"] == run["cpu_s_children"] >= 0.0


def test_plan_ranges_cover_every_byte_once() -> None:
    workload = Workload("w", (BenchObject("a", 10), BenchObject("b", 4), BenchObject("c", 8)))
    jobs = plan_ranges(workload, 4)
    assert [(j.key, j.start, j.length, j.dest) for j in jobs] == [
        ("a", 0, 4, 0),
        ("a", 4, 4, 4),
        ("a", 8, 2, 8),
        ("b", 0, 4, 10),
        ("c", 0, 4, 14),
        ("c", 4, 4, 18),
    ]


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([], 99) == 0.0


def test_cli_bench_needs_bootstrap_with_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--endpoint", "http://127.0.0.1:1"]) == 2
    assert "--bootstrap" in capsys.readouterr().err


def test_cli_bench_refuses_a_negative_paced_rate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--paced-rate", "-1"]) == 2
    assert "--paced-rate" in capsys.readouterr().err
