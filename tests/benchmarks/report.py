"""Benchmark results: statistics, console tables, and the written report.

Each benchmark adds a :class:`Section` (a table, notes, targets and its raw figures) to
the session's :class:`Collector`; at the end of the session the collector writes

* ``bench-results/report.md``: every table, the date, the machine, the caveats;
* ``bench-results/results.json``: the raw figures;
* PNG plots (matplotlib, Agg backend) for the benchmarks that have one.

The output directory is ``bench-results/`` at the repository root, or
``$DRAINER_BENCH_OUT``. Only the benchmarks that ran in this session are written.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = [
    "SPREAD_HEADERS",
    "Collector",
    "Section",
    "Target",
    "fmt_ms",
    "fmt_ratio",
    "format_table",
    "percentile",
    "spread",
    "spread_cells",
    "summarize",
]

REPO_ROOT = Path(__file__).resolve().parents[2]


# -- statistics ------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Count, P50/P95/P99/max and mean of ``values`` (seconds in, seconds out)."""
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": max(values) if values else math.nan,
        "mean": sum(values) / len(values) if values else math.nan,
    }


def spread(counts: Sequence[int]) -> dict[str, float]:
    """Per-thread publish counts: min, mean, max, and min as a fraction of the mean (1.0:
    every thread got as many as the average one; near 0: some thread starved)."""
    if not counts:
        return {"min": math.nan, "mean": math.nan, "max": math.nan, "min_of_mean": math.nan}
    mean = sum(counts) / len(counts)
    return {
        "min": float(min(counts)),
        "mean": mean,
        "max": float(max(counts)),
        "min_of_mean": min(counts) / mean if mean else math.nan,
    }


def per_thread_result(counts: Sequence[int], latencies: Sequence[float]) -> dict[str, object]:
    """What every thread saw, for results.json: publish latency P50/P95/P99/P99.9/max and
    the per-thread :func:`spread`."""
    return {
        **{f"p{q:g}_s".replace(".", ""): percentile(latencies, q) for q in (50, 95, 99, 99.9)},
        "max_s": max(latencies, default=math.nan),
        "per_thread": spread(counts),
    }


def spread_cells(counts: Sequence[int], latencies: Sequence[float]) -> list[str]:
    """Table cells: per-thread publishes min / mean / max, min as % of mean, then publish
    latency P50 / P99 / P99.9 / max."""
    s = spread(counts)
    pct = "-" if math.isnan(s["min_of_mean"]) else f"{100 * s['min_of_mean']:.0f}%"
    return [
        f"{s['min']:,.0f} / {s['mean']:,.0f} / {s['max']:,.0f}",
        pct,
        *(fmt_ms(percentile(latencies, q)) for q in (50, 99, 99.9)),
        fmt_ms(max(latencies) if latencies else None),
    ]


#: Headers of :func:`spread_cells`.
SPREAD_HEADERS = [
    "per-thread publishes min / mean / max",
    "min % of mean",
    "P50",
    "P99",
    "P99.9",
    "max (longest call)",
]


def fmt_ms(seconds: float | None) -> str:
    """Seconds as milliseconds with enough digits for both 0.02 ms and 2000 ms."""
    if seconds is None or math.isnan(seconds):
        return "-"
    ms = seconds * 1000.0
    if ms >= 100:
        return f"{ms:.0f} ms"
    if ms >= 1:
        return f"{ms:.2f} ms"
    return f"{ms:.3f} ms"


def fmt_ratio(value: float | None) -> str:
    if value is None or math.isnan(value) or math.isinf(value):
        return "-"
    if value >= 100:
        return f"{value:.0f}x"
    if value < 0.1:
        return f"{value:.2g}x"
    return f"{value:.2f}x"


def ratio(a: float, b: float) -> float:
    """``a / b``, NaN when ``b`` is zero or either is NaN."""
    if b == 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table whose columns line up in a terminal too."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


# -- results -----------------------------------------------------------------------------
@dataclass
class Target:
    """A performance goal: ``observed`` against ``bound`` (a human-readable condition)."""

    name: str
    observed: str
    bound: str
    met: bool
    asserted: bool = False

    def line(self) -> str:
        status = "met" if self.met else "NOT MET"
        kind = "asserted" if self.asserted else "reported"
        return f"{self.name}: {self.observed} (target {self.bound}) -> {status} [{kind}]"


@dataclass
class Section:
    """One benchmark's results."""

    key: str
    title: str
    headers: list[str]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0  #: wall time of the benchmark
    order: int = 100  #: place in report.md (then by title): the headline tables come first

    def render(self) -> str:
        parts = [f"## {self.title}", "", format_table(self.headers, self.rows), ""]
        if self.targets:
            parts += ["Targets:", ""] + [f"- {t.line()}" for t in self.targets] + [""]
        if self.notes:
            parts += [f"- {n}" for n in self.notes] + [""]
        if self.seconds:
            parts.append(f"Wall time of this benchmark: {self.seconds:.1f} s")
        return "\n".join(parts)

    def print(self) -> None:
        """Print the section to stdout (visible with ``pytest -s``)."""
        print("\n" + self.render() + "\n", flush=True)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
    }
    try:
        import amqp
        import kombu

        info["amqp"] = amqp.__version__
        info["kombu"] = kombu.__version__
    except ImportError:  # pragma: no cover - both are dependencies
        pass
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            info["loadavg_at_end"] = f.read().split()[:3]
    except OSError:
        pass
    return info


class Collector:
    """The session's results; :meth:`write` turns them into the report."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.sections: dict[str, Section] = {}
        self.started = datetime.now(timezone.utc)
        self.broker_version: str | None = None

    def add(self, section: Section) -> None:
        self.sections[section.key] = section
        section.print()

    def write(self, out_dir: Path | None = None) -> Path | None:
        if not self.sections:
            return None
        out = out_dir or Path(os.environ.get("DRAINER_BENCH_OUT", REPO_ROOT / "bench-results"))
        out.mkdir(parents=True, exist_ok=True)
        info = machine_info()
        info["broker"] = self.broker_version
        plots = _plots(self.sections, out)
        finished = datetime.now(timezone.utc)
        mode = "quick (DRAINER_BENCH_QUICK=1)" if self.quick else "full"
        lines = [
            "# drainer-amqp benchmarks: the dedicated drainer against legacy mode, stock "
            "kombu/py-amqp and amqpstorm",
            "",
            f"- Date: {finished:%Y-%m-%d %H:%M} UTC "
            f"(session {(finished - self.started).total_seconds():.0f} s)",
            f"- Machine: {info['cores']} cores, {info['platform']}, Python {info['python']}, "
            f"py-amqp {info.get('amqp')}, kombu {info.get('kombu')}, "
            f"RabbitMQ {info['broker'] or '?'} on the same machine",
            f"- Mode: {mode}",
            "- Caveat: one local run on a shared machine (the broker runs on the same cores); "
            "figures are indicative. Ratios between the two modes are measured in the same "
            "run, in interleaved rounds (legacy and drainer alternate, ABBA order), so they "
            "matter more than absolute figures. Benchmarks A-E compare every client in the same "
            "run, the client order reversed from one round to the next.",
            "",
        ]
        for section in sorted(self.sections.values(), key=lambda x: (x.order, x.title)):
            lines.append(section.render())
            for name in plots.get(section.key, []):
                lines += ["", f"![{section.title}]({name})"]
            lines.append("")
        (out / "report.md").write_text("\n".join(lines), encoding="utf-8")
        benchmarks = {k: _jsonable(asdict(s)) for k, s in self.sections.items()}
        payload = {
            "date": finished.isoformat(),
            "quick": self.quick,
            "machine": info,
            "benchmarks": benchmarks,
        }
        (out / "results.json").write_text(json.dumps(payload, indent=2), encoding="utf-8")
        headline = headline_markdown(benchmarks)
        if headline:
            (out / "headline.md").write_text(headline, encoding="utf-8")
        return out


def headline_markdown(benchmarks: dict[str, Any]) -> str:
    """README-style headline tables (the drainer against each baseline, with ratios) from
    results.json's ``benchmarks`` (or the sections as dicts); empty if A-C did not run."""

    def f(v: float | None, spec: str = ",.0f") -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    parts: list[str] = []
    a = benchmarks.get("clients_throughput", {}).get("raw", {}).get("results", [])
    if a:
        clients = list(dict.fromkeys(r["client"] for r in a))
        others = [c for c in clients if c != "drainer"]
        by = {(r["client"], r["threads"], r["confirms"]): r for r in a}
        rows = []
        for threads, confirms in dict.fromkeys((r["threads"], r["confirms"]) for r in a):
            dr = by[("drainer", threads, confirms)]["msg_s"]
            row = [f"{threads} threads, {'confirms' if confirms else 'no confirms'}", f(dr)]
            for c in others:
                v = by[(c, threads, confirms)]["msg_s"]
                row.append(f"{f(v)} ({fmt_ratio(ratio(dr, v))})")
            rows.append(row)
        parts += [
            "Publish throughput, msg/s through Producer.publish, 64-byte bodies "
            "(in brackets: drainer / that client):",
            "",
            format_table(["threads, confirms", "drainer", *others], rows),
            "",
        ]
        fair = []
        for r in a:
            spread_ = r.get("per_thread")
            if spread_ is None:
                continue
            pct = spread_.get("min_of_mean")
            fair.append(
                [
                    r["client"],
                    f"{r['threads']}, {'confirms' if r['confirms'] else 'no confirms'}",
                    "-" if pct is None or math.isnan(pct) else f"{100 * pct:.0f}%",
                    fmt_ms(r.get("p999_s")),
                    fmt_ms(r.get("max_s")),
                ]
            )
        if fair:
            parts += [
                "Fairness: the slowest thread's publishes as % of the mean thread's, and the "
                "slowest publish calls:",
                "",
                format_table(
                    ["client", "threads, confirms", "min % of mean", "P99.9", "max"], fair
                ),
                "",
            ]
    b = benchmarks.get("call_cost", {}).get("raw", {}).get("median_s", {})
    if b:
        rows = [[name, f"{v * 1e6:.1f}"] for name, v in b.items()]
        parts += ["One thread, µs per call (no confirms):", "", format_table(["call", "µs"], rows)]
        parts.append("")
    c = benchmarks.get("gunicorn", {}).get("raw", {}).get("results", [])
    if c:
        rows = [
            [
                r["client"],
                f(r["req_s"]),
                fmt_ratio(r["vs_no_amqp"]),
                fmt_ms(r["p50"]),
                fmt_ms(r["p99"]),
            ]
            for r in c
        ]
        parts += [
            "gunicorn gthread, 1 worker x 16 threads, one confirmed publish per request:",
            "",
            format_table(["app", "req/s", "vs no AMQP", "P50", "P99"], rows),
            "",
        ]
    return "\n".join(parts)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


# -- plots ---------------------------------------------------------------------------------
MODE_COLORS = {"legacy": "#d62728", "drainer": "#1f77b4"}


def _plots(sections: dict[str, Section], out: Path) -> dict[str, list[str]]:
    import matplotlib

    matplotlib.use("Agg")
    made: dict[str, list[str]] = {}
    makers = {
        "publish_latency": _plot_publish_latency,
        "throughput": _plot_throughput,
        "recovery_latency": _plot_recovery,
        "clients_throughput": _plot_clients_throughput,
        "call_cost": _plot_call_cost,
        "gunicorn": _plot_gunicorn,
        "idle_connections": _plot_idle,
        "undrained": _plot_undrained,
    }
    for key, maker in makers.items():
        if key in sections:
            name = maker(sections[key].raw, out)
            if name:
                made[key] = [name]
    return made


def _plot_publish_latency(raw: dict[str, Any], out: Path) -> str | None:
    import matplotlib.pyplot as plt

    samples = raw.get("samples_s", {})
    if not samples:
        return None
    fig, (ax_cdf, ax_box) = plt.subplots(1, 2, figsize=(12, 4.8))
    for mode, values in samples.items():
        if not values:
            continue
        ms = sorted(v * 1000.0 for v in values)
        frac = [(i + 1) / len(ms) for i in range(len(ms))]
        ax_cdf.step(ms, frac, where="post", color=MODE_COLORS[mode], label=f"{mode} (n={len(ms)})")
    for mode, values in raw.get("no_consumer_samples_s", {}).items():
        if not values:
            continue
        ms = sorted(v * 1000.0 for v in values)
        frac = [(i + 1) / len(ms) for i in range(len(ms))]
        ax_cdf.step(
            ms,
            frac,
            where="post",
            color=MODE_COLORS[mode],
            linestyle=":",
            label=f"{mode}, no consumer thread (n={len(ms)})",
        )
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("publish latency (ms, log scale)")
    ax_cdf.set_ylabel("fraction of publishes <= x")
    ax_cdf.set_title("Cumulative distribution")
    ax_cdf.grid(True, which="both", alpha=0.3)
    ax_cdf.legend(loc="lower right")
    modes = [m for m in ("legacy", "drainer") if samples.get(m)]
    data = [[v * 1000.0 for v in samples[m]] for m in modes]
    box = ax_box.boxplot(data, whis=(1, 99), showfliers=True, patch_artist=True)
    ax_box.set_xticks(range(1, len(modes) + 1), modes)
    for patch, mode in zip(box["boxes"], modes, strict=True):
        patch.set_facecolor(MODE_COLORS[mode])
        patch.set_alpha(0.4)
    ax_box.set_yscale("log")
    ax_box.set_ylabel("publish latency (ms, log scale)")
    ax_box.set_title("Per mode (whiskers P1-P99)")
    ax_box.grid(True, which="both", axis="y", alpha=0.3)
    fig.suptitle("Benchmark 1: basic_publish latency beside a thread in drain_events(timeout=1)")
    fig.tight_layout()
    name = "publish_latency.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def _plot_throughput(raw: dict[str, Any], out: Path) -> str | None:
    import matplotlib.pyplot as plt

    results = raw.get("results", [])
    if not results:
        return None
    ceiling = raw.get("ceiling_msg_s")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, confirms in zip(axes, (False, True), strict=True):
        rows = [r for r in results if r["confirms"] == confirms]
        threads = sorted({r["threads"] for r in rows})
        width = 0.38
        for i, mode in enumerate(("legacy", "drainer")):
            rates = []
            for t in threads:
                match = [r["msg_s"] for r in rows if r["threads"] == t and r["mode"] == mode]
                rates.append(match[0] if match else 0.0)
            xs = [j + (i - 0.5) * width for j in range(len(threads))]
            bars = ax.bar(xs, rates, width, color=MODE_COLORS[mode], label=mode)
            ax.bar_label(bars, labels=[f"{r:,.0f}" for r in rates], fontsize=8)
        ax.set_xticks(range(len(threads)), [f"{t} threads" for t in threads])
        ax.set_ylim(0, ax.get_ylim()[1] * 1.2)  # room for the legend above the bars
        ax.set_ylabel("messages per second (median of rounds)")
        ax.set_title("with publisher confirms" if confirms else "no confirms")
        if ceiling and not confirms:
            top = ax.get_ylim()[1]
            label = f"raw-socket ceiling {ceiling:,.0f} msg/s"
            if ceiling > top:
                label += " (above the scale)"
            ax.axhline(ceiling, color="gray", linestyle="--", label=label)
            ax.set_ylim(0, top)
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Benchmark 2: publish throughput, threads sharing one connection")
    fig.tight_layout()
    name = "throughput.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def _plot_recovery(raw: dict[str, Any], out: Path) -> str | None:
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    results = raw.get("results", [])
    if not results:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.8))
    threads = sorted({r["threads"] for r in results})
    for mode in ("legacy", "drainer"):
        for j, t in enumerate(threads):
            rounds = [r for r in results if r["threads"] == t and r["mode"] == mode]
            values = [r["max_s"] * 1000.0 for r in rounds]
            offset = -0.12 if mode == "legacy" else 0.12
            ax.scatter(
                [j + offset] * len(values),
                values,
                color=MODE_COLORS[mode],
                alpha=0.6,
                label=mode if j == 0 else None,
            )
            if values:
                med = percentile(values, 50)
                ax.hlines(med, j + offset - 0.1, j + offset + 0.1, color=MODE_COLORS[mode])
                left = mode == "legacy"
                ax.annotate(
                    fmt_ms(med / 1000.0),
                    (j + offset + (-0.11 if left else 0.11), med),
                    fontsize=8,
                    va="center",
                    ha="right" if left else "left",
                )
    ax.set_xticks(range(len(threads)), [f"{t} threads" for t in threads])
    ax.set_xlim(-0.7, len(threads) - 0.3)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylabel("fault -> last thread's exception (ms, log scale)")
    ax.set_title("Benchmark 3: error propagation after a TCP reset (dots: rounds, bar: median)")
    ax.grid(True, which="both", axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    name = "recovery_latency.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


# -- plots of the comparison benchmarks (A-E): one colour per client ----------------------
def _color(client: str) -> str:
    from benchmarks.clients import CLIENT_COLORS

    for name, color in CLIENT_COLORS.items():
        if client.startswith(name):
            return color
    return "#8c564b"


def _save(fig: Any, out: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def _plot_clients_throughput(raw: dict[str, Any], out: Path) -> str | None:
    import matplotlib.pyplot as plt

    results = raw.get("results", [])
    if not results:
        return None
    clients = list(dict.fromkeys(r["client"] for r in results))
    configs = list(dict.fromkeys((r["threads"], r["confirms"]) for r in results))
    fig, (ax_rate, ax_p99) = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / len(clients)
    for i, client in enumerate(clients):
        xs = [j + (i - (len(clients) - 1) / 2) * width for j in range(len(configs))]
        by = {(r["threads"], r["confirms"]): r for r in results if r["client"] == client}
        rates = [by[c]["msg_s"] if c in by else 0.0 for c in configs]
        p999 = [by[c].get("p999_s", by[c]["p99_s"]) * 1000.0 if c in by else 0.0 for c in configs]
        ax_rate.bar(xs, rates, width, color=_color(client), label=client)
        ax_p99.bar(xs, p999, width, color=_color(client), label=client)
    labels = [f"{t} thr, {'confirms' if c else 'no confirms'}" for t, c in configs]
    for ax in (ax_rate, ax_p99):
        ax.set_xticks(range(len(configs)), labels, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    ceiling = raw.get("ceiling_msg_s")
    ax_rate.set_yscale("log")
    if ceiling:
        ax_rate.axhline(ceiling, color="gray", linestyle="--", label="raw-socket ceiling")
    ax_rate.set_ylabel("messages per second (log scale)")
    ax_rate.set_title("Throughput (median of rounds)")
    ax_rate.legend(fontsize=8)
    ax_p99.set_yscale("log")
    ax_p99.set_ylabel("P99.9 publish call (ms, log scale)")
    ax_p99.set_title("P99.9 publish latency, every call of every thread")
    fig.suptitle("A. Producer.publish throughput by client, 64-byte bodies")
    return _save(fig, out, "clients_throughput.png")


def _plot_call_cost(raw: dict[str, Any], out: Path) -> str | None:
    import matplotlib.pyplot as plt

    med = raw.get("median_s", {})
    if not med:
        return None
    names = list(med)
    fig, ax = plt.subplots(figsize=(9, 4.8))
    values = [med[n] * 1e6 for n in names]
    bars = ax.barh(names, values, color=[_color(n) for n in names])
    ax.bar_label(bars, labels=[f"{v:.1f} µs" for v in values], fontsize=8)
    ax.axvline(8, color="gray", linestyle=":", label="basic_publish target 8 µs")
    ax.axvline(30, color="gray", linestyle="--", label="Producer.publish target 30 µs")
    ax.invert_yaxis()
    ax.set_xlabel("µs per call, one thread (median of runs)")
    ax.set_title("B. One-thread cost per publish call")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, out, "call_cost.png")


def _plot_gunicorn(raw: dict[str, Any], out: Path) -> str | None:
    import matplotlib.pyplot as plt

    results = raw.get("results", [])
    if not results:
        return None
    names = [r["client"] for r in results]
    fig, (ax_rate, ax_lat) = plt.subplots(1, 2, figsize=(13, 4.8))
    bars = ax_rate.bar(names, [r["req_s"] for r in results], color=[_color(n) for n in names])
    ax_rate.bar_label(
        bars,
        labels=[f"{r['req_s']:,.0f}\n({fmt_ratio(r['vs_no_amqp'])})" for r in results],
        fontsize=8,
    )
    ax_rate.set_ylim(0, ax_rate.get_ylim()[1] * 1.15)
    ax_rate.set_ylabel("requests per second (ratio to no AMQP)")
    ax_rate.set_title("Throughput")
    width = 0.27
    for k, q in enumerate(("p50", "p95", "p99")):
        xs = [j + (k - 1) * width for j in range(len(names))]
        ax_lat.bar(
            xs,
            [r[q] * 1000.0 for r in results],
            width,
            color=[_color(n) for n in names],
            alpha=(0.45, 0.7, 1.0)[k],
            label=q.upper(),
        )
    ax_lat.set_xticks(range(len(names)), names)
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("request latency (ms, log scale)")
    ax_lat.set_title("P50 / P95 / P99 (light to dark)")
    ax_lat.legend(fontsize=8)
    for ax in (ax_rate, ax_lat):
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("C. gunicorn gthread 1x16, one confirmed publish per request")
    return _save(fig, out, "gunicorn.png")


def _plot_idle(raw: dict[str, Any], out: Path) -> str | None:
    import matplotlib.pyplot as plt

    results = raw.get("results", [])
    if not results:
        return None
    names = [r["mode"] for r in results]
    colors = [_color(n) for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, key, label in zip(
        axes,
        ("threads_per_conn", "fds_per_conn", "rss_per_conn"),
        ("threads per connection", "file descriptors per connection", "RSS per connection (KiB)"),
        strict=True,
    ):
        values = [r[key] / (1024.0 if key == "rss_per_conn" else 1.0) for r in results]
        bars = ax.bar(names, values, color=colors)
        ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=8)
        ax.set_title(label)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"D. {raw.get('count')} idle connections in one process")
    return _save(fig, out, "idle_connections.png")


def _plot_undrained(raw: dict[str, Any], out: Path) -> str | None:
    import matplotlib.pyplot as plt

    results = raw.get("results", [])
    if not results:
        return None
    names = [r["mode"] for r in results]
    growth = [(r["rss_after"] - r["rss_before"]) / 2**20 for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    bars = ax.bar(names, growth, color=[_color(n) for n in names])
    ax.bar_label(bars, labels=[f"{g:.1f} MiB" for g in growth], fontsize=8)
    payload = raw.get("count", 0) * raw.get("body_bytes", 0) / 2**20
    ax.axhline(payload, color="gray", linestyle="--", label=f"bodies published: {payload:.0f} MiB")
    ax.set_ylabel("RSS growth of the consuming process (MiB)")
    ax.set_title(f"E. {raw.get('count', 0):,} deliveries nobody drains")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, out, "undrained.png")
