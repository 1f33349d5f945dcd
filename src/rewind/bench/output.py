"""A benchmark report as a table, as JSON and as a plot."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from rich.table import Table

from rewind.bench.model import Report
from rewind.bench.peers import GVisor
from rewind.bench.work import MEDIAN_KEY
from rewind.bench.work import PREFIX as WORK_PREFIX
from rewind.errors import InvalidArgument

GVISOR = GVisor.name


def _figure(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "x":
        return f"{value:.2f}x"
    digits = 1 if unit in ("ms", "MiB") else 3
    return f"{value:.{digits}f} {unit}"


def _is_work(metric: dict) -> bool:
    return metric["key"].startswith(WORK_PREFIX)


def _target(m: dict) -> str:
    if m["target"] is None:
        return ""
    return f"< {_figure(m['target'], m['unit'])}: {'met' if m['met'] else 'missed'}"


def rows(data: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows of a run's table, from its JSON (Report.to_json): each figure with its
    spread, its target and whether it was met, and each peer's figure as a ratio to ours.
    The work section's rows have a table of their own (work_rows)."""
    engines = list(data["peers"])
    header = ["what", "median", "min - max", "target", *(f"{e} (x rewind)" for e in engines)]
    body = []
    for m in data["metrics"]:
        if _is_work(m):
            continue
        unit, samples = m["unit"], m["samples"]
        spread = f"{_figure(min(samples), unit)} - {_figure(max(samples), unit)}" if len(samples) > 1 else ""
        target = _target(m)
        cells = []
        for engine in engines:
            value = m["peers"].get(engine)
            if isinstance(value, list) and value:
                median = statistics.median(value)
                ratio = f" ({median / m['median']:.2f}x)" if m["median"] else ""
                value = _figure(median, unit) + ratio
            cells.append(value or "")
        body.append([m["what"], _figure(m["median"], unit), spread, target, *cells])
    return header, body


def _spread(seconds: list[float] | None) -> str:
    if not seconds:
        return ""
    low, high = min(seconds), max(seconds)
    return f"{low:.3f}" if len(seconds) == 1 else f"{low:.3f} - {high:.3f}"


def work_rows(data: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the work section (bench/work.py): per step the seconds of each
    environment (min - max over the repeats) and the medians of their ratios to the host;
    then the median over the steps."""
    header = ["step", "host s", "rewind s", "rewind / host", "target", "gVisor s", "gVisor / host"]
    body = []
    for m in filter(_is_work, data["metrics"]):
        seconds = m.get("seconds", {})
        gvisor = m["peers"].get(GVISOR, "")
        if isinstance(gvisor, list):
            gvisor = _figure(statistics.median(gvisor), "x") if gvisor else ""
        step = m["key"].removeprefix(WORK_PREFIX).removesuffix("_x")
        body.append([f"{step} of the steps" if m["key"] == MEDIAN_KEY else step, _spread(seconds.get("host")),
                     _spread(seconds.get("rewind")), _figure(m["median"], "x"), _target(m),
                     _spread(seconds.get(GVISOR)), gvisor])
    return header, body


def _table(title: str, header: list[str], body: list[list[str]], target: int) -> Table:
    t = Table(title=title)
    for column in header:
        t.add_column(column)
    for row in body:
        row[target] = row[target].replace("missed", "[red]missed[/]").replace("met", "[green]met[/]")
        t.add_row(*row)
    return t


def tables(report: Report) -> list[Table]:
    """The run's tables: its figures, and the work section's where it ran; each only if it has rows."""
    mode = "quick" if report.quick else "full"
    accel = report.machine.get("accel", "?")
    data = report.to_json()
    found = []
    header, body = rows(data)
    if body:
        found.append(_table(f"rewind bench ({mode}, {accel}, {report.rounds} rounds)", header, body, 3))
    header, body = work_rows(data)
    if body:
        found.append(_table(f"rewind bench --work ({mode}, {accel}, {report.rounds} repeats): "
                            "seconds min - max, medians of the ratios", header, body, 4))
    return found


def markdown(data: dict) -> str:
    """The same tables in Markdown, for docs/performance.md."""
    text = []
    for header, body in (rows(data), work_rows(data)):
        if body:
            lines = [" | ".join(header), " | ".join("---" for _ in header)]
            lines += [" | ".join(cell.replace("missed", "**missed**") for cell in row) for row in body]
            text.append("".join(f"| {line} |\n" for line in lines))
    return "\n".join(text)


def write_json(report: Report, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report.to_json(), indent=2))
    os.replace(tmp, path)


def check_plotting() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise InvalidArgument("plotting needs matplotlib: pip install 'rewind[bench]'") from e


def write_plot(report: Report, path: Path) -> None:
    """Checkpoint time against memory in use, one line per engine."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    for engine, points in report.curve.items():
        if points:
            axes.plot([mib for mib, _ in points], [s for _, s in points], marker="o", label=engine)
    axes.set_xlabel("guest memory in use (MiB)")
    axes.set_ylabel("checkpoint time (s)")
    axes.set_title(f"Checkpoint cost against memory in use ({report.machine.get('accel', '?')})")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(tmp, dpi=120)
    pyplot.close(figure)
    os.replace(tmp, path)
