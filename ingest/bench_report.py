"""The benchmark's outputs: ratios against the issue's targets, the printed tables, JSON, PNGs.

Ratios compare medians of the measured repeats on both sides (the JSON also
keeps every run and the best). A target is judged only on the kind of machine
it is set for (``scope``); elsewhere its value is shown for information.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

CEILINGS = ("curl", "threads", "kvikio-raw")


def _median(report: dict[str, Any], workload: str, reader: str, key: str) -> float | None:
    entry = report["results"].get(workload, {}).get(reader, {})
    if entry.get("status") != "ok":
        return None
    value = entry.get("median", {}).get(key)
    return float(value) if value is not None else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(report: dict[str, Any]) -> list[dict[str, Any]]:
    """ours / fastest ceiling, ours / naive, ours / kvikio-raw, ours / kvikio per workload."""
    rows = []
    for workload in report["results"]:
        ours = _median(report, workload, "ours", "gb_per_s")
        ceilings = {c: _median(report, workload, c, "gb_per_s") for c in CEILINGS}
        present = {c: v for c, v in ceilings.items() if v is not None}
        fastest = max(present, key=lambda c: present[c]) if present else None
        rows.append(
            {
                "workload": workload,
                "ours_gb_per_s": ours,
                "fastest_ceiling": fastest,
                "ours_over_ceiling": _ratio(ours, present.get(fastest) if fastest else None),
                "ours_over_naive": _ratio(ours, _median(report, workload, "naive", "gb_per_s")),
                "ours_over_kvikio_raw": _ratio(
                    ours, _median(report, workload, "kvikio-raw", "gb_per_s")
                ),
                "ours_over_kvikio": _ratio(ours, _median(report, workload, "kvikio", "gb_per_s")),
            }
        )
    return rows


def _ours(report: dict[str, Any], workload: str) -> dict[str, Any]:
    entry: dict[str, Any] = report["results"].get(workload, {}).get("ours", {})
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
    return {"target": name, "scope": scope, "value": value, "unit": unit, "goal": goal,
            "status": status}  # fmt: skip


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of issue 4 with the figure measured here and met / missed / n/a."""
    here = "gpu" if report["machine"].get("gpu") else "cpu"
    by = {r["workload"]: r for r in report["ratios"]}
    large, ct = by.get("large", {}), by.get("ct", {})
    out = []

    def add(name: str, scope: str, value: float | None, goal: str, ok: Any, unit: str) -> None:
        judged = None if value is None else bool(ok)
        out.append(_target(name, scope, value, goal, judged, here, unit))

    v = large.get("ours_over_kvikio_raw")
    add("large: ours / KvikIO raw read", "gpu", v, ">= 1.0", v is not None and v >= 1.0, "x")
    v = large.get("ours_over_naive")
    add("large: ours / naive", "gpu", v, ">= 15", v is not None and v >= 15, "x")
    v = large.get("ours_over_ceiling")
    add("large: ours / fastest raw reader", "cpu", v, ">= 0.8", v is not None and v >= 0.8, "x")
    v = _median(report, "ct", "ours", "objects_per_s")
    add("CT: ours objects/s", "gpu", v, ">= 2000", v is not None and v >= 2000, "obj/s")
    paced = _ours(report, "ct").get("latency_paced", {})
    v = paced.get("p99_ms")
    add("CT: p99 latency at half the rate", "gpu", v, "< 50", v is not None and v < 50, "ms")
    h2d = _ours(report, "large").get("h2d", {}).get("gb_per_s")
    ref = report.get("h2d_reference", {}).get("part", {}).get("gb_per_s")
    v = _ratio(h2d, ref)
    add("large: our H2D / plain pinned copy", "gpu", v, ">= 0.9", v is not None and v >= 0.9, "x")
    v = _median(report, "large", "ours", "cpu_s_per_gb")
    add("large: CPU core-seconds per GB", "any", v, "<= 0.5", v is not None and v <= 0.5, "s/GB")
    o = _ours(report, "large")
    over = None
    if o:
        over = (float(o["median"]["peak_rss_bytes"]) - float(o["ring_bytes"])) / 1e6
    ok = over is not None and over <= 300
    add("large: peak RSS - ring size", "any", over, "<= 300", ok, "MB")
    allocs = [
        sum(_ours(report, w).get("steady_state_allocations", {}).values())
        for w in report["results"]
        if _ours(report, w)
    ]
    v = float(sum(allocs)) if allocs else None
    add("steady-state pinned/device allocations", "any", v, "== 0", v == 0, "count")
    add("2 GPUs / 1 GPU throughput", "gpu", None, ">= 1.8", False, "x")
    del ct
    return out


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def print_tables(console: Console, report: dict[str, Any]) -> None:
    """Per-workload figures, then the ratios and the targets."""
    for workload, readers in report["results"].items():
        info = report["workloads"][workload]
        title = f"{workload}: {info['objects']} objects, {info['bytes'] / 1e9:.3f} GB (medians)"
        table = Table(title=title)
        for column in ("reader", "GB/s", "obj/s", "CPU s/GB", "peak RSS MB", "p50 ms", "p99 ms",
                       "note"):  # fmt: skip
            left = column in ("reader", "note")
            table.add_column(column, justify="left" if left else "right", no_wrap=column != "note")
        for name, entry in readers.items():
            if entry.get("status") != "ok":
                short = entry.get("short") or entry.get("note", "")
                table.add_row(name, "-", "-", "-", "-", "-", "-", f"{entry['status']}: {short}")
                continue
            m = entry["median"]
            lat = entry.get("latency_paced") or entry.get("latency_burst") or {}
            table.add_row(
                name, _fmt(m["gb_per_s"], 3), _fmt(m["objects_per_s"], 1),
                _fmt(m["cpu_s_per_gb"]), _fmt(m["peak_rss_bytes"] / 1e6, 0),
                _fmt(lat.get("p50_ms"), 1), _fmt(lat.get("p99_ms"), 1),
                "latency: paced" if "latency_paced" in entry else
                ("latency: burst" if lat else ""),
            )  # fmt: skip
        console.print(table)
    ratio = Table(title="ours / reference (GB/s, medians)")
    for column in ("workload", "ours GB/s", "fastest ceiling", "/ ceiling", "/ naive",
                   "/ kvikio-raw", "/ kvikio"):  # fmt: skip
        ratio.add_column(column, justify="left" if column == "workload" else "right")
    for r in report["ratios"]:
        ratio.add_row(
            r["workload"], _fmt(r["ours_gb_per_s"], 3), _fmt(r["fastest_ceiling"]),
            _fmt(r["ours_over_ceiling"]), _fmt(r["ours_over_naive"]),
            _fmt(r["ours_over_kvikio_raw"]), _fmt(r["ours_over_kvikio"]),
        )  # fmt: skip
    console.print(ratio)
    goals = Table(title="targets (issue 4)")
    for column in ("target", "measured", "goal", "status"):
        goals.add_column(column, justify="right" if column == "measured" else "left")
    colour = {"met": "green", "missed": "red"}
    for t in report["targets"]:
        value = f"{_fmt(t['value'])} {t['unit']}" if t["value"] is not None else "-"
        style = colour.get(t["status"], "yellow")
        goals.add_row(t["target"], value, t["goal"], f"[{style}]{t['status']}")
    console.print(goals)
    for note in report.get("notes", []):
        console.print(f"note: {note}")


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.write_text(json.dumps(report, indent=2, sort_keys=False, default=str) + "\n")


def plots(report: dict[str, Any], out: Path) -> list[str]:
    """PNG plots; returns the files written, or raises ImportError without matplotlib."""
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
        ax.plot([p["value"] for p in points], [p["gb_per_s"] for p in points], marker="o",
                label="ours (large object)")  # fmt: skip
        ceiling = max(
            (v for c in CEILINGS if (v := _median(report, "large", c, "gb_per_s")) is not None),
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
    for workload in report["results"]:
        ours = _ours(report, workload)
        for kind in ("latency_burst", "latency_paced"):
            values = ours.get(kind, {}).get("all_ms", [])
            if len(values) < 2:
                continue
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, ys, where="post", label=f"{workload} ({kind.split('_')[1]})")
            drawn = True
    if drawn:
        ax.set_xscale("log")
        ax.set_xlabel("notification -> result (ms)")
        ax.set_ylabel("fraction of objects")
        ax.set_title("ours: latency CDF")
        ax.legend()
        path = out / "latency_cdf.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        written.append(str(path))
    plt.close(fig)
    return written
