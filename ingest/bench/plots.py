"""The benchmark's PNG plots: throughput against part size and concurrency (the sweeps), and
the latency CDF of every run of ours. matplotlib is optional (the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ingest.bench.report import CEILINGS, MODES, SCALED, median_of, ours_entry


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
