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
    "Collector",
    "Section",
    "Target",
    "fmt_ms",
    "fmt_ratio",
    "format_table",
    "percentile",
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

    def render(self) -> str:
        parts = [f"## {self.title}", "", format_table(self.headers, self.rows), ""]
        if self.targets:
            parts += ["Targets:", ""] + [f"- {t.line()}" for t in self.targets] + [""]
        if self.notes:
            parts += [f"- {n}" for n in self.notes] + [""]
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
            "# drainer-amqp benchmarks: legacy vs dedicated drainer",
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
            "matter more than absolute figures.",
            "",
        ]
        for section in sorted(self.sections.values(), key=lambda x: x.title):
            lines.append(section.render())
            for name in plots.get(section.key, []):
                lines += ["", f"![{section.title}]({name})"]
            lines.append("")
        (out / "report.md").write_text("\n".join(lines), encoding="utf-8")
        payload = {
            "date": finished.isoformat(),
            "quick": self.quick,
            "machine": info,
            "benchmarks": {k: _jsonable(asdict(s)) for k, s in self.sections.items()},
        }
        (out / "results.json").write_text(json.dumps(payload, indent=2), encoding="utf-8")
        return out


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
