"""A benchmark report as a table, as JSON and as a plot."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from rich.table import Table

from rewind.bench.model import Report
from rewind.errors import InvalidArgument


def _figure(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    digits = 1 if unit in ("ms", "MiB") else 3
    return f"{value:.{digits}f} {unit}"


def rows(data: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows of a run's table, from its JSON (Report.to_json): each figure with its
    spread, its target and whether it was met, and each peer's figure as a ratio to ours."""
    engines = list(data["peers"])
    header = ["what", "median", "min - max", "target", *(f"{e} (x rewind)" for e in engines)]
    body = []
    for m in data["metrics"]:
        unit, samples = m["unit"], m["samples"]
        spread = f"{_figure(min(samples), unit)} - {_figure(max(samples), unit)}" if len(samples) > 1 else ""
        target = "" if m["target"] is None else \
            f"< {_figure(m['target'], unit)}: {'met' if m['met'] else 'missed'}"
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


def table(report: Report) -> Table:
    mode = "quick" if report.quick else "full"
    t = Table(title=f"rewind bench ({mode}, {report.machine.get('accel', '?')}, {report.rounds} rounds)")
    header, body = rows(report.to_json())
    for column in header:
        t.add_column(column)
    for row in body:
        row[3] = row[3].replace("missed", "[red]missed[/]").replace("met", "[green]met[/]")
        t.add_row(*row)
    return t


def markdown(data: dict) -> str:
    """The same table in Markdown, for the README."""
    header, body = rows(data)
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    lines += [" | ".join(cell.replace("missed", "**missed**") for cell in row) for row in body]
    return "".join(f"| {line} |\n" for line in lines)


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
