"""``dicom-ingest top``: a terminal view of running workers, from their ``/metrics``.

Each tick scrapes every URL given, and shows per worker what an operator
watches at night: objects/s and MB/s since the last tick, dead letters and
retries, the mean and p50/p99 end-to-end latency over the tick (from the
histogram's buckets, as Prometheus' ``histogram_quantile`` estimates it), ring
occupancy and waits, S3 requests in flight, and the consumer lag and commit age
of each partition. It reads only the exposition text, so it works against any
worker it can reach (a port-forward to a pod, the compose stack's published port).
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import anyio
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

Labels = tuple[tuple[str, str], ...]


@dataclass(slots=True)
class Scrape:
    """One scrape's samples: name -> labels -> value, and when it was taken."""

    at: float
    samples: dict[str, dict[Labels, float]] = field(default_factory=lambda: defaultdict(dict))

    def total(self, name: str, **match: str) -> float:
        return sum(
            v
            for labels, v in self.samples.get(name, {}).items()
            if all((k, want) in labels for k, want in match.items())
        )

    def by(self, name: str, key: str) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for labels, v in self.samples.get(name, {}).items():
            out[dict(labels).get(key, "")] += v
        return out


def parse(text: str, at: float) -> Scrape:
    scrape = Scrape(at)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            scrape.samples[s.name][tuple(sorted(s.labels.items()))] = s.value
    return scrape


def quantile(q: float, before: Scrape, after: Scrape) -> float:
    """``histogram_quantile`` of the stage histogram's buckets over the tick (cut it to one
    stage first, ``stage_only``): linear within the bucket the rank falls in."""
    name = "dicom_ingest_stage_seconds_bucket"
    now, then = after.by(name, "le"), before.by(name, "le")
    buckets = sorted(
        ((float(le), now.get(le, 0.0) - then.get(le, 0.0)) for le in now),
        key=lambda b: b[0],
    )
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            span = count - below
            return lower + (upper - lower) * ((rank - below) / span if span else 0.0)
        lower, below = upper, count
    return math.nan


def stage_only(scrape: Scrape, stage: str) -> Scrape:
    """The scrape with the stage histogram cut down to one stage."""
    cut = Scrape(scrape.at, defaultdict(dict, scrape.samples))
    name = "dicom_ingest_stage_seconds_bucket"
    cut.samples[name] = {
        k: v for k, v in scrape.samples.get(name, {}).items() if ("stage", stage) in k
    }
    return cut


def render(url: str, before: Scrape, after: Scrape) -> Table:
    seconds = max(after.at - before.at, 1e-9)

    def rate(name: str, **match: str) -> float:
        return (after.total(name, **match) - before.total(name, **match)) / seconds

    e2e_before, e2e_after = stage_only(before, "end_to_end"), stage_only(after, "end_to_end")
    done = rate("dicom_ingest_stage_seconds_count", stage="end_to_end") * seconds
    spent = rate("dicom_ingest_stage_seconds_sum", stage="end_to_end") * seconds
    mean = spent / done if done else math.nan
    table = Table(title=url, show_header=True, header_style="bold", expand=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    slots = after.total("dicom_ingest_ring_slots") or math.nan
    rows = [
        ("processed /s", f"{rate('dicom_ingest_objects_total', outcome='processed'):.1f}"),
        ("dead-lettered /s", f"{rate('dicom_ingest_objects_total', outcome='dead_lettered'):.2f}"),
        ("MB/s", f"{rate('dicom_ingest_source_bytes_total', outcome='processed') / 1e6:.1f}"),
        ("retries /s", f"{rate('dicom_ingest_retries_total'):.2f}"),
        ("end to end mean", _ms(mean)),
        ("end to end p50", _ms(quantile(0.5, e2e_before, e2e_after))),
        ("end to end p99", _ms(quantile(0.99, e2e_before, e2e_after))),
        ("ring in use", f"{after.total('dicom_ingest_ring_slots_in_use') / slots:.0%}"),
        ("ring waits /s", f"{rate('dicom_ingest_ring_waits_total'):.1f}"),
        ("GETs in flight", f"{after.total('dicom_ingest_ranges_in_flight'):.0f}"),
        ("CPU (cores)", f"{rate('process_cpu_seconds_total'):.2f}"),
    ]
    for labels, lag in sorted(after.samples.get("dicom_ingest_consumer_lag", {}).items()):
        where = dict(labels)
        age = after.samples.get("dicom_ingest_commit_age_seconds", {}).get(labels, 0.0)
        rows.append((f"lag {where['topic']}/{where['partition']}", f"{lag:.0f} ({age:.0f} s)"))
    for what, shown in rows:
        table.add_row(what, shown)
    return table


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.0f} ms"


SCRAPE_TIMEOUT_S = 5.0


async def scrape(http: aiohttp.ClientSession, url: str) -> Scrape | str:
    """One scrape of ``url``, or why there is none (in words, for the operator)."""
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as resp:
            if resp.status != 200:
                return f"HTTP {resp.status} {resp.reason or ''}".rstrip()
            text = await resp.text()
    except TimeoutError:
        return f"no answer within {SCRAPE_TIMEOUT_S:g} s"
    except aiohttp.ClientConnectorError as exc:
        return f"cannot connect: {exc.os_error.strerror or exc.os_error}"
    except (aiohttp.ClientError, ValueError) as exc:  # ValueError: not a URL
        return f"{type(exc).__name__}: {exc}"
    try:
        return parse(text, anyio.current_time())
    except ValueError as exc:
        return f"not Prometheus text: {exc}"


def unreachable(url: str, why: str) -> Table:
    table = Table(title=url, show_header=True, header_style="bold", expand=False)
    table.add_column("what")
    table.add_column("value")
    table.add_row("no answer", why)
    return table


async def run_top(urls: Sequence[str], interval: float, *, once: bool = False) -> int:
    """Scrape ``urls`` every ``interval`` s and redraw until Ctrl-C (``once``: one table).

    A target that does not answer says why, on stderr at once and in its table;
    with ``once`` the status is 1 when any target gave no answer.
    """
    console = Console()
    async with aiohttp.ClientSession(trust_env=True) as http:  # HTTP(S)_PROXY, NO_PROXY
        said: dict[str, str] = {}  # what stderr was last told of each target

        def tell(url: str, got: Scrape | str) -> None:
            if isinstance(got, str) and said.get(url) != got:
                print(f"dicom-ingest top: {url}: {got}", file=sys.stderr)
            said[url] = got if isinstance(got, str) else ""

        last = {u: await scrape(http, u) for u in urls}
        for url, got in last.items():
            tell(url, got)
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while True:
                await anyio.sleep(interval)
                views: list[Table] = []
                failed = False
                for url in urls:
                    now, before = await scrape(http, url), last[url]
                    if isinstance(now, str) or isinstance(before, str):
                        failed = True
                        views.append(unreachable(url, now if isinstance(now, str) else str(before)))
                    else:
                        views.append(render(url, before, now))
                    last[url] = now
                    tell(url, now)
                live.update(Group(*views), refresh=True)
                if once:
                    return 1 if failed else 0
