"""The benchmark's outputs: ratios against its targets, the printed tables, JSON, PNG plots.

Ratios compare medians of the measured repeats on both sides (the JSON also
keeps every run and the best). A target is judged only on the kind of machine
it is set for (``scope``); elsewhere its value is shown for information.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ingest.bench.decode import METHOD as DECODE_METHOD
from ingest.bench.decode import decode_targets, print_decode_tables
from ingest.bench.measure import GB
from ingest.bench.workloads import CORPUS, DECODE_WORKLOADS

CEILINGS = ("curl", "threads", "kvikio-raw")
BUSY_SHARE = 0.15  # other processes' share of all cores above which a run is called disturbed
MODES = ("ours", "ours-hook")
SCALED = re.compile(r"^(?P<mode>ours|ours-hook)-p(?P<processes>\d+)$")  # scaled.py's labels
SCALE_EFFICIENCY = 0.9  # scale-out goal: pN >= 0.9 x N x p1 (1.8x for two workers on two GPUs)


def median_of(report: dict[str, Any], workload: str, reader: str, key: str) -> float | None:
    entry = report["results"].get(workload, {}).get(reader, {})
    if entry.get("status") != "ok":
        return None
    value = entry.get("median", {}).get(key)
    return float(value) if value is not None else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per workload and mode of ours: / fastest ceiling, / naive, / kvikio-raw, / kvikio
    (the decode workloads have their own: ``decode.decode_ratios``)."""
    rows = []
    for workload in report["results"]:
        if workload in DECODE_WORKLOADS:
            continue
        ceilings = {c: median_of(report, workload, c, "gb_per_s") for c in CEILINGS}
        present = {c: v for c, v in ceilings.items() if v is not None}
        fastest = max(present, key=lambda c: present[c]) if present else None
        for mode in MODES:
            ours = median_of(report, workload, mode, "gb_per_s")
            if ours is None:
                continue
            rows.append(
                {
                    "workload": workload,
                    "mode": mode,
                    "ours_gb_per_s": ours,
                    "fastest_ceiling": fastest,
                    "ours_over_ceiling": _ratio(ours, present.get(fastest) if fastest else None),
                    "ours_over_naive": _ratio(
                        ours, median_of(report, workload, "naive", "gb_per_s")
                    ),
                    "ours_over_kvikio_raw": _ratio(
                        ours, median_of(report, workload, "kvikio-raw", "gb_per_s")
                    ),
                    "ours_over_kvikio": _ratio(
                        ours, median_of(report, workload, "kvikio", "gb_per_s")
                    ),
                    **_output_ratios(report, workload, mode, ours),
                }
            )
    return rows


def _output_ratios(
    report: dict[str, Any], workload: str, mode: str, ours: float
) -> dict[str, float | None]:
    """The sink's: ours (sink on) over ``put-raw``, the raw PUT of the same outputs (both
    in source bytes/s), and ours' objects/s over ours-hook's (the sink on over off)."""
    if mode != "ours":
        return {"ours_over_put_raw": None, "sink_on_over_off": None}
    return {
        "ours_over_put_raw": _ratio(ours, median_of(report, workload, "put-raw", "gb_per_s")),
        "sink_on_over_off": _ratio(
            median_of(report, workload, "ours", "objects_per_s"),
            median_of(report, workload, "ours-hook", "objects_per_s"),
        ),
    }


def scaling(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Scaled runs (``ours-hook-pN``, ``ours-pN``): medians, and pN / p1 where p1 ran too."""
    rows = []
    for workload, readers in report["results"].items():
        found: dict[str, dict[int, dict[str, Any]]] = {}
        for label, entry in readers.items():
            match = SCALED.match(label)
            if match and entry.get("status") == "ok":
                found.setdefault(match["mode"], {})[int(match["processes"])] = entry
        for mode, by_n in found.items():
            base = float(by_n[1]["median"]["objects_per_s"]) if 1 in by_n else None
            for n, entry in sorted(by_n.items()):
                m = entry["median"]
                over = _ratio(float(m["objects_per_s"]), base)
                rows.append(
                    {
                        "workload": workload,
                        "mode": mode,
                        "label": f"{mode}-p{n}",
                        "processes": n,
                        "gpus": entry.get("gpus"),
                        "objects_per_s": m["objects_per_s"],
                        "gb_per_s": m["gb_per_s"],
                        "cpu_s_per_gb": m["cpu_s_per_gb"],
                        "cpu_ms_per_object": m.get("cpu_ms_per_object"),
                        "cpu_us_per_frame": m.get("cpu_us_per_frame"),
                        "server_cpu_ms_per_object": m.get("server_cpu_ms_per_object"),
                        "p99_ms": (entry.get("latency_paced") or entry["latency_burst"])["p99_ms"],
                        "over_p1": over,
                        "efficiency": over / n if over is not None else None,
                        "over_plain": _ratio(
                            float(m["gb_per_s"]), median_of(report, workload, "plain", "gb_per_s")
                        ),
                    }
                )
    return rows


def ours_entry(report: dict[str, Any], workload: str, mode: str) -> dict[str, Any]:
    entry: dict[str, Any] = report["results"].get(workload, {}).get(mode, {})
    return entry if entry.get("status") == "ok" else {}


def _target(
    name: str, scope: str, value: float | None, goal: str, ok: bool | None, here: str, unit: str
) -> dict[str, Any]:
    if value is None:
        status = "not measured"
    elif scope not in ("any", here):
        status = f"n/a here ({scope} target)"
    else:
        status = "met" if ok else "missed"
    return {
        "target": name,
        "scope": scope,
        "value": value,
        "unit": unit,
        "goal": goal,
        "status": status,
    }


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target (docs/benchmarks.md, "Where it stands"), for each mode of ours, the two
    for the sink, and the decode goals of ours-hook (``decode.DECODE_GOALS``), with met /
    missed / n/a here."""
    here = "gpu" if report["machine"].get("gpu") else "cpu"
    out: list[dict[str, Any]] = []

    def add(name: str, scope: str, value: float | None, goal: str, ok: Any, unit: str) -> None:
        judged = None if value is None else bool(ok)
        out.append(_target(name, scope, value, goal, judged, here, unit))

    reference = report.get("h2d_reference", {})
    for mode in MODES:
        if not any(ours_entry(report, w, mode) for w in report["results"]):
            continue
        by = {r["workload"]: r for r in report["ratios"] if r["mode"] == mode}
        large = by.get("large", {})
        v = large.get("ours_over_kvikio_raw")
        add(f"large: {mode} / KvikIO raw read", "gpu", v, ">= 1.0", v is not None and v >= 1, "x")
        v = large.get("ours_over_naive")
        add(f"large: {mode} / naive", "gpu", v, ">= 15", v is not None and v >= 15, "x")
        if mode == "ours":  # the outputs: the sink against the raw PUT, and sink off
            v = large.get("ours_over_put_raw")
            add("large: ours / put-raw", "gpu", v, ">= 0.9", v is not None and v >= 0.9, "x")
            v = by.get("ct", {}).get("sink_on_over_off")
            add(
                "CT: ours / ours-hook objects/s",
                "gpu",
                v,
                ">= 0.8",
                v is not None and v >= 0.8,
                "x",
            )
        v = large.get("ours_over_ceiling")
        add(
            f"large: {mode} / fastest raw reader",
            "cpu",
            v,
            ">= 0.8",
            v is not None and v >= 0.8,
            "x",
        )
        v = median_of(report, "ct", mode, "objects_per_s")
        add(f"CT: {mode} objects/s", "gpu", v, ">= 2000", v is not None and v >= 2000, "obj/s")
        v = ours_entry(report, "ct", mode).get("latency_paced", {}).get("p99_ms")
        add(f"CT: {mode} p99 at half the rate", "gpu", v, "< 50", v is not None and v < 50, "ms")
        ref = reference.get("by_mode", {}).get(mode) or reference.get("part", {})  # same size
        v = _ratio(
            ours_entry(report, "large", mode).get("h2d", {}).get("gb_per_s"), ref.get("gb_per_s")
        )
        add(f"large: {mode} H2D / pinned copy", "gpu", v, ">= 0.9", v is not None and v >= 0.9, "x")
        v = median_of(report, "large", mode, "cpu_s_per_gb")
        add(
            f"large: {mode} CPU core-s per GB",
            "any",
            v,
            "<= 0.5",
            v is not None and v <= 0.5,
            "s/GB",
        )
        o = ours_entry(report, "large", mode)
        over = None
        if o:
            over = (float(o["median"]["peak_rss_bytes"]) - float(o["ring_bytes"])) / 1e6
        ok = over is not None and over <= 300
        add(f"large: {mode} peak RSS - ring (the bench's process)", "any", over, "<= 300", ok, "MB")
        allocs = [
            sum(ours_entry(report, w, mode).get("steady_state_allocations", {}).values())
            for w in report["results"]
            if ours_entry(report, w, mode)
        ]
        v = float(sum(allocs)) if allocs else None
        add(f"{mode}: steady-state pinned/device allocations", "any", v, "== 0", v == 0, "count")
    _worker_rss_targets(report, add)
    _scaled_targets(report, add)
    decode_targets(report, add)
    return out


def _worker_rss_targets(report: dict[str, Any], add: Any) -> None:
    """Peak RSS over the ring of a worker process on the large object (``--processes``).

    In-process modes share the bench's process with the readers (KvikIO's destination,
    the publisher), so this is the figure the target is about.
    """
    for label, entry in report["results"].get("large", {}).items():
        if entry.get("status") != "ok" or "ring_bytes_per_process" not in entry:
            continue
        peak = float(entry["median"]["child_peak_rss_bytes"])
        over = (peak - float(entry["ring_bytes_per_process"])) / 1e6
        add(
            f"large: {label} peak RSS - ring (a worker process)",
            "any",
            over,
            "<= 300",
            over <= 300,
            "MB",
        )


def _scaled_targets(report: dict[str, Any], add: Any) -> None:
    """CT objects/s with the best scaled run; scale-out pN / p1 per mode (largest N); the
    corpus with one worker process (sink on) over the plain sequential worker (a CPU
    machine's target)."""
    corpus = [
        r
        for r in report.get("scaling", [])
        if r["workload"] == CORPUS and r["label"] == "ours-p1" and r["over_plain"] is not None
    ]
    for r in corpus:
        v = float(r["over_plain"])
        add("corpus: ours-p1 / plain", "cpu", v, ">= 3", v >= 3, "x")
    rows = [r for r in report.get("scaling", []) if r["workload"] == "ct"]
    if not rows:
        add(
            "CT objects/s, N processes (run with --processes)",
            "gpu",
            None,
            ">= 2000",
            False,
            "obj/s",
        )
        add(
            "2 GPUs / 1 GPU (run with --processes 1,2 --gpus 0,1)",
            "gpu",
            None,
            ">= 1.8",
            False,
            "x",
        )
        return
    best = max(rows, key=lambda r: float(r["objects_per_s"]))
    v = float(best["objects_per_s"])
    add(f"CT objects/s, best scaled ({best['label']})", "gpu", v, ">= 2000", v >= 2000, "obj/s")
    for mode in MODES:
        scaled = [r for r in rows if r["mode"] == mode and r["over_p1"] is not None]
        if not any(r["processes"] > 1 for r in scaled):
            continue
        top = max(scaled, key=lambda r: int(r["processes"]))
        n, goal = int(top["processes"]), SCALE_EFFICIENCY * int(top["processes"])
        gpus = f", GPUs {top['gpus']}" if top["gpus"] else ", no --gpus"
        v = float(top["over_p1"])
        add(f"scale-out: CT {mode} p{n} / p1{gpus}", "gpu", v, f">= {goal:.1f}", v >= goal, "x")


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def measured_text(target: dict[str, Any]) -> str:
    """A target's measured value as the table prints it; ratios to three decimals, so that
    0.996x is not printed as a missed 1.00x."""
    if target["value"] is None:
        return "-"
    digits = 3 if target["unit"] == "x" else 2
    return f"{_fmt(target['value'], digits)} {target['unit']}"


def print_tables(console: Console, report: dict[str, Any]) -> None:
    """Per-workload figures, then the ratios and the targets."""
    for workload, readers in report["results"].items():
        if workload in DECODE_WORKLOADS:
            continue  # print_decode_tables
        info = report["workloads"][workload]
        title = f"{workload}: {info['objects']} objects, {info['bytes'] / 1e9:.3f} GB (medians)"
        table = Table(title=title)
        for column in (
            "reader",
            "GB/s",
            "obj/s",
            "CPU s/GB",
            "CPU ms/obj",
            "servers ms/obj",
            "peak RSS MB",
            "p50 ms",
            "p99 ms",
            "note",
        ):
            left = column in ("reader", "note")
            table.add_column(column, justify="left" if left else "right", no_wrap=column != "note")
        for name, entry in readers.items():
            if entry.get("status") != "ok":
                short = entry.get("short") or entry.get("note", "")
                table.add_row(name, *["-"] * 8, f"{entry['status']}: {short}")
                continue
            m = entry["median"]
            lat = entry.get("latency_paced") or entry.get("latency_burst") or {}
            table.add_row(
                name,
                _fmt(m["gb_per_s"], 3),
                _fmt(m["objects_per_s"], 1),
                _fmt(m["cpu_s_per_gb"]),
                _fmt(m.get("cpu_ms_per_object")),
                _fmt(m.get("server_cpu_ms_per_object")),
                _fmt(m["peak_rss_bytes"] / 1e6, 0),
                _fmt(lat.get("p50_ms"), 1),
                _fmt(lat.get("p99_ms"), 1),
                "latency: paced" if "latency_paced" in entry else ("latency: burst" if lat else ""),
            )
        console.print(table)
    print_decode_tables(console, report)
    ratio = Table(title="ours / reference (GB/s, medians)")
    for column in (
        "workload",
        "mode",
        "GB/s",
        "fastest ceiling",
        "/ ceiling",
        "/ naive",
        "/ kvikio-raw",
        "/ kvikio",
        "/ put-raw",
        "sink on/off",
    ):
        ratio.add_column(column, justify="left" if column in ("workload", "mode") else "right")
    for r in report["ratios"]:
        ratio.add_row(
            r["workload"],
            r["mode"],
            _fmt(r["ours_gb_per_s"], 3),
            _fmt(r["fastest_ceiling"]),
            _fmt(r["ours_over_ceiling"]),
            _fmt(r["ours_over_naive"]),
            _fmt(r["ours_over_kvikio_raw"]),
            _fmt(r["ours_over_kvikio"]),
            _fmt(r.get("ours_over_put_raw")),
            _fmt(r.get("sink_on_over_off")),
        )
    if report["ratios"]:
        console.print(ratio)
    if report.get("scaling"):
        scale = Table(title="scaled: N worker processes in one group (medians; measured outside)")
        for column in (
            "workload",
            "run",
            "GPUs",
            "obj/s",
            "GB/s",
            "CPU s/GB",
            "CPU ms/obj",
            "CPU us/frame",
            "servers ms/obj",
            "p99 ms",
            "/ p1",
            "efficiency",
            "/ plain",
        ):
            scale.add_column(column, justify="left" if column in ("workload", "run") else "right")
        for r in report["scaling"]:
            scale.add_row(
                r["workload"],
                r["label"],
                r["gpus"] or "-",
                _fmt(r["objects_per_s"], 1),
                _fmt(r["gb_per_s"], 3),
                _fmt(r["cpu_s_per_gb"]),
                _fmt(r.get("cpu_ms_per_object")),
                _fmt(r.get("cpu_us_per_frame"), 1),
                _fmt(r.get("server_cpu_ms_per_object")),
                _fmt(r["p99_ms"], 1),
                _fmt(r["over_p1"]),
                _fmt(r["efficiency"]),
                _fmt(r.get("over_plain")),
            )
        console.print(scale)
    goals = Table(title="targets")
    for column in ("target", "measured", "goal", "status"):
        goals.add_column(column, justify="right" if column == "measured" else "left")
    colour = {"met": "green", "missed": "red"}
    for t in report["targets"]:
        style = colour.get(t["status"], "yellow")
        goals.add_row(t["target"], measured_text(t), t["goal"], f"[{style}]{t['status']}")
    console.print(goals)
    for note in report.get("notes", []):
        console.print(f"note: {note}")


def notes(report: dict[str, Any]) -> list[str]:
    """Notes printed under the tables and kept in the JSON."""
    out = [
        "ours: the S3 sink on (.npy + sidecar written); ours-hook: DICOM_INGEST_SINK=none with "
        "a no-op user hook (arrays stay on the device; nothing written to S3)",
        "CPU ms/obj, CPU us/frame: a run's CPU over its objects and frames (ours, ours-hook: "
        "the bench's process, its publisher included, and its decoding pools; -pN: the "
        "workers' process tree); servers ms/obj: the S3 server's and the broker's CPU over "
        "the same objects, apart from it (each in the JSON: s3_ and broker_cpu_ms_per_object)",
    ]
    shares = [
        float(run.get("other_cpu_share", 0.0))
        for readers in report.get("results", {}).values()
        for entry in readers.values()
        for run in entry.get("runs", [])
    ]
    busiest = max(shares, default=0.0)
    if busiest > BUSY_SHARE:
        out.append(
            f"other processes took up to {busiest:.0%} of the machine's CPU during a run "
            f"(other_cpu_share in the JSON): figures are disturbed; rerun on a quiet machine"
        )
    if report.get("scaling"):
        out.append(
            "ours-hook-pN / ours-pN: N worker processes (dicom-ingest worker --processes N) in "
            "one consumer group, measured from outside (result records at the bench); CPU s/GB "
            "is the workers' process tree, peak RSS the largest child's"
        )
    if set(report.get("results", {})) & set(DECODE_WORKLOADS):
        out.append(
            "decode workloads: pydicom-loop, cpu-pool, nvimgcodec and nvimgcodec-plugin decode "
            "local copies of the objects (no fetch); ours reads them from S3 and runs its whole "
            "pipeline"
        )
    if not report.get("sweeps"):
        out.append("no sweep (run with --sweep for throughput vs part size and concurrency)")
    total = sum(w["bytes"] for w in report.get("workloads", {}).values())
    out.append(f"{total / GB:.2f} GB of source objects; every figure from this one run")
    return out


def method(repeats: int, concurrency: int, part_mb: int, hook: str) -> dict[str, str]:
    """How every figure was taken (written into the JSON)."""
    return {
        "repeats": f"{repeats} measured runs per reader and workload",
        "warmup": "readers: one full run first, discarded; ours: one full pass first, discarded "
        "(sweep points: one CT slice)",
        "ours_modes": "ours: DICOM_INGEST_SINK=s3; ours-hook: DICOM_INGEST_SINK=none and "
        f"DICOM_INGEST_HOOK={hook} (a no-op hook on the device thread)",
        "statistic": "ratios use the median of the measured runs on both sides; "
        "'best' is the run with the highest GB/s",
        "throughput": "source object bytes / seconds; ours: from the first notification "
        "published to the last outcome reported",
        "latency": "ours: Outcome callback time (after output, sidecar, acknowledged result "
        "event and audit record) minus the time just before the notification was handed "
        "to the producer; 'burst' publishes everything at once (includes queueing), "
        "'paced' publishes at --paced-rate, by default half the median burst rate",
        "cpu": "process_time of this process (all threads, including the bench's own "
        "publisher) + RUSAGE_CHILDREN (curl) + live child processes other than the servers "
        "(decoding pools, /proc/PID/stat); server CPU apart as server_cpu_s (server_cpu_each_s: "
        "the S3 server, then the broker); per object: cpu_ms_per_object = cpu_s / objects "
        "and server_cpu_ms_per_object = server_cpu_s / objects (s3_ and broker_cpu_ms_per_object "
        "each), per frame (decode workloads): cpu_us_per_frame = cpu_s / frames",
        "rss": "VmHWM reset via /proc/self/clear_refs before each run; ours is compared "
        "with ring size = RING_SLOTS x PART_SIZE",
        "contention": "other_cpu_s = machine busy CPU (/proc/stat) during the run minus ours, "
        "our children's and the servers'; other_cpu_share = that / (seconds x cores)",
        "ceiling": f"{concurrency} parallel {part_mb} MiB ranges (KvikIO: {part_mb} MiB tasks); "
        "ours reads at its own part_size setting (in settings.part_size)",
        "put_raw": "the outputs' ceiling: the .npy and sidecar bytes ours writes for each "
        "object, PUT by plain threads through the sink's transport (threaded_http.put_from, "
        "presigned): multipart at the sink's part size and sink_parts_in_flight where the "
        "sink uses parts, else one PUT, on 2 x fetch_concurrency threads; its GB/s is of "
        "source bytes, as ours'",
        "scaled": "ours-hook-pN / ours-pN: `dicom-ingest worker --processes N` (the supervisor "
        "and N child workers in one group) on a fresh topic of 4 x N partitions, notifications "
        "round robin; latency = arrival of the result record at the bench's consumer "
        "(fetch_max_wait_ms=10) minus the publish time; throughput = objects / (last result "
        "- first publish); CPU = utime+stime of the supervisor's process tree (/proc/PID/stat), "
        "the bench's own apart (bench_cpu_s), per object and frame as in cpu; peak RSS = "
        "VmHWM per child (reset via clear_refs), the largest "
        "in peak_rss_bytes; warm-up, repeats and paced pass as ours",
        "plain": "the plain sequential worker (reader plain, named with --readers): one "
        "object at a time on one connection, whole GET into memory, pydicom, the Modality "
        "LUT in NumPy, float32, numpy.save, one PUT; objects pydicom cannot read are listed "
        "in failed and passed over",
        "decode": DECODE_METHOD,
    }


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.write_text(json.dumps(report, indent=2, sort_keys=False, default=str) + "\n")


def plots(report: dict[str, Any], out: Path) -> list[str]:
    """The PNG plots: throughput against part size and concurrency (the sweeps), and the
    latency CDF of every run of ours. Returns the files written, or raises ImportError
    without matplotlib (it comes with the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[str] = []
    sweeps = report.get("sweeps", {})
    for name, label in (("part_size", "part size (MiB)"), ("concurrency", "fetch concurrency")):
        points = [p for p in sweeps.get(name, []) if p.get("gb_per_s")]
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(
            [p["value"] for p in points],
            [p["gb_per_s"] for p in points],
            marker="o",
            label=f"{sweeps.get('mode', 'ours')} (large object)",
        )
        ceiling = max(
            (v for c in CEILINGS if (v := median_of(report, "large", c, "gb_per_s")) is not None),
            default=None,
        )
        if ceiling:
            ax.axhline(ceiling, linestyle="--", color="grey", label="fastest raw reader")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("GB/s")
        ax.set_title(f"throughput vs {label}")
        ax.legend()
        path = out / f"throughput_{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for workload, readers in report["results"].items():
        for mode in [*MODES, *(label for label in readers if SCALED.match(label))]:
            ours = ours_entry(report, workload, mode)
            for kind in ("latency_burst", "latency_paced"):
                values = ours.get(kind, {}).get("all_ms", [])
                if len(values) < 2:
                    continue
                ys = [(i + 1) / len(values) for i in range(len(values))]
                label = f"{mode} {workload} ({kind.split('_')[1]})"
                ax.step(values, ys, where="post", label=label)
                drawn = True
    if drawn:
        ax.set_xscale("log")
        ax.set_xlabel("notification -> result (ms)")
        ax.set_ylabel("fraction of objects")
        ax.set_title("ours: latency CDF")
        ax.legend(fontsize="x-small")
        path = out / "latency_cdf.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        written.append(str(path))
    plt.close(fig)
    return written
